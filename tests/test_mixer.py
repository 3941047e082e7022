"""DomainMixer: weighted, deterministic task mixing across envs."""

import pytest

from ac2_jax.envs import CalculatorEnv, DomainMixer, StepwiseCalculatorEnv
from ac2_jax.envs.mixer import domain_seed


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


def test_domain_seed_is_stable_across_processes():
    """Derived with a fixed hash, not Python's salted hash(): resume needs the same tasks."""
    import subprocess
    import sys

    code = "from ac2_jax.envs.mixer import domain_seed; print(domain_seed(7, 'calc'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": s}).stdout
            for s in ("1", "2")}
    assert len(outs) == 1
    assert outs == {f"{domain_seed(7, 'calc')}\n"}
