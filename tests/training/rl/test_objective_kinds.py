"""The RL objective menu (issue 64): each kind against a numpy reference written from its
paper's formula (value and gradient, fp32 vs float64, rtol 1e-5 / atol 1e-6), and against
TRL's GRPOTrainer._compute_loss on the same inputs where TRL has the same loss.

The inputs are packed batches of several attempts, some over several rows (multi-row
traces); each token carries its log-prob as a feature so the gradient is taken with
respect to it and mapped back to the token by a per-token id.
"""

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.config import ConfigError, from_config
from ac2_jax.losses import loss_weights
from ac2_jax.segments import pack_segments
from ac2_jax.training import OBJECTIVES, PolicyGradientLoss, RLConfig
from ac2_jax.training.rl import CISPOLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, rl_segment

RTOL, ATOL = 1e-5, 1e-6


def attempts(seed=0, n_tasks=4, noise=0.3, seq_len=12):
    """(packed flat batch, per-task token lists): task i has 1-3 segments of 4-11 tokens,
    packed into rows of `seq_len` (so some attempts span rows)."""
    rng = np.random.default_rng(seed)
    segs, ref = [], defaultdict(lambda: {"logp": [], "old": [], "uid": []})
    uid, adv = 1, {}
    for t in range(n_tasks):
        adv[t] = float(rng.normal())
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(4, 12))
            mask = (rng.random(n) > 0.3).astype(np.float32)
            mask[0] = 0.0  # token 0 has no prediction in its segment
            logp = -rng.uniform(0.1, 3.0, n).astype(np.float32)
            old = (logp + rng.normal(0, noise, n)).astype(np.float32)
            ids = np.arange(uid, uid + n, dtype=np.float32)
            uid += n
            s = rl_segment(rng.integers(0, 30, n), mask, old, task=f"task{t}", advantage=adv[t])
            segs.append(s.with_features(logp=logp, uid=ids))
            on = mask > 0
            ref[t]["logp"] += list(logp[on])
            ref[t]["old"] += list(old[on])
            ref[t]["uid"] += list(ids[on])
    batch = pack_segments(segs, seq_len)
    assert batch.shape[0] > 1
    tasks = {t: {k: np.asarray(v, np.float64) for k, v in d.items()} | {"adv": adv[t]}
             for t, d in ref.items()}
    return batch, tasks


def ours(loss, batch, extras=None):
    """(value, d value / d logp per uid) of `loss` (its `_finish`: surrogate, KL, entropy
    bonus off) aggregated with its mode by the batch's loss weights."""
    def total(logp, batch, extras):
        c = loss_weights(batch, loss.mode, normalizer=loss.normalizer)
        per_token, _ = loss._finish(logp, jnp.zeros_like(logp), batch, extras)
        return (c * per_token).sum()

    # Jitted, as the train step runs it: one program per loss and batch shape (eagerly,
    # each of its ~40 ops compiled for every batch shape).
    value, grad = jax.jit(jax.value_and_grad(total))(jnp.asarray(batch.features["logp"]), batch,
                                                     extras)
    uids = np.asarray(batch.features["uid"])
    on = np.asarray(batch.loss_mask) > 0
    return float(value), dict(zip(uids[on].tolist(), np.asarray(grad)[on].tolist(), strict=True))


def check(value, grads, want_value, want_grads):
    np.testing.assert_allclose(value, want_value, rtol=RTOL, atol=ATOL)
    got = np.array([grads[u] for u in want_grads])
    np.testing.assert_allclose(got, np.array(list(want_grads.values())), rtol=RTOL, atol=ATOL)


def ppo_terms(logp, old, a, lo, hi):
    """f = min(r A, clip(r) A) and df/dlogp (numpy float64)."""
    r = np.exp(logp - old)
    f = np.minimum(r * a, np.clip(r, lo, hi) * a)
    live = (r * a <= np.clip(r, lo, hi) * a) | ((r >= lo) & (r <= hi))
    return f, np.where(live, r * a, 0.0)


