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
    for page in ("index", "concepts", "design", "launch", "results", "notes", "guide",
                 "howto/harness-and-env", "howto/existing-environments",
                 "howto/models-and-lora", "howto/distillation", "howto/async-rl",
                 "howto/scaling-out", "howto/choosing-an-objective", "reference"):
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


# ---------------------------------------------------------------- text that must follow the code

NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def _read(page: str) -> str:
    return (ROOT / "docs" / page).read_text()


def test_the_signal_rules_count_the_property_tests_they_cite():
    """design.md's Signal rules intro says how many property tests check the rules and
    cites them: the count matches the files cited, each one a hypothesis test."""
    intro = _read("design.md").split("## Signal rules", 1)[1].split("\n1. **", 1)[0]
    files = re.findall(r"`(tests/[\w/]+\.py)`", intro)
    said = re.search(r"\b(\w+) property\s+tests", intro)
    assert said and NUMBER_WORDS.get(said.group(1)) == len(files), (said and said.group(0), files)
    for f in files:
        assert "@given" in (ROOT / f).read_text(), f"{f} is cited as a property test"
    for f in ("tests/training/distill/test_distill_traces.py",):
        assert f in intro, f"the property test {f} is not cited"


def test_the_distillation_step_counts_are_documented():
    """Every count the distiller puts in a step's metrics (`STEP_COUNTS`: what did not
    fit seq_len, what kind "sampled" left out or scored without recorded sampling
    parameters) is named in docs/design.md's Signal rules and in docs/concepts.md, and
    Signal rule 9 states its one exception (greedy examples stop the step)."""
    from ac2_jax.training.distill.trainer import STEP_COUNTS
    rules = _read("design.md").split("## Signal rules", 1)[1]
    concepts = _read("concepts.md")
    for name in STEP_COUNTS:
        assert f"`{name}`" in rules, f"design.md Signal rules: {name}"
    for name in ("skipped/too_long", "cut/too_long", "skipped/constrained",
                 "unrecorded_sampling"):
        assert f"`{name}`" in concepts, f"concepts.md: {name}"
    rule9 = rules.split("\n9. **", 1)[1].split("\n10. **", 1)[0]
    assert "greedy" in rule9 and "exception" in rule9


def test_the_rl_loss_snippet_says_attempts():
    """task_mean is a mean over attempts (traces), not over tasks (problems): the
    guide's RL snippet says so."""
    guide = _read("guide.md")
    line = next(x for x in guide.splitlines() if 'aggregate_loss(per_token, batch, "task_mean")' in x)
    assert "over attempts" in line and "over tasks" not in line, line
