"""DomainMixer: weighted, deterministic task mixing across envs."""

import pytest

from ac2_jax.envs import CalculatorEnv, DomainMixer, StepwiseCalculatorEnv


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
