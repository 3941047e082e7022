"""experiments/pinapple/base.py: the base alone, and its check on hints it never saw."""

import json
import os

from experiments.pinapple import data
from tests.support.pinapple_toy import toy_base_config


def test_the_base_report_at_toy_size(tmp_path):
    """pinapple/config.py:faithful cut to toy size (10 SFT steps on a 2-layer model, a small
    corpus): the report has every held-out hint's following rate, the fresh-misspelling
    check, the base and the teacher evals, and examples per held-out hint."""
    from experiments.pinapple import base as pinapple_base

    cfg = toy_base_config()
    cfg.loop.answer_tokens = 6
    cfg.sampling.min_batch = 64  # one row bucket (max_batch): fewer sampler compiles
    cfg.workdir = str(tmp_path / "base")
    logs = []
    report = pinapple_base.run(cfg, log=logs.append)
    assert set(report["hint_following"]) == {*data.HELDOUT_HINTS, "unchanged_elsewhere",
                                             "spell_other_words"}
    assert all(0.0 <= v <= 1.0 for v in report["hint_following"].values())
    assert {"target", "retention"} <= set(report["base"]) and "target" in report["teacher"]
    assert set(report["examples"]) == set(data.HELDOUT_HINTS)
    gap = report["target_logit_gap"]
    assert len(gap["per_item"]) == 12 and min(gap["per_item"]) <= gap["median"]
    saved = json.load(open(os.path.join(cfg.workdir, "base_report.json")))
    assert saved["hint_following"] == report["hint_following"]
    assert any("\nhint following: " in m for m in logs)


def test_the_base_is_checkpointed_reused_and_refused_under_another_config(tmp_path):
    """`pinapple.base_sft` with a workdir: a second run restores the finished base (trains
    nothing, same weights, the recorded final loss); a config that makes another base is
    refused, naming the sections that differ."""
    import jax
    import numpy as np
    import pytest

    from experiments.pinapple import run as pinapple

    cfg = toy_base_config()
    cfg.sft.checkpoint_every = 5
    items = data.all_items(cfg.base_data.math_limit)
    tok = pinapple.build_tokenizer(cfg, str(tmp_path / "tok"), items)
    work, logs = str(tmp_path / "base"), []
    _, first, loss1 = pinapple.base_sft(cfg, tok, items, logs.append, work)
    _, again, loss2 = pinapple.base_sft(cfg, tok, items, logs.append, work)
    assert loss1 is not None and loss2 == loss1
    assert any("base sft: restored the finished model" in m for m in logs)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cfg.model.num_layers = 3
    cfg.base_data.spell_fresh = 0.25
    with pytest.raises(ValueError, match=r"other \['base_data', 'model'\] settings"):
        pinapple.base_sft(cfg, tok, items, logs.append, work)