def test_grpo_is_seq_mean_token_mean_of_the_clipped_ratio():
    """GRPO eq. 3: -1/G sum_i 1/|o_i| sum_t min(r A, clip(r, 0.8, 1.2) A), r = pi / pi_sampler."""
    batch, tasks = attempts(0)
    value, grads = ours(GRPOLoss(), batch)
    want, wg = 0.0, {}
    for d in tasks.values():
        f, g = ppo_terms(d["logp"], d["old"], d["adv"], 0.8, 1.2)
        want -= f.mean() / len(tasks)
        wg.update(zip(d["uid"].tolist(), (-g / len(f) / len(tasks)).tolist()))
    check(value, grads, want, wg)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_grpo_under_verls_other_aggregations(mode):
    """verl's agg_loss: token-mean sum/N; seq-mean-token-sum 1/G sum_i sum_t;
    seq-mean-token-sum-norm sum / L (here L = 37)."""
    batch, tasks = attempts(1)
    loss = GRPOLoss(mode=mode, normalizer=37.0 if mode.endswith("norm") else None)
    value, grads = ours(loss, batch)
    n_tok = sum(len(d["logp"]) for d in tasks.values())
    scale = {"token-mean": 1 / n_tok, "seq-mean-token-sum": 1 / len(tasks),
             "seq-mean-token-sum-norm": 1 / 37.0}[mode]
    want, wg = 0.0, {}
    for d in tasks.values():
        f, g = ppo_terms(d["logp"], d["old"], d["adv"], 0.8, 1.2)
        want -= f.sum() * scale
        wg.update(zip(d["uid"].tolist(), (-g * scale).tolist()))
    check(value, grads, want, wg)


def test_dr_grpo_sums_tokens_over_a_constant():
    """Dr. GRPO eq. 2: -1/G sum_i sum_t min(r A, clip(r) A) / L_max (no 1/|o_i|)."""
    batch, tasks = attempts(2)
    value, grads = ours(DrGRPOLoss(normalizer=64.0), batch)
    want, wg = 0.0, {}
    for d in tasks.values():
        f, g = ppo_terms(d["logp"], d["old"], d["adv"], 0.8, 1.2)
        want -= f.sum() / len(tasks) / 64.0
        wg.update(zip(d["uid"].tolist(), (-g / len(tasks) / 64.0).tolist()))
    check(value, grads, want, wg)
    with pytest.raises(ValueError, match="L_max"):
        DrGRPOLoss()


def test_dapo_clips_higher_and_averages_tokens():
    """DAPO eq. 8: -1/sum|o_i| sum_i sum_t min(r A, clip(r, 1 - 0.2, 1 + 0.28) A)."""
    batch, tasks = attempts(3, noise=0.4)
    value, grads = ours(DAPOLoss(), batch)
    n_tok = sum(len(d["logp"]) for d in tasks.values())
    want, wg, between = 0.0, {}, 0
    for d in tasks.values():
        f, g = ppo_terms(d["logp"], d["old"], d["adv"], 0.8, 1.28)
        r = np.exp(d["logp"] - d["old"])
        between += int(((r > 1.2) & (r < 1.28)).sum())  # where clip-higher differs from 0.2
        want -= f.sum() / n_tok
        wg.update(zip(d["uid"].tolist(), (-g / n_tok).tolist()))
    assert between > 0
    check(value, grads, want, wg)


def test_gspo_clips_one_ratio_per_attempt():
    """GSPO eq. 5-7: -1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r);
    d/dlogp_t = -1/G A_i s_i / |y_i| where s_i is inside the clip (or the min keeps it)."""
    batch, tasks = attempts(6, n_tasks=6, noise=0.15)
    eps = (0.04, 0.05)
    value, grads = ours(GSPOLoss(clip_eps=eps), batch)
    want, wg, clipped = 0.0, {}, 0
    G = len(tasks)
    for d in tasks.values():
        a = d["adv"]
        s = np.exp(np.mean(d["logp"] - d["old"]))
        cs = np.clip(s, 1 - eps[0], 1 + eps[1])
        want -= min(s * a, cs * a) / G
        live = (s * a <= cs * a) or (1 - eps[0] <= s <= 1 + eps[1])
        clipped += not live
        g = -a * s / len(d["logp"]) / G if live else 0.0
        wg.update({u: g for u in d["uid"].tolist()})
    assert 0 < clipped < G  # both cases are exercised
    check(value, grads, want, wg)


