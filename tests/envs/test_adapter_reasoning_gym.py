"""reasoning-gym through its adapter: the library's own generators and verifiers, unchanged.

The reward is the generator's own `score_answer` of the policy's <answer> text; task
ids come from (generator, seed, index); train and eval never share a question; a
mix of generators is a DomainMixer checked domain by domain; bad specs are one line.
"""

import json
import sys

import pytest

pytest.importorskip(
    "reasoning_gym", reason="the reasoning-gym extra (pip install 'ac2_jax[reasoning-gym]')"
)

import reasoning_gym  # noqa: E402
from reasoning_gym.utils import extract_answer  # noqa: E402

from ac2_jax.envs import DomainMixer  # noqa: E402
from ac2_jax.envs.adapters import MIX_PRESETS, ReasoningGymEnv, verifier_audit  # noqa: E402
from ac2_jax.envs.contract import EnvError, check_env, load_env  # noqa: E402

GENERATORS = ["chain_sum", "gcd", "spell_backward", "fraction_simplification"]


@pytest.fixture(scope="module")
def envs():
    return {g: ReasoningGymEnv(g) for g in GENERATORS}


def test_the_reward_is_the_generators_own_score(envs):
    for g, env in envs.items():
        # The library's own dataset, built independently of the adapter.
        ds = reasoning_gym.create_dataset(g, seed=0, size=100_000)
        for task in env.sample_tasks(3, seed=5):
            entry = ds[task.metadata["index"]]
            assert entry["question"] == task.prompt
            right = f"Let me think.\n<answer>{entry['answer']}</answer>"
            assert env.verify(task, right) == ds.score_answer(entry["answer"], entry) == 1.0
            for wrong in ("<answer>12345</answer>", "<answer>no idea</answer>"):
                got = env.verify(task, wrong)
                assert got == ds.score_answer(extract_answer(wrong), entry), (g, wrong)
                assert got < 1.0
            # No answer tag: scored as the library scores no answer.
            assert env.verify(task, entry["answer"]) == ds.score_answer(None, entry)
            assert env.verify(task, None) == ds.score_answer(None, entry)


def test_a_partial_credit_score_is_passed_through():
    env = ReasoningGymEnv("fraction_simplification")
    task = env.sample_tasks(1, seed=0)[0]
    ds = reasoning_gym.create_dataset("fraction_simplification", seed=0, size=100_000)
    entry = ds[task.metadata["index"]]
    wrong = "<answer>1/7</answer>"
    assert env.verify(task, wrong) == ds.score_answer("1/7", entry) == 0.05


def test_task_ids_splits_and_the_contract(envs):
    env = envs["chain_sum"]
    train = env.sample_tasks(60, seed=0)
    assert [t.task_id for t in train] == [t.task_id for t in env.sample_tasks(60, seed=0)]
    assert all(t.task_id == f"chain_sum-0-{t.metadata['index']}" for t in train)
    assert [t.task_id for t in env.sample_tasks(4, seed=1)] != [t.task_id for t in train[:4]]
    evals = env.sample_tasks(30, seed=0, split="eval")
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert not {t.task_id for t in train} & {t.task_id for t in evals}
    # Another dataset seed: other items under other ids.
    other = ReasoningGymEnv("chain_sum", dataset_seed=7).sample_tasks(2, seed=0)
    assert all(t.task_id.startswith("chain_sum-7-") for t in other)
    for e in envs.values():
        assert check_env(e) is e


def test_several_generators_are_a_mixer_checked_domain_by_domain():
    mix = load_env("reasoning_gym:chain_sum, gcd")
    assert isinstance(mix, DomainMixer) and sorted(mix.envs) == ["chain_sum", "gcd"]
    assert check_env(mix) is mix
    tasks = mix.sample_tasks(8, seed=0)
    assert {t.domain for t in tasks} <= {"chain_sum", "gcd"}
    assert all(t.task_id.startswith(f"{t.domain}/{t.domain}-0-") for t in tasks)
    assert len(MIX_PRESETS["mix30"]) == 30


class _NoOracle(ReasoningGymEnv):
    """A generator whose reference answer the verifier rejects (to show check_env's word)."""

    def reference_answer(self, task):
        return "<answer>surely not this</answer>"


def test_check_env_names_the_domain_that_fails():
    mix = DomainMixer({"gcd": ReasoningGymEnv("gcd"), "bad": _NoOracle("lcm")})
    with pytest.raises(
        EnvError, match=r"domain 'bad': _NoOracle does not meet .* not the top reward"
    ):
        check_env(mix)


def test_the_verifier_audit_flags_what_accepts_wrong_answers_or_crashes():
    # puzzle24's verifier checks that the expression makes 24, not that it uses the
    # task's numbers: another task's answer passes. prime_factorization's raises
    # ValueError on an answer that is not a factor list (a rollout would end
    # infra_error). propositional_logic has no oracle answer (counted, not probed);
    # gcd's verifier is sound.
    names = ("puzzle24", "gcd", "propositional_logic", "prime_factorization")
    mix = DomainMixer({g: ReasoningGymEnv(g) for g in names})
    audit = verifier_audit(mix, n=4)
    assert audit["flagged"] == ["puzzle24", "prime_factorization"]
    found = audit["domains"]["puzzle24"]
    assert found["accepts_wrong"] and not found["rejects_reference"]
    task_id, answer, reward = found["accepts_wrong"][0]
    assert reward == 1.0 and answer.startswith("<answer>")
    crash = audit["domains"]["prime_factorization"]["raises_on_wrong"][0]
    assert crash[1] == "<answer>no idea</answer>"
    assert crash[2].startswith("RuntimeError(") and "its score_answer raised ValueError" in crash[2]
    assert audit["domains"]["propositional_logic"]["no_reference"] == 4
    assert audit["domains"]["gcd"]["accepts_wrong"] == []
    json.dumps(audit)  # written to the report as is


