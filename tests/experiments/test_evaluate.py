"""experiments/calculator/evaluate.py end to end at toy size: two Orbax checkpoints (a params
directory and a published step), served in-process, K=2 attempts on two domains;
report.json, report.html and the PNG plots are written and parse."""

import json
import os

import pytest

from ac2_jax.models.io.params_io import publish_weights, save_params
from experiments.calculator import agent as calculator_agent
from experiments.calculator import evaluate
from experiments.calculator.eval_config import get_config
from tests.support.html_dom import Dom

PNG = b"\x89PNG\r\n\x1a\n"


def test_two_checkpoints_end_to_end(tmp_path):
    cfg = get_config("toy")
    cfg.workdir = str(tmp_path / "evals")
    cfg.eval.num_tasks = 2  # per domain: 4 tasks x 2 attempts per checkpoint
    tok = evaluate.tokenizer_for(cfg, str(tmp_path), evaluate.build_env(cfg))
    cfg.tokenizer.path = str(tmp_path / "tokenizer")
    save_params(calculator_agent.build_model(cfg, tok.vocab_size), str(tmp_path / "sft_params"))
    cfg.seed = 1  # other weights for the second checkpoint
    publish_weights(calculator_agent.build_model(cfg, tok.vocab_size), str(tmp_path / "published"),
                    step=3)
    cfg.checkpoints = (str(tmp_path / "sft_params"), str(tmp_path / "published") + "@3")

    report = evaluate.run(cfg, log=lambda *a: None)

    out = cfg.workdir
    assert json.load(open(os.path.join(out, "report.json"))) == json.loads(json.dumps(report))
    first, second = report["checkpoints"]
    assert (first["name"], second["name"]) == ("sft_params", "published@3")
    assert second["loaded_step"] == 3
    # Each checkpoint was what the sampler served (policy version = its position + 1).
    assert first["served_policy_versions"] == [1] and second["served_policy_versions"] == [2]
    a, b = first["result"], second["result"]
    assert a["k"] == 2 and len(a["attempts"]) == len(b["attempts"]) == 8
    assert set(a["summary"]["per_domain"]) == {"calculator", "stepwise_calculator"}
    assert [x["seed"] for x in a["attempts"]] == [x["seed"] for x in b["attempts"]]
    assert len({x["seed"] for x in a["attempts"]}) == 8
    o = a["summary"]["overall"]
    assert o["pass_rate"]["method"] == "clustered-t" and set(o["pass_at_k"]) == {"1", "2"}
    assert sum(o["failures"].values()) == 8 and o["cost"]["total"] > 0
    assert o["tokens"]["prompt_tokens"] > 0 and o["prefix"]["requests"] == o["tokens"]["requests"]
    assert report["comparisons"][0]["tasks_paired"] + len(
        report["comparisons"][0]["tasks_dropped"]) == 4

    dom = Dom(open(os.path.join(out, "report.html"), encoding="utf-8").read())
    assert len(dom.find("table")) == 2 + 1 + 1  # two summaries, comparisons, tasks
    imgs = [el["attrs"]["src"] for el in dom.find("img")]
    assert sorted(imgs) == ["cost_tokens_by_task.png", "pass_rate_by_domain.png",
                            "pass_rate_over_checkpoints.png"]
    for name in imgs:
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == PNG


def test_bad_config_fails_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="no directory .*nowhere"):
        evaluate.parse_checkpoints([str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="step number"):
        evaluate.parse_checkpoints([str(tmp_path) + "@latest"])
    assert evaluate.parse_checkpoints(()) == [{"name": "init", "path": None, "step": None}]
    twice = evaluate.parse_checkpoints([str(tmp_path), str(tmp_path)])
    assert twice[0]["name"] != twice[1]["name"]
    cfg = get_config("toy")
    cfg.env.domains = ("calculator", "chess")
    with pytest.raises(ValueError, match="chess"):
        evaluate.build_env(cfg)
    with pytest.raises(ValueError, match="'@STEP' does not apply"):
        evaluate.load_checkpoint(None, {"path": str(tmp_path), "step": 2})