def test_cispo_keeps_the_gradient_of_capped_tokens():
    """CISPO eq. 4-5: -1/sum|o_i| sum sg(min(r, 1 + eps_high)) A log pi; d/dlogp = -w A / N."""
    batch, tasks = attempts(5, noise=1.0)
    loss = CISPOLoss(eps_high=0.5)
    value, grads = ours(loss, batch)
    n_tok = sum(len(d["logp"]) for d in tasks.values())
    want, wg, capped = 0.0, {}, 0
    for d in tasks.values():
        r = np.exp(d["logp"] - d["old"])
        w = np.minimum(r, 1.5)
        capped += int((r > 1.5).sum())
        want -= (w * d["adv"] * d["logp"]).sum() / n_tok
        wg.update(zip(d["uid"].tolist(), (-w * d["adv"] / n_tok).tolist()))
    assert capped > 0
    check(value, grads, want, wg)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_term_matches_schulmans_estimators(kind):
    """beta * k(pi, pi_ref) per token, seq-mean-token-mean (GRPO eq. 3's KL term), with the
    reference log-probs given as extras; k1 = -log q, k2 = (log q)^2 / 2, k3 = q - 1 - log q,
    q = pi_ref / pi; gradients d/dlogp: 1, -log q, 1 - q (times beta / G / |o_i|)."""
    batch, tasks = attempts(6)
    rng = np.random.default_rng(7)
    ref = jnp.asarray(batch.features["logp"] + rng.normal(0, 0.3, batch.shape).astype(np.float32))
    beta = 0.3
    loss = GRPOLoss(kl_coef=beta, kl_estimator=kind, old_logprobs="detached", tis_cap=None)
    value, grads = ours(loss, batch, {"ref_logprobs": ref})
    uid_ref = dict(zip(np.asarray(batch.features["uid"]).ravel().tolist(), np.asarray(ref).ravel().tolist()))
    want, wg = 0.0, {}
    G = len(tasks)
    for d in tasks.values():
        lq = np.array([uid_ref[u] for u in d["uid"]], np.float64) - d["logp"]
        k = {"k1": -lq, "k2": lq**2 / 2, "k3": np.exp(lq) - 1 - lq}[kind]
        dk = {"k1": np.ones_like(lq), "k2": -lq, "k3": 1 - np.exp(lq)}[kind]
        n = len(lq)
        # detached PPO with r = 1: the surrogate is A (value) with gradient -A per token
        want += (-d["adv"] * n + beta * k.sum()) / n / G
        wg.update(zip(d["uid"].tolist(), ((-d["adv"] + beta * dk) / n / G).tolist()))
    check(value, grads, want, wg)


@pytest.mark.parametrize("kind, loss, field", [
    ("grpo", {"tis_cap": 3.0}, "tis_cap"),  # the sampler's TIS weight is 1
    ("dr_grpo", {"normalizer": 512, "tis_cap": None}, "tis_cap"),
    ("dapo", {"tis_cap": 5.0}, "tis_cap"),
    ("ppo", {"old_logprobs": "sampler", "tis_cap": 3.0}, "tis_cap"),
    ("cispo", {"old_logprobs": "detached", "eps_high": 1.0}, "eps_high"),  # the ratio is 1
    ("cispo", {"old_logprobs": "detached", "eps_low": 0.2}, "eps_low"),
])
def test_a_field_the_kind_ignores_is_refused_by_name(kind, loss, field):
    """Nothing silent: a set field that cannot act under the kind's old_logprobs is
    one line naming the field and the kind; the defaults it merely inherits are not."""
    with pytest.raises(ConfigError) as e:
        from_config(RLConfig, {"loss": {"kind": kind, **loss}})
    msg = str(e.value)
    assert "\n" not in msg and f"{field}=" in msg and f"kind {kind!r}" in msg, msg
    # the inherited defaults alone, and a cap that can bind, are accepted
    from_config(RLConfig, {"loss": {"kind": kind, **{k: v for k, v in loss.items() if k != field}}})
    from_config(RLConfig, {"loss": {"kind": "grpo", "old_logprobs": "extras", "tis_cap": 3.0}})
    from_config(RLConfig, {"loss": {"kind": "cispo", "eps_high": 1.0}})


