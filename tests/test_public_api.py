"""The public API is what each package's `__init__` lists in `__all__`, and
docs/design.md ("Public API") lists exactly that: a name added to or taken out of
an `__all__` fails here until the doc says so. Every listed name must exist.

Rewrite the doc's list after a deliberate change:
    JAX_PLATFORMS=cpu python tests/test_public_api.py
"""

import importlib
import pathlib
import re

PACKAGES = ("trace", "segments", "losses", "models", "sampling", "envs", "orchestration",
            "training", "training.core", "training.rl", "training.sft", "training.distill",
            "evals", "serving", "viz", "recipes")
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"
START, END = "<!-- public-api:start -->", "<!-- public-api:end -->"


def render() -> str:
    lines = []
    for p in PACKAGES:
        names = importlib.import_module(f"ac2_jax.{p}").__all__
        lines.append(f"- `ac2_jax.{p}` ({len(names)}): " + ", ".join(f"`{n}`" for n in names))
    total = sum(len(importlib.import_module(f"ac2_jax.{p}").__all__) for p in PACKAGES)
    unique = {n for p in PACKAGES for n in importlib.import_module(f"ac2_jax.{p}").__all__}
    lines.append(f"\n{total} entries, {len(unique)} distinct names.")
    return "\n".join(lines)


def _doc_block(text: str) -> str:
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert m, f"docs/design.md has no {START} ... {END} block"
    return m.group(1).rstrip("\n")


def test_every_exported_name_exists():
    for p in PACKAGES:
        mod = importlib.import_module(f"ac2_jax.{p}")
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, f"ac2_jax.{p}.__all__ lists {missing}, which it does not define"
        assert len(set(mod.__all__)) == len(mod.__all__), f"ac2_jax.{p}.__all__ repeats a name"


def test_design_doc_lists_the_public_api():
    assert _doc_block(DOC.read_text()) == render(), (
        "docs/design.md's Public API list differs from the packages' __all__; if the "
        "change is deliberate, run `JAX_PLATFORMS=cpu python tests/test_public_api.py`")


if __name__ == "__main__":
    text = DOC.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    DOC.write_text(text[:a] + "\n" + render() + "\n" + text[b:])
    print("docs/design.md: Public API rewritten")
