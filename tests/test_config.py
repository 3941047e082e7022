"""from_config: one schema from ml_collections configs to the typed dataclasses."""

import dataclasses
import os

import ml_collections
import pytest
from absl import flags
from ml_collections import config_dict, config_flags

from ac2_jax.config import ConfigError, from_config, select_variant
from ac2_jax.models import DecoderConfig
from ac2_jax.training import BatchConfig, OptimizerConfig, PolicyGradientLoss, RLConfig, SFTConfig

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "experiments")


@dataclasses.dataclass(frozen=True)
class Inner:
    sizes: tuple[int, ...] = (1,)
    pair: tuple[float, float] = (0.0, 1.0)
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Outer:
    steps: int
    lr: float = 1e-3
    flag: bool = False
    cap: float | None = None
    eps: float | tuple[float, float] = 0.2
    inner: Inner = Inner()


def test_nested_sections_become_nested_dataclasses_with_the_same_keys():
    c = ml_collections.ConfigDict(dict(
        steps=3, mode="async", batch=dict(rows=2, seq_len=64, max_staleness=2),
        loss=dict(mode="token_mean", clip_eps=[0.1, 0.3], tis_cap=None),
        optimizer=dict(learning_rate=1e-4)))
    got = from_config(RLConfig, c, path="rl")
    assert got == RLConfig(steps=3, mode="async",
                           batch=BatchConfig(rows=2, seq_len=64, max_staleness=2),
                           loss=PolicyGradientLoss(mode="token_mean", clip_eps=(0.1, 0.3),
                                                   tis_cap=None),
                           optimizer=OptimizerConfig(learning_rate=1e-4))
    assert got.loss.clip_eps == (0.1, 0.3) and isinstance(got.loss.clip_eps, tuple)


def test_lists_become_tuples_ints_become_floats_and_plain_dicts_work():
    got = from_config(Outer, {"steps": 2, "lr": 1, "inner": {"sizes": [4, 5], "pair": [1, 2],
                                                             "names": ("a",)}})
    assert got == Outer(steps=2, lr=1.0, inner=Inner(sizes=(4, 5), pair=(1.0, 2.0), names=["a"]))
    assert isinstance(got.lr, float) and isinstance(got.inner.pair[0], float)
    assert isinstance(got.inner.sizes, tuple) and isinstance(got.inner.names, list)


def test_field_references_and_placeholders_resolve():
    c = ml_collections.ConfigDict(dict(seed=3, sft=dict(steps=10)))
    c.sft.seed = c.get_ref("seed")
    c.opt = ml_collections.ConfigDict(dict(schedule="cosine", cap=config_dict.placeholder(float)))
    c.opt.total_steps = c.sft.get_ref("steps")
    c.seed = 7
    assert from_config(SFTConfig, c.sft).seed == 7
    assert from_config(OptimizerConfig, {"schedule": "cosine",
                                         "total_steps": c.opt.total_steps}).total_steps == 10
    assert from_config(Outer, {"steps": 1, "cap": c.opt.cap}).cap is None


def test_unknown_key_is_named_with_its_path_and_a_suggestion():
    c = ml_collections.ConfigDict(dict(batch=dict(rowz=2)))
    with pytest.raises(ConfigError, match=r"rl\.batch\.rowz: unknown key for BatchConfig.*"
                                          r"did you mean 'rl\.batch\.rows'"):
        from_config(RLConfig, c, path="rl")
    with pytest.raises(ConfigError, match=r"^aggregate: unknown key") as e:
        from_config(PolicyGradientLoss, {"aggregate": "task_mean"})
    assert "mode" in str(e.value)  # the fields are listed


def test_wrong_type_is_named_with_its_path():
    cases = [({"steps": "3"}, r"^x\.steps: expected int, got str '3'"),
             ({"steps": 1.5}, r"^x\.steps: expected int, got float"),
             ({"steps": True}, r"^x\.steps: expected int, got bool"),
             ({"steps": 1, "flag": 1}, r"^x\.flag: expected bool, got int"),
             ({"steps": 1, "cap": "big"}, r"^x\.cap: expected float, got str"),
             ({"steps": 1, "eps": "a"}, r"^x\.eps: expected float \| tuple"),
             ({"steps": 1, "inner": {"sizes": [1, "2"]}}, r"^x\.inner\.sizes\[1\]: expected int"),
             ({"steps": 1, "inner": {"pair": [1, 2, 3]}}, r"^x\.inner\.pair: expected 2 items"),
             ({"steps": 1, "inner": 5}, r"^x\.inner: expected a mapping"),
             ({"steps": None}, r"^x\.steps: expected int, got NoneType")]
    for cfg, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            from_config(Outer, cfg, path="x")


