"""The public API is what each package's `__init__` lists in `__all__`, and
docs/design.md ("Public API") lists exactly that: a name added to or taken out of
an `__all__` fails here until the doc says so. Every listed name must exist, and
every deprecation alias (a package's `DEPRECATED`) still resolves to its new name
with a DeprecationWarning that names it. The curation rules: tests/test_layering.py.

Rewrite the doc's list after a deliberate change:
    JAX_PLATFORMS=cpu python tests/test_public_api.py
"""

import importlib
import pathlib
import re
import warnings

import pytest

PACKAGES = ("trace", "segments", "losses", "text", "models", "sampling", "envs",
            "orchestration", "training", "training.core", "training.rl", "training.sft", "training.distill",
            "evals", "serving", "viz", "recipes", "seeds",
            "testing")
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


# Folders that took the path of a module they replaced keep that module's names as their
# DEPRECATED (issue 62 step 3: the module ac2_jax.serving.lifecycle is now lifecycle/routes).
MODULES_BECOME_PACKAGES = ("serving.lifecycle",)


def _deprecations() -> list[tuple[str, str, str]]:
    out = []
    for p in PACKAGES + MODULES_BECOME_PACKAGES:
        for old, new in getattr(importlib.import_module(f"ac2_jax.{p}"), "DEPRECATED", {}).items():
            out.append((p, old, new))
    return out


@pytest.mark.parametrize(("package", "old", "new"), _deprecations())
def test_a_deprecated_name_warns_and_gives_its_replacement(package, old, new):
    mod = importlib.import_module(f"ac2_jax.{package}")
    home, _, name = new.partition(":")
    assert old not in getattr(mod, "__all__", ()), f"ac2_jax.{package}.{old} is deprecated but in __all__"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(mod, old)
    assert got is getattr(importlib.import_module(home), name)
    msgs = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert msgs and f"{home}.{name}" in msgs[0] and f"ac2_jax.{package}.{old}" in msgs[0], msgs


@pytest.mark.parametrize("old", sorted(importlib.import_module("ac2_jax._deprecation").MOVED_MODULES))
def test_a_moved_module_warns_and_gives_its_new_home(old):
    """A moved module's old path (`ac2_jax._deprecation.MOVED_MODULES`) still imports, and
    every name read from it is the new module's own object, with a DeprecationWarning that
    names the new path."""
    from ac2_jax._deprecation import MOVED_MODULES

    new = importlib.import_module(MOVED_MODULES[old])
    names = [n for n in vars(new) if not n.startswith("__")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
        got = {n: getattr(alias, n) for n in names}
        scope: dict = {}
        exec(f"from {old} import {names[-1]}", scope)  # the statement form
    assert names and all(got[n] is getattr(new, n) for n in names)
    assert scope[names[-1]] is getattr(new, names[-1])
    msgs = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert msgs == [f"{old} is deprecated and goes in the next release: use {new.__name__}"] * (
        len(names) + 1)


def test_patching_a_moved_modules_old_path_names_the_new_module(monkeypatch):
    """A patch set on the alias would change nothing the library reads: it is refused,
    naming the module to patch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("ac2_jax.models.tool_parsers")
    msg = (r"^ac2_jax\.models\.tool_parsers is a deprecation alias of "
           r"ac2_jax\.text\.tool_parsers: set DEFAULT_MAX_CHARS on ac2_jax\.text\.tool_parsers")
    with pytest.raises(AttributeError, match=msg):
        monkeypatch.setattr(old, "DEFAULT_MAX_CHARS", 7)
    with pytest.raises(AttributeError, match="delete DEFAULT_MAX_CHARS from ac2_jax.text"):
        del old.DEFAULT_MAX_CHARS
    assert importlib.import_module("ac2_jax.text.tool_parsers").DEFAULT_MAX_CHARS == 1 << 20


def test_a_moved_module_leaves_the_package_name_it_shadowed():
    """`ac2_jax.models.attention` is the function (the package's export) before and after
    its old module path is imported."""
    import ac2_jax.models
    from ac2_jax.models.kernels.attention import attention

    assert ac2_jax.models.attention is attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ac2_jax.models.attention import choose_backend  # noqa: F401
    assert ac2_jax.models.attention is attention


@pytest.mark.parametrize("name", ["rl", "distill", "eval_model"])
def test_a_sync_recipe_inside_an_event_loop_names_its_async_form(name):
    """Async first: each recipe is a coroutine (`arl`, ...); its plain name runs it through
    the one sync runner, which refuses inside a running loop, naming what to await."""
    import asyncio

    from ac2_jax import recipes

    async def inside():
        getattr(recipes, name)("tiny", "no.such:env")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the coroutine is closed, not leaked
        with pytest.raises(RuntimeError, match=rf"^{name} was called inside a running event "
                                               rf"loop; await a{name}\(\.\.\.\)$"):
            asyncio.run(inside())


def test_design_doc_lists_the_public_api():
    assert _doc_block(DOC.read_text()) == render(), (
        "docs/design.md's Public API list differs from the packages' __all__; if the "
        "change is deliberate, run `JAX_PLATFORMS=cpu python tests/test_public_api.py`")


if __name__ == "__main__":
    text = DOC.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    DOC.write_text(text[:a] + "\n" + render() + "\n" + text[b:])
    print("docs/design.md: Public API rewritten")
