"""DomainMixer: weighted, deterministic task mixing across envs, fixed or adaptive."""

import pytest

from ac2_jax.envs import AdaptiveMix, CalculatorEnv, DomainMixer, StepwiseCalculatorEnv, Task
from ac2_jax.seeds import domain_seed
from ac2_jax.trace import Trace


def test_mix_by_weight():
    mix = DomainMixer({"calc": CalculatorEnv(), "step": StepwiseCalculatorEnv()},
                      {"calc": 3.0, "step": 1.0})
    tasks = mix.sample_tasks(400, seed=0)
    assert len(tasks) == 400 and tasks == mix.sample_tasks(400, seed=0)
    share = sum(t.domain == "calc" for t in tasks) / 400
    assert 0.65 < share < 0.85
    assert isinstance(mix.env_for(tasks[0]), CalculatorEnv if tasks[0].domain == "calc"
                      else StepwiseCalculatorEnv)
    only = DomainMixer({"calc": CalculatorEnv(), "step": StepwiseCalculatorEnv()}, {"calc": 1.0})
    assert {t.domain for t in only.sample_tasks(20, seed=1)} == {"calc"}


def test_bad_weights():
    with pytest.raises(ValueError, match="unknown"):
        DomainMixer({"calc": CalculatorEnv()}, {"other": 1.0})
    with pytest.raises(ValueError, match="positive"):
        DomainMixer({"calc": CalculatorEnv()}, {"calc": 0.0})


def test_same_env_class_in_two_domains_gives_distinct_ids_and_seeds():
    """Issue 20: two domains of one env class produced identical task ids (and tasks)."""
    mix = DomainMixer({"a": CalculatorEnv(), "b": CalculatorEnv()})
    tasks = mix.sample_tasks(200, seed=0)
    assert {t.domain for t in tasks} == {"a", "b"}
    ids = [t.task_id for t in tasks]
    assert len(ids) == len(set(ids))
    assert all(t.task_id.startswith(f"{t.domain}/") for t in tasks)
    # Each domain gets its own seed: the two domains do not draw the same task stream.
    prompts = {d: {t.prompt for t in tasks if t.domain == d} for d in "ab"}
    assert len(prompts["a"] & prompts["b"]) < 5
    assert domain_seed(0, "a") != domain_seed(0, "b") and domain_seed(0, "a") != domain_seed(1, "a")
    assert tasks == mix.sample_tasks(200, seed=0)
    assert all(isinstance(mix.env_for(t), CalculatorEnv) for t in tasks)


@pytest.mark.full  # two child Python processes
def test_domain_seed_is_stable_across_processes():
    """Derived with a fixed hash, not Python's salted hash(): resume needs the same tasks."""
    import subprocess
    import sys

    code = "from ac2_jax.seeds import domain_seed; print(domain_seed(7, 'calc'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": s}).stdout
            for s in ("1", "2")}
    assert len(outs) == 1
    assert outs == {f"{domain_seed(7, 'calc')}\n"}


def _adaptive(**kw):
    return DomainMixer({"A": CalculatorEnv(), "B": StepwiseCalculatorEnv()},
                       adaptive=AdaptiveMix(**{**dict(window=20, floor=0.1, min_results=4), **kw}))


def _feed(mix, rounds, a_rewards, b_rewards):
    """`rounds` rounds of one A and one B result, rewards cycling through the lists."""
    weights = []
    for i in range(rounds):
        mix.record("A/x", a_rewards[i % len(a_rewards)])
        mix.record("B/x", b_rewards[i % len(b_rewards)])
        weights.append(mix.current_weights()["A"])
    return weights


