"""The tier table (tests/conftest.py FULL_ONLY) names what exists: a stale entry would
quietly move a test back into the quick tier, or name nothing at all."""

import ast
import pathlib

from tests.conftest import FULL_ONLY, is_full_only

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _test_functions(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test")
    }


def test_every_full_only_entry_names_a_file_folder_or_test_that_exists():
    stale = []
    for key, reason in FULL_ONLY.items():
        assert reason.strip(), f"{key}: a full-only entry says why"
        path, _, name = key.partition("::")
        target = ROOT / path
        if not target.exists():
            stale.append(f"{key}: no such file or folder")
        elif name and name not in _test_functions(target):
            stale.append(f"{key}: {path} defines no test {name!r}")
    assert not stale, "stale entries in tests/conftest.py FULL_ONLY:\n" + "\n".join(stale)


def test_a_listed_test_id_is_full_and_its_neighbours_are_not():
    assert is_full_only("tests/serving/test_server.py", "test_command_line_server")
    assert not is_full_only(
        "tests/serving/test_server.py", "test_serve_in_thread_starts_on_a_free_port_and_stops"
    )
    assert not is_full_only("tests/serving/test_server.py", "test_command_line_server_x")
    assert is_full_only("tests/benchmarks/test_bench_lora.py", "test_anything")
    assert is_full_only("tests/test_train.py", "test_anything")
    assert not is_full_only("tests/test_training.py", "test_anything")
