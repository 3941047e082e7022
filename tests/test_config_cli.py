"""config_cli: a typed config from defaults, a file and overrides; each mistake one line."""

import textwrap

import pytest

from ac2_jax.config import ConfigError, from_config
from ac2_jax.config_cli import load_config, nearest_paths, parse_value, schema_paths, to_dict
from ac2_jax.recipes import DistillRecipeConfig, RLRecipeConfig, SFTRecipeConfig
from ac2_jax.training import PolicyGradientLoss, SFTLoss


@pytest.mark.parametrize("cls", [RLRecipeConfig, SFTRecipeConfig, DistillRecipeConfig])
def test_defaults_round_trip_through_plain_data(cls):
    assert from_config(cls, to_dict(cls())) == cls()


def test_a_field_the_file_does_not_list_is_settable(tmp_path):
    # Finding: --config.rl.dynamic_sampling could not be set (ml_collections refused
    # any key the shipped config did not list).
    path = tmp_path / "cfg.py"
    path.write_text("def get_config(variant=None):\n    return {'rl': {'steps': 3}}\n")
    cfg = load_config(RLRecipeConfig, str(path), ["rl.dynamic_sampling=true",
                                                  "rl.max_refills=4"])
    assert cfg.rl.steps == 3 and cfg.rl.dynamic_sampling is True and cfg.rl.max_refills == 4
    assert cfg.rl.batch == RLRecipeConfig().rl.batch  # the rest keeps its defaults


def test_file_variants_and_later_overrides_win(tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text(textwrap.dedent("""
        import ml_collections
        def get_config(variant=None):
            c = ml_collections.ConfigDict({"rl": {"steps": 5}, "seed": 1})
            if variant == "quick":
                c.rl.steps = 1
            return c
    """))
    assert load_config(RLRecipeConfig, f"{path}:quick").rl.steps == 1
    cfg = load_config(RLRecipeConfig, str(path), ["rl.steps=7", "seed=2"])
    assert (cfg.rl.steps, cfg.seed) == (7, 2)


def test_a_mistyped_field_is_one_line_with_its_nearest_valid_names():
    with pytest.raises(ConfigError) as e:
        load_config(RLRecipeConfig, None, ["rl.lerning_rate=1e-3"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("rl.lerning_rate: no such field in RLConfig")
    assert "rl.optimizer.learning_rate (float)" in msg


def test_abbreviations_find_their_field():
    paths = list(schema_paths(RLRecipeConfig))
    assert nearest_paths("rl.lr", paths)[0] == "rl.optimizer.learning_rate"
    assert nearest_paths("rl.batch.row", paths)[0] == "rl.batch.rows"
    assert nearest_paths("rollout.max_token", paths)[0] == "rollout.max_tokens"


def test_a_bad_value_is_one_line_naming_the_field_and_its_type():
    with pytest.raises(ConfigError, match=r"^rl.steps='many': expected int") as e:
        load_config(RLRecipeConfig, None, ["rl.steps=many"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="RLConfig.mode must be one of"):  # its own check
        load_config(RLRecipeConfig, None, ["rl.mode=sometimes"])
    with pytest.raises(ConfigError, match="expected --config.FIELD=VALUE"):
        load_config(RLRecipeConfig, None, ["rl.steps"])


def test_values_parse_by_the_fields_type():
    assert parse_value(bool, "False") is False and parse_value(bool, "1") is True
    assert parse_value(float | None, "none") is None
    assert parse_value(float | tuple[float, float], "0.2") == 0.2
    assert parse_value(tuple[int, ...], "3,4") == [3, 4]
    assert parse_value(tuple[int, int], "(3, 4)") == [3, 4]  # from_config makes the tuple
    with pytest.raises(ValueError):
        parse_value(bool, "maybe")


def test_a_registered_kind_switches_the_section_to_its_own_defaults():
    cfg = load_config(RLRecipeConfig, None, ["rl.loss.kind=sft", "rl.loss.mode=token_mean"])
    assert cfg.rl.loss == SFTLoss(mode="token_mean")
    assert isinstance(RLRecipeConfig().rl.loss, PolicyGradientLoss)


def test_help_gives_each_field_its_type_default_and_meaning():
    # Issue 68, finding 10: --help listed field paths only.
    from ac2_jax.config_cli import field_help
    from ac2_jax.recipes import DistillRecipeConfig, RLRecipeConfig, SFTRecipeConfig

    for cls in (RLRecipeConfig, SFTRecipeConfig, DistillRecipeConfig):
        rows = {path: (tp, default, doc) for path, tp, default, doc in field_help(cls)}
        assert all(doc and "\n" not in doc for _, _, doc in rows.values())
        # The recipe's own sections say what each field is (a library config's field its
        # docstring does not name points to its class).
        own = [p for p, (_, _, doc) in rows.items() if "(see its docstring)" in doc
               and p.split(".")[0] in ("seed", "paths", "rollout", "sampler", "eval", "log",
                                       "demos", "loop", "tool_parser", "lora")]
        assert not own, (cls.__name__, own)
    rows = {p: (t, d, doc) for p, t, d, doc in field_help(RLRecipeConfig)}
    assert rows["rl.steps"][:2] == ("int", "10")  # the recipe's default, not RLConfig's
    assert rows["rollout.max_tokens"][:2] == ("int", "128")
    assert "per request" in rows["rollout.max_tokens"][2]
    assert rows["paths.existing"][:2] == ("str", "'refuse'")
    assert rows["lora"][1] == "None" and rows["lora.rank"][0] == "int"
    assert rows["tool_parser"][0] == "str | None"


def test_help_lines_are_one_per_field_within_the_width():
    from ac2_jax.config_cli import field_help, help_lines
    from ac2_jax.recipes import RLRecipeConfig

    lines = help_lines(RLRecipeConfig)
    assert len(lines) == len(field_help(RLRecipeConfig)) and all(len(x) <= 120 for x in lines)
    assert "  --config.rollout.max_tokens  int = 128  per request; also" in lines[
        [x.split()[0] for x in lines].index("--config.rollout.max_tokens")]