def test_adaptive_weights_fall_for_a_solved_domain_and_recover():
    mix = _adaptive()
    assert mix.current_weights() == {"A": 0.5, "B": 0.5}  # no results yet: base shares
    # A always solved, B half solved: A's share falls to the floor (0.1 x its base 0.5).
    falling = _feed(mix, 20, [1.0], [1.0, 0.0])
    assert mix.pass_rates() == {"A": 1.0, "B": 0.5}
    assert falling[2] == 0.5  # under min_results (4): still the base share
    assert falling[-1] == pytest.approx(0.05, abs=1e-12)
    assert all(b <= a for a, b in zip(falling[3:], falling[4:]))  # never rises meanwhile
    share = sum(t.domain == "A" for t in mix.sample_tasks(400, seed=3)) / 400
    assert share < 0.12  # sampling follows the weights (0.05 expected)
    # A now fails half the time: as the window turns over its share recovers to 0.5.
    recovering = _feed(mix, 20, [0.0, 1.0], [1.0, 0.0])
    assert mix.pass_rates()["A"] == 0.5
    assert recovering[-1] == pytest.approx(0.5, abs=1e-12)
    assert recovering[10] > falling[-1]
    m = mix.metrics()
    assert m["mix_weight/A"] == pytest.approx(0.5) and m["mix_pass_rate/B"] == 0.5
    assert m["mix_results/A"] == 20.0 and m["mix_skipped"] == 0.0


def test_adaptive_weights_are_deterministic_and_floored():
    seq = [("A/t", 1.0), ("B/t", 0.0), ("A/t", 1.0), ("B/t", 1.0), ("A/t", 0.0)] * 10
    mixes = [_adaptive(floor=0.2, min_results=2), _adaptive(floor=0.2, min_results=2)]
    for task_id, reward in seq:
        for m in mixes:
            m.record(task_id, reward)
        assert mixes[0].current_weights() == mixes[1].current_weights()
    assert mixes[0].sample_tasks(50, seed=1) == mixes[1].sample_tasks(50, seed=1)
    # Both domains always solved: the factor is 0 for both, the base shares stand.
    both = _adaptive(floor=0.0)
    _feed(both, 20, [1.0], [1.0])
    assert both.current_weights() == {"A": 0.5, "B": 0.5}
    # The floor holds against a domain at p = 0.5 with unequal base weights.
    mix = DomainMixer({"A": CalculatorEnv(), "B": StepwiseCalculatorEnv()}, {"A": 3.0, "B": 1.0},
                      adaptive=AdaptiveMix(window=8, floor=0.2, min_results=8))
    _feed(mix, 8, [0.0], [0.0, 1.0])
    w = mix.current_weights()
    assert w["A"] == pytest.approx(0.2 * 0.75) and sum(w.values()) == pytest.approx(1.0)


def test_update_from_traces_counts_what_it_skips():
    mix = _adaptive(min_results=1)
    traces = [Trace("A/t1", "0", status="finished", reward=1.0, metadata={"domain": "A"}),
              Trace("B/t2", "1", status="agent_error", reward=None),
              Trace("B/t2", "0", status="finished", reward=1.0),
              Trace("A/t1", "1", status="infra_error"),
              Trace("A/t1", "2", status="timed_out")]
    assert mix.update(traces) == 3
    assert mix.state()["results"] == {"A": [1.0], "B": [1.0, 0.0]}  # sorted by (task, attempt)
    assert dict(mix.skipped) == {"infra_error": 1, "timed_out": 1}
    assert mix.metrics()["mix_skipped"] == 2.0
    other = _adaptive(min_results=1)
    other.update(list(reversed(traces)))
    assert other.state() == mix.state()  # arrival order does not matter


def test_adaptive_bad_configs_and_records_raise():
    for bad, what in ((dict(window=0), "window"), (dict(floor=1.5), "floor"),
                      (dict(floor=-0.1), "floor"), (dict(min_results=0), "min_results"),
                      (dict(window=4, min_results=5), "min_results"),
                      (dict(pass_threshold=float("nan")), "pass_threshold")):
        with pytest.raises(ValueError, match=f"AdaptiveMix.{what}"):
            AdaptiveMix(**bad)
    mix = _adaptive()
    with pytest.raises(ValueError, match="unknown domain 'C'"):
        mix.record(Task("C/1", "p", domain="C"), 1.0)
    with pytest.raises(ValueError, match="no '<domain>/' prefix"):
        mix.record("nowhere-1", 1.0)
    with pytest.raises(ValueError, match="finite"):
        mix.record("A/1", float("inf"))
    with pytest.raises(ValueError, match="fixed weights"):
        DomainMixer({"A": CalculatorEnv()}).record("A/1", 1.0)
