"""experiments/calculator/eval_report.py on recorded attempts: escaped HTML, PNGs, the rich table."""

import io
import os

from rich.console import Console

from ac2_jax.evals import EvalResult, TokenPrices, attempt_record, compare_results
from ac2_jax.trace import Completion, Episode, Trace
from experiments.calculator import eval_report
from tests.support.html_dom import Dom

NASTY = '<b>t&"1</b>'


def _result(name, passes):
    records, traces = [], []
    for i, ok in enumerate(passes):
        task = NASTY if i == 0 else f"t{i}"
        c = Completion(prompt_ids=[1, 2, 3], output_ids=[4], output_logprobs=[0.0],
                       cached_tokens=1)
        for a in range(2):
            tr = Trace(task_id=task, status="finished", reward=float(ok),
                       episodes=[Episode(agent="main", completions=[c])], metrics={"steps": 1})
            traces.append(tr)
            records.append(attempt_record(tr, domain="d<1>" if i % 2 else "d2", attempt=a,
                                          seed=10 * i + a))
    return EvalResult(name, [r.task_id for r in records[::2]], 2, records, 0.95,
                      TokenPrices(0.2, 2.0, 8.0), traces)


def test_html_is_escaped_and_complete(tmp_path):
    before, after = _result("before", [0, 0, 1, 0]), _result("after<script>", [1, 0, 1, 1])
    results = [before, after]
    plots = eval_report.write_plots(results, str(tmp_path))
    comps = [(after.name, before.name, compare_results(after, before))]
    report = {"checkpoints": [{"path": None, "policy_version": 1},
                              {"path": "x", "policy_version": 2}]}
    path = str(tmp_path / "r.html")
    eval_report.write_html(report, results, comps, plots, path, max_task_rows=2)
    text = open(path, encoding="utf-8").read()
    dom = Dom(text)
    assert not dom.find("b") and not dom.find("script")  # names stay text
    assert NASTY in dom.find("table")[-1]["text"] and "after<script>" in dom.find("h2")[1]["text"]
    assert "2 more tasks in report.json" in text  # rows left out are counted
    assert {el["attrs"]["src"] for el in dom.find("img")} == set(plots.values())
    for name in plots.values():
        assert open(os.path.join(tmp_path, name), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    rows = eval_report.summary_rows(after)
    assert [r["scope"] for r in rows] == ["overall", "d2", "d<1>"]
    assert rows[0]["pass rate"].startswith("0.750 [") and rows[0]["method"] == "clustered-t"
    buf = io.StringIO()
    eval_report.print_table(results, Console(file=buf, width=200))
    assert "clustered-t" in buf.getvalue() and "0.750" in buf.getvalue()
