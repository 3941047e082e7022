"""The notebooks run top to bottom under a real Jupyter kernel and end where they say.

Each notebook is executed by nbclient on an ipykernel (the `[dev]` extra), in a temporary
working directory, with one CPU device as a user's session has; any cell that raises fails
the test. Each notebook's last cell prints `SUMMARY {json}` with its key results, which the
checks below read. The notebooks are saved with their outputs; to run them all and save them
again after a change:

    JAX_PLATFORMS=cpu python tests/notebooks/test_notebooks.py
"""

import json
import math
import os
import pathlib
import sys
import tempfile
import time

import pytest

from tests.support.child_env import child_env

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ("quickstart", "train_your_harness", "learn_from_feedback", "bring_your_own_model")


def _kernel_env() -> dict:
    """This interpreter's environment for the kernel: its bin first on PATH (the
    kernelspec runs `python`), and without the suite's 8 forced host devices."""
    return child_env(PATH=os.path.dirname(sys.executable) + os.pathsep
                     + os.environ.get("PATH", ""))


def execute(name: str, cwd: str):
    """Runs notebooks/<name>.ipynb in `cwd` under a fresh python3 kernel; returns it
    with its outputs (nbclient raises CellExecutionError on the first failing cell)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_kernel_env())  # the kernel process inherits this environment
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": cwd}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def summary(nb) -> dict:
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "".join(o.get("text", "") for o in code[-1].outputs if o.output_type == "stream")
    line = next((x for x in text.splitlines() if x.startswith("SUMMARY ")), None)
    assert line, f"the last cell printed no SUMMARY line: {text[-500:]!r}"
    return json.loads(line.removeprefix("SUMMARY "))


def check_quickstart(s):
    # Part 1: one episode from two appended requests; loss = mean(0.1, 0.2, 0.3) (fp32).
    assert s["demo_episodes"] == 1 and s["demo_loss"] == pytest.approx(0.2, abs=1e-6)
    # Parts 2-3: each rollout's trace is one finished episode carrying its reward.
    assert s["status"] == "finished" and s["reward"] == 1.0 and s["trace_episodes"] == 1
    assert s["agent_tokens"] > 0 and s["rewards"] == [1.0, 0.0]
    # Part 4: a real update, then version 1 is published and served.
    assert math.isfinite(s["loss"]) and s["grad_norm"] > 0
    assert s["new_version"] == 1 and s["served_version"] == 1 and s["published"]


def check_train_your_harness(s):
    # Three RL steps, each publishing a version the sampler then serves.
    assert s["steps"] == 3 and s["versions"] == [1, 2, 3]
    # tool_choice="required" made every first request a tool call, and both requests of
    # an attempt are one episode.
    assert s["tool_calls"] == 8 and s["episodes"] == [1] * 8


def check_learn_from_feedback(s):
    # The SFT'd model follows the hint in context and not without it ...
    assert s["hinted_p_blue"] > 0.5 > s["base_p_blue"]
    # ... and a few OPSD or RMSD steps move the un-hinted answer towards the hint.
    assert s["p_blue_after"]["opsd"] > 0.5 and s["p_blue_after"]["rmsd"] > 0.5
    # RMSD trains the one position the judge keeps (the wrong colour); OPSD all five.
    assert s["selected"] == [" red"]
    assert set(s["kept"]["rmsd"]) == {1.0} and set(s["kept"]["opsd"]) == {5.0}


def check_bring_your_own_model(s):
    assert s["family"] == "qwen3" and s["steps"] == 12 and s["peft_rank"] == 8
    assert s["frozen"] and s["merge_gap"] < 1e-4  # base untouched; merged = base + adapters
    assert s["replies"]["greeter"] == "hello" != s["replies"]["base"]


CHECKS = {"quickstart": check_quickstart, "train_your_harness": check_train_your_harness,
          "learn_from_feedback": check_learn_from_feedback,
          "bring_your_own_model": check_bring_your_own_model}


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_under_a_kernel(name, tmp_path):
    pytest.importorskip("nbclient", reason="the notebook tests need the [dev] extra")
    pytest.importorskip("ipykernel", reason="the notebook tests need the [dev] extra")
    CHECKS[name](summary(execute(name, str(tmp_path))))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_saved_with_outputs_and_installs_from_a_checkout_or_a_wheel(name):
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "saved without running"
    assert any(o.get("name") == "stdout" and "SUMMARY" in "".join(o["text"])
               for o in code[-1]["outputs"]), "saved without its outputs"
    install = "".join(code[0]["source"])
    assert 'find_spec("ac2_jax") is None' in install  # a no-op where it is installed
    assert '%pip install -q -e "..[serve,viz]"' in install and ".whl" in install
    text = json.dumps(nb)
    assert "<repo" not in text and "git clone" not in text, "a placeholder install step"


if __name__ == "__main__":  # run every notebook and save it with its outputs
    import nbformat

    for name in sys.argv[1:] or NAMES:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as d:
            nb = execute(name, d)
        CHECKS[name](summary(nb))
        for cell in nb.cells:
            cell.metadata.pop("execution", None)
        nbformat.write(nb, NOTEBOOKS / f"{name}.ipynb")
        print(f"{name}: ran and saved in {time.time() - t0:.1f} s")
