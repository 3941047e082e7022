"""The README's "Train your agent" example runs as written.

The code block after the `<!-- readme-example -->` marker is run unchanged, in a fresh
interpreter, in a temporary working directory: it trains two RL steps of the `tiny`
preset on its own toy env and writes its report where it says.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-example -->"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, f"README.md has no {MARKER} marker before its example"
    m = re.match(r"\s*```python\n(.*?)```", text.split(MARKER, 1)[1], re.S)
    assert m, f"README.md: no python code block right after {MARKER}"
    return m.group(1)


def test_the_readme_example_is_short_and_self_contained():
    code = readme_example()
    assert len(code.strip().splitlines()) <= 30
    compile(code, "README example", "exec")


def test_the_readme_example_runs_as_written(tmp_path):
    (tmp_path / "example.py").write_text(readme_example())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 steps; report in runs/even/report/report.json" in proc.stdout
    report = json.loads((tmp_path / "runs" / "even" / "report" / "report.json").read_text())
    assert report["steps"] == 2
    metrics = [json.loads(line) for line in
               open(tmp_path / "runs" / "even" / "metrics" / "metrics.jsonl")]
    assert any(m.get("train/grad_norm", 0) > 0 for m in metrics)
