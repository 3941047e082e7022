"""The pinapple report's sweep summary (RMSD over T, S and the judge): one row per
setting with CIs over seeds, the main table untouched by sweep runs, and the plot."""

import os

from experiments.pinapple.config import get_config
from experiments.pinapple.report import (
    METRICS,
    claims,
    claims_markdown,
    markdown_table,
    plot_sweep,
    summarize,
    summarize_sweep,
    sweep_markdown,
)


def _run(method, seed, reached, target, retention, setting=None, kept=(4, 6)):
    return {"method": method, "seed": seed, "steps_to_target": reached, "setting": setting,
            "time_s": 1.0,
            "final": {**{k: 0.5 for k in METRICS}, "target": target, "retention": retention},
            "train": [{"kept_tokens": k} for k in kept],
            "judge_stats": ({"examples": 10, "selected": 15, "cache_hits": 0}
                            if method == "rmsd" else None)}


def test_sweep_rows_are_per_setting_and_the_main_rows_ignore_sweep_runs(tmp_path):
    cfg = get_config("quick")
    cfg.methods = ("rmsd",)
    a = {"top_t": 2, "top_s": None, "judge": "keywords"}
    b = {"top_t": 8, "top_s": 1, "judge": "noisy:0.2"}
    runs = [_run("rmsd", 0, 10, 0.9, 0.95), _run("rmsd", 1, 12, 0.92, 0.97),
            _run("rmsd", 0, 4, 1.0, 0.5, a), _run("rmsd", 1, 6, 1.0, 0.7, a),
            _run("rmsd", 0, None, 0.2, 0.9, b), _run("rmsd", 1, 30, 0.95, 0.8, b)]
    rows = summarize_sweep(cfg, runs)
    assert [(r["judge"], r["top_s"], r["top_t"]) for r in rows] == [
        ("keywords", None, 2), ("noisy:0.2", 1, 8)]
    ra, rb = rows
    assert ra["steps_to_target"]["mean"] == 5.0 and ra["reached"] == "2/2"
    assert ra["retention"]["mean"] == 0.6 and ra["retention"]["n"] == 2
    assert rb["steps_to_target"]["mean"] == 30.0 and rb["reached"] == "1/2"
    assert ra["kept_per_update"]["mean"] == 5.0
    assert ra["selected_per_example"] == 1.5
    md = sweep_markdown(cfg, rows)
    assert "| noisy:0.2 | 1 | 8 | reverse_kl | 30.0 (1/2) |" in md  # runs without a kind
    # The main table's RMSD row holds the two main runs only.
    main = summarize(cfg, runs, {k: 0.0 for k in METRICS}, {k: 1.0 for k in METRICS})
    assert main[-1]["steps_to_target"]["mean"] == 11.0 and main[-1]["reached"] == "2/2"
    table = markdown_table(cfg, main).splitlines()
    assert {line.count("|") for line in table} == {13}  # 12 columns, wall clock last
    assert table[-1].endswith("| 1 [1, 1] |") and "wall s / run" in table[0]
    path = tmp_path / "sweep.png"
    plot_sweep(cfg, rows, str(path))
    assert os.path.getsize(path) > 1000


def test_no_sweep_runs_no_rows():
    assert summarize_sweep(get_config("quick"), [_run("rmsd", 0, 3, 1.0, 1.0)]) == []


def test_the_claims_are_scored_on_paired_runs_as_fixed_in_advance():
    """RMSD / OPSD steps (never reached: the budget + one check interval) with a bootstrap
    CI, and RMSD - SFT retention with a t-interval, both over (seed, data seed) pairs;
    sweep runs and unpaired runs are left out; too few pairs: no verdict."""
    cfg = get_config("quick")
    cfg.loop.update(steps=60, target_every=2)
    runs = []
    for s in range(8):
        runs += [_run("opsd", s, 30 + s % 3, 1.0, 0.9), _run("rmsd", s, 14 + s % 2, 1.0, 0.97),
                 _run("sft", s, 10, 1.0, 0.9 - 0.01 * (s % 2))]
    runs += [_run("rmsd", 0, 50, 1.0, 0.1, {"top_t": 1}), _run("rmsd", 99, 60, 1.0, 0.0)]
    cl = claims(cfg, runs)
    h, r = cl["half_steps"], cl["retention"]
    assert h["pairs"] == 8 and h["ratio"] == (14.5 / 30.875) and h["verdict"] == "about half"
    assert h["low"] <= h["ratio"] <= h["high"] < 0.75 and h["censored"] == {"rmsd": 0, "opsd": 0}
    assert r["pairs"] == 8 and abs(r["mean"] - 0.075) < 1e-9 and r["verdict"] == "better"
    # RMSD never reaching the target counts as 62 steps: more than OPSD's, not shown.
    for x in runs:
        if x["method"] == "rmsd" and x["setting"] is None:
            x["steps_to_target"] = None
    h = claims(cfg, runs)["half_steps"]
    assert h["censored"]["rmsd"] == 9 - 1 and h["ratio"] > 1 and h["verdict"] == "not shown"
    assert "**not shown**" in claims_markdown(claims(cfg, runs))
    assert claims(cfg, runs[:3]) == {"half_steps": None, "retention": None}


def test_combine_sweeps_puts_the_main_setting_beside_the_swept_ones(tmp_path):
    """Sweep runs from several workdirs plus the main run's RMSD runs (as the main setting,
    on the sweeps' seeds only): one table, one plot."""
    import json

    from experiments.pinapple.report import combine_sweeps

    cfg = get_config("faithful")
    t1 = {"top_t": 1, "top_s": None, "judge": "keywords", "kind": "forward_kl"}
    dirs = {"main": [_run("rmsd", s, 10, 1.0, 0.9) for s in range(4)]
            + [_run("opsd", 0, 20, 1.0, 0.8)],
            "sweep": [_run("rmsd", s, 12, 1.0, 0.95, t1) for s in (0, 1)]}
    for name, runs in dirs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "runs.jsonl").write_text(
            "".join(json.dumps({**r, "evals": []}) + "\n" for r in runs))
    rows = combine_sweeps(cfg, str(tmp_path / "main"), [str(tmp_path / "sweep")],
                          str(tmp_path / "out"))
    assert [(r["top_t"], r["steps_to_target"]["n"]) for r in rows] == [(2, 2), (1, 2)]
    assert rows[0]["kind"] == "forward_kl" and rows[0]["judge"] == "keywords"
    assert os.path.getsize(tmp_path / "out" / "sweep.png") > 1000
    assert "seeds [0, 1]" in (tmp_path / "out" / "sweep.md").read_text()


def test_runs_summary_reads_the_runs_finished_so_far(tmp_path):
    import json

    from experiments.pinapple.report import runs_summary

    cfg = get_config("faithful")
    runs = [_run(m, s, 10 + s, 1.0, 0.9) for s in range(3) for m in ("sft", "opsd", "rmsd")]
    runs.append(_run("sft", 3, 12, 1.0, 0.9))  # seed 3 still going: SFT only
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    text = runs_summary(cfg, str(tmp_path))
    assert text.startswith("10 runs") and "| rmsd |" in text and "(4/4)" in text
    assert "over 3 pairs" in text  # the claims pair only the seeds every method finished
