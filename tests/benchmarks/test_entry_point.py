"""`python -m benchmarks NAME [args]`: the listing names every kept benchmark, an unknown
name is one line with the closest name, every runnable module of benchmarks/ is in the
table (or a declared helper), and a run through the entry point reaches the benchmark
with its flags (packing at toy size)."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from benchmarks.__main__ import main
from benchmarks.registry import BENCHMARKS, CONCERNS, SUPPORT

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_listing_names_every_benchmark_under_its_concern(capsys):
    assert main([]) == 0
    listing = capsys.readouterr().out
    for name in BENCHMARKS.names():
        entry = BENCHMARKS.get(name)
        assert entry.concern in CONCERNS, (name, entry.concern)
        assert f"  {name}" in listing and entry.summary in listing, name
    assert "docs/notes/benchmarks-retired.md" in listing


def test_an_unknown_name_is_one_line_with_the_closest(capsys):
    assert main(["matmul_cieling"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown benchmark 'matmul_cieling'" in err and "did you mean 'matmul_ceiling'" in err
    assert main(["bench_packing"]) == 2  # the module's old name points at its entry
    assert "did you mean 'packing'" in capsys.readouterr().err


def _has_main_guard(path: pathlib.Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def _defines_main(path: pathlib.Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def test_every_runnable_module_is_registered_or_a_helper():
    registered = {BENCHMARKS.get(n).module for n in BENCHMARKS.names()}
    for module in registered:
        path = BENCH_DIR / f"{module}.py"
        assert path.is_file() and _defines_main(path), f"benchmarks/{module}.py has no main()"
    runnable = {p.stem for p in BENCH_DIR.glob("*.py") if _has_main_guard(p)} - {"__main__"}
    stray = runnable - registered - set(SUPPORT)
    assert not stray, (
        f"benchmarks/{sorted(stray)} run as scripts but are not in "
        "benchmarks/registry.py's _KEPT (or SUPPORT, for a helper)"
    )
    assert set(SUPPORT) <= {p.stem for p in BENCH_DIR.glob("*.py")}


def test_a_run_through_the_entry_point_passes_its_flags(tmp_path, capsys):
    out = tmp_path / "packing.json"
    assert main(["packing", "--n", "40", "--seq_lens", "512,1024", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["config"]["n"] == 40
    rows = saved["rows"]
    assert [r["seq_len"] for r in rows] == [512, 1024]
    for r in rows:
        # first-fit decreasing never needs more rows than one segment per row
        assert r["segments"] == 40 and 1 <= r["ffd_rows"] <= r["naive_rows"] == 40
        assert 0 <= r["ffd_waste"] <= r["naive_waste"] < 1
    assert "seq_len" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # its own argparse: an unknown flag stops it
        main(["packing", "--no_such_flag"])
