"""The docs site builds with warnings as errors, and its API reference covers the public API.

`mkdocs build --strict` (mkdocs-material + mkdocstrings, `[dev]`) turns every
warning into a failure: a broken link between pages, a docstring the Google
parser cannot read, a cross-reference it cannot resolve. The reference then
must show every name of every package's `__all__` (the list
tests/test_public_api.py keeps) as a heading of its own, on its package's page.
"""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.test_public_api import PACKAGES

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs need the [dev] extra (mkdocs)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # Not -q: quiet mode hides the warnings that --strict counts, and then passes.
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_every_page_in_the_nav_is_built(site):
    for page in ("index", "concepts", "design", "launch", "results", "build-notes", "guide",
                 "howto/harness-and-env",
                 "howto/models-and-lora", "howto/distillation", "howto/async-rl",
                 "howto/scaling-out", "reference"):
        built = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert built.is_file(), f"docs: {page} was not built"


def test_the_reference_shows_every_public_name(site):
    missing = {}
    for p in PACKAGES:
        page = site / "reference" / p / "index.html"
        assert page.is_file(), f"docs/reference/{p}.md is missing (one page per package)"
        ids = set(re.findall(r'id="(ac2_jax\.[\w.]+)"', page.read_text()))
        mod = importlib.import_module(f"ac2_jax.{p}")
        # A name is documented as ac2_jax.<pkg>.<name>, or, where it shares its name with
        # a submodule or loads lazily, from its own module on the same page.
        gone = [n for n in mod.__all__ if f"ac2_jax.{p}.{n}" not in ids
                and f"{getattr(getattr(mod, n), '__module__', None)}.{n}" not in ids]
        if gone:
            missing[p] = gone
    assert not missing, (
        f"names in __all__ without an entry in the API reference: {missing}; a name that "
        "shares its name with a submodule or loads on first use needs its own "
        "`::: module.name` block in docs/reference/<package>.md")