def test_kinds_are_registered_and_built_from_config():
    assert {"ppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo"} <= set(OBJECTIVES.names())
    cfg = from_config(RLConfig, {"loss": {"kind": "dapo"}})
    assert isinstance(cfg.loss, DAPOLoss) and cfg.loss.clip_eps == (0.2, 0.28)
    assert from_config(RLConfig, {}).loss == PolicyGradientLoss()  # today's default stays
    assert GRPOLoss(mode="seq-mean-token-sum").mode == "task_sum"  # verl's names map to ours
    with pytest.raises(ConfigError, match="did you mean 'gspo'"):
        from_config(RLConfig, {"loss": {"kind": "gpso"}})
    with pytest.raises(ValueError, match="grad_accum"):
        RLConfig(loss=GSPOLoss(), grad_accum=2, batch=RLConfig().batch)
    with pytest.raises(ValueError, match="CISPOLoss.tis_cap"):
        CISPOLoss(tis_cap=2.0)
    with pytest.raises(ValueError, match="GSPOLoss.dual_clip"):
        GSPOLoss(dual_clip=3.0)
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPOLoss(kl_estimator="k4")
    # a normalizer only task_sum / constant divide by is named, never ignored
    with pytest.raises(ValueError, match="normalizer=512.0.*'task_mean'"):
        DrGRPOLoss(mode="task_mean", normalizer=512.0)
    with pytest.raises(ValueError, match="normalizer"):
        PolicyGradientLoss(normalizer=512.0)


# -------------------------------------------------------------- TRL's GRPOTrainer


def trl_loss(loss_type, logp, old, adv, mask, *, eps=(0.2, 0.2), level="token", beta=0.0,
             ref=None, max_len=None):
    """(loss, d loss / d logp) of TRL's `GRPOTrainer._compute_loss` (trl 1.16) on [B, T]
    log-probs: the trainer's own code, with its model forward replaced by the given
    log-probs (the one method that would run a torch model) and a real Accelerator."""
    torch = pytest.importorskip("torch")
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    from accelerate import Accelerator

    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    t = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=eps[0], epsilon_high=eps[1], use_vllm=False,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=Accelerator(cpu=True), max_completion_length=max_len)
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros((B, 1), dtype=torch.long),
              "prompt_mask": torch.ones((B, 1), dtype=torch.long),
              "completion_ids": torch.zeros((B, T), dtype=torch.long),
              "completion_mask": torch.tensor(mask, dtype=torch.long),
              "advantages": torch.tensor(adv, dtype=torch.float32),
              "old_per_token_logps": torch.tensor(old, dtype=torch.float32),
              "num_items_in_batch": torch.tensor(float(mask.sum()))}
    if ref is not None:
        inputs["ref_per_token_logps"] = torch.tensor(ref, dtype=torch.float32)
    loss = trl_grpo.GRPOTrainer._compute_loss(t, None, inputs)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


