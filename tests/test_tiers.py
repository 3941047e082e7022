"""The tier table (tests/conftest.py FULL_ONLY) names what exists: a stale entry (a file
renamed or moved) would quietly put its tests back into the quick tier."""

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


def test_every_full_only_entry_names_a_file_or_folder_with_tests():
    stale = []
    for key, reason in FULL_ONLY.items():
        assert reason.strip(), f"{key}: a full-only entry says why"
        target = ROOT / key
        if not target.exists():
            stale.append(f"{key}: no such file or folder")
        elif target.is_file() and not _test_functions(target):
            stale.append(f"{key}: defines no test")
    assert not stale, "stale entries in tests/conftest.py FULL_ONLY:\n" + "\n".join(stale)


def test_a_listed_file_or_folder_is_full_and_its_neighbours_are_not():
    assert is_full_only("tests/benchmarks/test_bench_lora.py")
    assert is_full_only("tests/test_train.py")
    assert not is_full_only("tests/test_training.py")
    assert not is_full_only("tests/serving/test_server.py")