def test_missing_required_key_and_double_setting_are_named():
    model = dict(hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                 num_kv_heads=2, head_dim=4)
    assert from_config(DecoderConfig, model, path="model", vocab_size=32).vocab_size == 32
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: missing required key"):
        from_config(DecoderConfig, model, path="model")
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: set by the caller"):
        from_config(DecoderConfig, {**model, "vocab_size": 9}, path="model", vocab_size=32)
    with pytest.raises(TypeError, match="vocab_sise"):
        from_config(DecoderConfig, model, vocab_sise=32)


def test_values_the_dataclass_rejects_are_reported_under_the_section_path():
    with pytest.raises(ConfigError, match=r"^rl\.loss: PolicyGradientLoss\.mode must be one of"):
        from_config(RLConfig, {"loss": {"mode": "tokens"}}, path="rl")
    with pytest.raises(ConfigError, match=r"^rl: RLConfig\.mode must be one of"):
        from_config(RLConfig, {"mode": "sometimes"}, path="rl")


def test_select_variant_names_the_known_ones():
    variants = {"default": 0, "quick": 1}
    assert select_variant(None, variants) == 0 and select_variant("", variants) == 0
    assert select_variant("quick", variants) == 1
    with pytest.raises(ConfigError, match=r"unknown config variant 'fast'; known variants: "
                                          r"default, quick"):
        select_variant("fast", variants)


def _parse_config_flag(arg: str):
    """The config as absl `config_flags` loads it from `--config=<arg>`."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=fv)
    fv(["prog", f"--config={arg}"])
    return fv.config


@pytest.mark.parametrize("name", ["calculator", "pinapple"])
def test_config_files_take_a_variant_and_reject_unknown_ones(name):
    path = os.path.join(EXPERIMENTS, name, "config.py")
    default, quick = _parse_config_flag(path), _parse_config_flag(path + ":quick")
    assert default.to_dict() != quick.to_dict()
    with pytest.raises(Exception, match="unknown config variant 'nope'; known variants: "
                                        "default, (.+, )?quick"):  # sorted names
        _parse_config_flag(path + ":nope")


@pytest.mark.parametrize("variant", [None, "quick", "long", "long_quick"])
def test_calculator_config_converts_to_its_dataclasses(variant):
    from experiments.calculator import agent as calculator_agent
    from experiments.calculator.config import get_config
    cfg = get_config(variant)
    typed = calculator_agent.typed_configs(cfg)
    assert typed["rl"].batch.rows == cfg.rl.batch.rows and typed["rl"].seed == cfg.seed
    assert typed["sft_optimizer"].total_steps == cfg.sft.steps
    cfg.seed = 5  # references follow the top-level seed
    assert calculator_agent.typed_configs(cfg)["sft"].seed == 5
    cfg.rl.loss.mode = "per_token"
    with pytest.raises(ConfigError, match=r"^rl\.loss: PolicyGradientLoss\.mode"):
        calculator_agent.typed_configs(cfg)


@pytest.mark.parametrize("variant", [None, "quick"])
def test_pinapple_config_converts_to_its_dataclasses(variant):
    from experiments.pinapple import run as pinapple
    from experiments.pinapple.config import get_config
    cfg = get_config(variant)
    for method in cfg.methods:
        typed = pinapple.typed_configs(cfg, method)
        assert typed["distill"].method == method
        assert typed["distill"].groups == cfg.loop.prompts_per_step
    assert typed["sampling"].min_batch == cfg.loop.prompts_per_step
    cfg.distill.top_tt = 3
    with pytest.raises(ConfigError, match=r"did you mean 'distill\.top_t'"):
        pinapple.typed_configs(cfg, "rmsd")


def test_a_model_config_subclass_keeps_the_field_hash_without_repeating_it():
    # A frozen dataclass subclass would get dataclasses' field-tuple hash, which fails on
    # rope_scaling's dict (first seen when the config is a jit static arg).
    from ac2_jax.models.config import ModelConfig
    from ac2_jax.models.family import FAMILIES, get_family

    @dataclasses.dataclass(frozen=True)
    class Forgot(DecoderConfig):  # no `__hash__ = ModelConfig.__hash__`
        extra: int = 0

    rope = {"rope_type": "llama3", "factor": 8.0}
    assert hash(Forgot.tiny(rope_scaling=rope)) == hash(Forgot.tiny(rope_scaling=dict(rope)))
    classes = {get_family(n).config_class for n in FAMILIES.names()}
    for cls in (c for c in classes if issubclass(c, ModelConfig)):
        assert cls.__hash__ is ModelConfig.__hash__, cls.__name__
        assert hash(cls.tiny()) == hash(cls.tiny()), cls.__name__