@pytest.fixture(scope="module")
def completions():
    """B = 6 completions of up to T = 9 tokens (TRL's [B, T] layout) and the same as a
    packed batch (one segment each: a prompt token, then the completion)."""
    rng = np.random.default_rng(11)
    B, T = 6, 9
    lengths = rng.integers(3, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    logp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.25, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    segs = []
    for i in range(B):
        n = int(lengths[i])
        pad = lambda x: np.concatenate([[0.0], x[i, :n]]).astype(np.float32)  # noqa: E731
        s = rl_segment(rng.integers(0, 30, n + 1), pad(mask), pad(old), task=f"c{i}",
                       advantage=float(adv[i]))
        segs.append(s.with_features(logp=pad(logp), uid=pad(np.arange(B * T).reshape(B, T) + 1.0),
                                    ref=pad(ref)))
    return logp, old, ref, adv, mask, pack_segments(segs, 16, rows_multiple=2)


TRL_CASES = {
    # TRL loss_type (+ its options) -> our kind with the same loss
    "grpo": (dict(), GRPOLoss()),
    "bnpo": (dict(), GRPOLoss(mode="token-mean")),
    "dr_grpo": (dict(max_len=9), DrGRPOLoss(normalizer=9.0)),
    "dapo": (dict(eps=(0.2, 0.28)), DAPOLoss()),
    "cispo": (dict(eps=(0.2, 5.0)), CISPOLoss()),
    "gspo": (dict(level="sequence", eps=(0.03, 0.04)), GSPOLoss(clip_eps=(0.03, 0.04))),
    "grpo+k3": (dict(beta=0.04), GRPOLoss(kl_coef=0.04)),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_agrees_with_trl(case, completions):
    logp, old, ref, adv, mask, batch = completions
    kw, loss = TRL_CASES[case]
    loss_type = {"gspo": "grpo", "grpo+k3": "grpo"}.get(case, case)
    want, want_grad = trl_loss(loss_type, logp, old, adv, mask,
                               ref=ref if kw.get("beta") else None, **kw)
    extras = {"ref_logprobs": jnp.asarray(batch.features["ref"])} if loss.kl_coef else None
    value, grads = ours(loss, batch, extras)
    on = mask > 0
    uids = (np.arange(logp.size).reshape(logp.shape) + 1.0)[on]
    np.testing.assert_allclose(value, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose([grads[u] for u in uids.tolist()], want_grad[on], rtol=RTOL, atol=ATOL)


def test_every_config_line_of_the_docs_page_loads():
    """docs/howto/choosing-an-objective.md: each `--config...` line builds a valid RL recipe
    config, with the kind it names (the CLI knows every kind's own fields)."""
    import pathlib
    import re
    import shlex

    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import RLRecipeConfig

    page = pathlib.Path(__file__).resolve().parents[3] / "docs/howto/choosing-an-objective.md"
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
    lines = [ln.split("#")[0] for b in blocks for ln in b.replace("\\\n", " ").splitlines()]
    runs = [[a for a in shlex.split(ln) if a.startswith("--config.")] for ln in lines]
    runs = [r for r in runs if r]
    assert len(runs) >= 12
    for run in runs:
        cfg = load_config(RLRecipeConfig, overrides=run)
        for arg in run:
            key, _, value = arg.removeprefix("--config.").partition("=")
            if key == "rl.loss.kind":
                assert OBJECTIVES.name_of(cfg.rl.loss) == value
    with pytest.raises(ValueError, match="normalizer"):
        GRPOLoss(mode="seq-mean-token-sum-norm")


@pytest.mark.parametrize("loss", [DAPOLoss(), GSPOLoss(clip_eps=0.05), CISPOLoss()],
                         ids=lambda x: type(x).__name__)
def test_tree_packing_gives_the_flat_loss_and_gradient(loss):
    """Attempts whose two episodes share a prefix: the tree layout merges it (loss_mask
    multiplicity 2) and each surrogate (PPO-clip, GSPO's sequence ratio, CISPO) gives the
    flat value and the same gradient per token (summed over the flat copies of a shared
    token). The aggregation modes' tree equality is the normaliser's own test."""
    rng = np.random.default_rng(12)
    segs = []
    for t in range(3):
        prefix, adv = 5, float(rng.normal())
        n = [prefix + int(rng.integers(2, 5)) for _ in range(2)]
        base = rng.integers(0, 30, max(n))
        lp_base = -rng.uniform(0.1, 3.0, max(n)).astype(np.float32)
        old_base = (lp_base + rng.normal(0, 0.05, max(n))).astype(np.float32)
        for e, ln in enumerate(n):
            toks, lp, old = base[:ln].copy(), lp_base[:ln].copy(), old_base[:ln].copy()
            toks[prefix:] = rng.integers(0, 30, ln - prefix)  # the branches differ after it
            lp[prefix:] = -rng.uniform(0.1, 3.0, ln - prefix)
            old[prefix:] = lp[prefix:] + rng.normal(0, 0.05, ln - prefix)
            uid = np.arange(ln, dtype=np.float32) + 100 * t + 1
            uid[prefix:] += 50 * (e + 1)  # own ids after the shared prefix
            mask = np.ones(ln, np.float32)
            mask[0] = 0.0
            s = rl_segment(toks, mask, old, task=f"t{t}", advantage=adv)
            segs.append(s.with_features(logp=lp, uid=uid))
    flat = pack_segments(segs, 16)
    tree = pack_segments(segs, 16, layout="tree")
    assert float(np.asarray(tree.loss_mask).max()) == 2.0  # the prefix is shared
    v_flat, g_flat = ours(loss, flat)
    v_tree, g_tree = ours(loss, tree)
    np.testing.assert_allclose(v_tree, v_flat, rtol=RTOL, atol=ATOL)

    def per_uid(batch):
        def total(lp, batch):
            c = loss_weights(batch, loss.mode, normalizer=loss.normalizer)
            return (c * loss._finish(lp, jnp.zeros_like(lp), batch, None)[0]).sum()

        g = jax.jit(jax.grad(total))(jnp.asarray(batch.features["logp"]), batch)
        out = defaultdict(float)
        for u, x in zip(np.asarray(batch.features["uid"]).ravel(), np.asarray(g).ravel()):
            out[float(u)] += float(x)
        return out

    a, b = per_uid(flat), per_uid(tree)
    keys = sorted(k for k in a if k > 0)
    np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=RTOL, atol=ATOL)