def test_a_scorer_that_raises_is_the_librarys_bug_and_the_mix_leaves_it_out():
    # reasoning-gym's contract: score_answer returns 0.0 for a wrong answer.
    # prime_factorization's raises ValueError on one that is not a factor list: that
    # is the library's bug, so the attempt must end infra_error (never a silent 0,
    # which would train a crash as a score) with a line naming the generator ...
    env = ReasoningGymEnv("prime_factorization")
    task = env.sample_tasks(1, seed=0)[0]
    with pytest.raises(
        RuntimeError,
        match=r"^reasoning_gym 'prime_factorization': its "
        r"score_answer raised ValueError.* on the answer 'no idea' \(its "
        r"contract is 0.0 for a wrong answer",
    ):
        env.verify(task, "<answer>no idea</answer>")
    # ... and the mix preset holds no generator whose scorer raises on a wrong answer
    # (the audit's raises_on_wrong); puzzle24 is kept on purpose (module comment).
    audit = verifier_audit(load_env("reasoning_gym:@mix30"), n=4)
    assert len(audit["domains"]) == 30
    assert [d for d, f in audit["domains"].items() if f["raises_on_wrong"]] == []
    assert audit["flagged"] == ["puzzle24"]


@pytest.mark.parametrize("spec, says", [
    ("reasoning_gym:chain_summ",
     "unknown reasoning_gym generator 'chain_summ'; did you mean 'chain_sum'?"),
    ("reasoning-gym:chain_sum",
     "no adapter 'reasoning-gym' nor module of that name; did you mean reasoning_gym:?"),
    ("reasoning_gym:", "names no generator"),
    ("reasoning_gym:gcd,gcd", "a generator is named twice"),
    ("reasoning_gym:@mix3", "unknown reasoning_gym preset '@mix3'; presets: @mix30"),
])  # fmt: skip
def test_a_bad_spec_is_one_line(spec, says):
    with pytest.raises(EnvError) as e:
        load_env(spec)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_without_the_library_the_extra_is_named(monkeypatch):
    from ac2_jax.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'ac2_jax\[reasoning-gym\]'"):
        load_env("reasoning_gym:gcd")


def test_mix_console_lines_and_report(tmp_path):
    from ac2_jax.recipes._rl import mix_lines, write_mix_report

    history = [
        {"rl_step": 0, "mix_weight/a": 0.7, "mix_weight/b": 0.3, "mix_pass_rate/b": 0.25,
         "mix_results/a": 2.0, "mix_results/b": 8.0},
        {"rl_step": 1, "mix_weight/a": 0.4, "mix_weight/b": 0.6, "mix_pass_rate/a": 0.5,
         "mix_pass_rate/b": 0.0, "mix_results/a": 8.0, "mix_results/b": 16.0},
    ]  # fmt: skip
    assert mix_lines(1, history[0]) == ["step 1 mix (weight/pass rate): a=0.700/-, b=0.300/0.25"]
    assert mix_lines(1, {"pass_rate": 0.5}) == []
    wide = {f"mix_weight/domain_{i}": 1 / 30 for i in range(30)}
    assert all(len(x) <= 100 for x in mix_lines(3, wide)) and len(mix_lines(3, wide)) > 1
    out = write_mix_report(history, str(tmp_path))
    records = [json.loads(x) for x in open(out["mix_jsonl"])]
    assert records[1] == {"step": 2, "mix_weight": {"a": 0.4, "b": 0.6},
                          "mix_pass_rate": {"a": 0.5, "b": 0.0},
                          "mix_results": {"a": 8.0, "b": 16.0}}  # fmt: skip
    assert open(out["mix_png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_an_adaptive_mix_of_one_domain_is_refused(tmp_path):
    from ac2_jax import recipes
    from ac2_jax.config import ConfigError, from_config

    cfg = from_config(
        recipes.RLRecipeConfig,
        {"paths": {"workdir": str(tmp_path / "run")}, "mix": {"adaptive": True}},
    )
    with pytest.raises(ConfigError, match=r"^mix.adaptive=true needs an env of several domains"):
        recipes.rl("tiny", ReasoningGymEnv("gcd"), cfg)
    assert not (tmp_path / "run" / "report" / "model.json").exists()  # before the model


def test_the_all_generators_audit_script_at_toy_size(tmp_path, capsys):
    from experiments.rg_mix.verifier_audit import main

    found = main(str(tmp_path / "audit.json"), names=["gcd", "game_of_life_halting", "acre_x"])
    assert json.load(open(tmp_path / "audit.json")) == found
    assert found["gcd"]["accepts_wrong"] == [] and found["gcd"]["tasks"] == 8
    # Its verifier is bool(answer) == bool(oracle): any non-empty answer passes.
    assert found["game_of_life_halting"]["accepts_wrong"]
    assert found["acre_x"]["error"].startswith("ValueError: unknown reasoning_gym generator")
    assert capsys.readouterr().out.count("\n") == 3
