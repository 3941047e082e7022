"""reasoning-gym (`pip install 'ac2_jax[reasoning-gym]'`): each procedural generator an env.

`ReasoningGymEnv("chain_sum")` serves the generator's items as tasks and grades
an answer with the generator's own `score_answer` (the library's verifier,
partial credit included). The answer is what the policy puts in
`<answer>...</answer>` (reasoning-gym's `extract_answer`, as its own
evaluations do; the system prompt is the library's "default" one, which asks
for that format); no tag is scored as the library scores `None`.

Tasks: item `index` of the generator's dataset seeded `dataset_seed` is task
`<generator>-<dataset_seed>-<index>` (deterministic in (generator, seed,
index)). `sample_tasks(n, seed, split)` draws indices from a stream seeded by
(generator, seed, split); an item belongs to the train or the eval split by
the sha256 of its question text (eval: 1 in `eval_every`), so the two splits
never share a question, whatever the seeds. Nothing is downloaded.

`reasoning_gym_env("a,b,c")` (the launcher's `--env=reasoning_gym:a,b,c`):
one generator is its env, several a `DomainMixer` with a domain per generator
("@mix30": `MIX_PRESETS["mix30"]`, 30 generators). `verifier_audit` probes
each domain's verifier without a model: a reference answer it rejects, wrong
answers (other tasks' answers, an empty one) it rewards.
"""

from __future__ import annotations

import difflib
import hashlib
import random
from collections.abc import Sequence
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.envs.mixer import DomainMixer
from ac2_jax.extras import require
from ac2_jax.seeds import hashed_seed

__all__ = ["MIX_PRESETS", "ReasoningGymEnv", "reasoning_gym_env", "verifier_audit"]

EXTRA = "reasoning-gym"
# Items per dataset the index stream draws from (a generator that refuses a size
# this large, e.g. word_ladder, gets its own default size).
SIZE = 100_000

# 30 generators with short questions (they fit a small model's context), an oracle
# answer and items generated in milliseconds; two whose verifiers the audit
# flags are kept in on purpose (puzzle24 accepts any expression that makes 24,
# time_intervals gives partial credit to wrong answers). No generator whose
# score_answer raises on a wrong answer (the audit's raises_on_wrong): such an
# attempt ends infra_error, so its wrong answers would never be trained and its
# pass rate in an adaptive mix would be biased upward. prime_factorization is
# out for that reason (it raises on any answer that is not a factor list);
# rotate_matrix took its place (2026-12-07, after the mix run of
# docs/notes/2026-12-07-environments-of-other-libraries.md).
MIX_PRESETS: dict[str, tuple[str, ...]] = {
    "mix30": (
        "basic_arithmetic", "chain_sum", "gcd", "lcm", "count_bits", "count_primes",
        "products", "simple_equations", "number_sequence", "spell_backward", "coin_flip",
        "complex_arithmetic", "decimal_chain_sum", "decimal_arithmetic",
        "fraction_simplification", "rotate_matrix", "power_function",
        "letter_counting", "base_conversion", "bitwise_arithmetic", "caesar_cipher",
        "calendar_arithmetic", "time_intervals", "syllogism", "word_sequence_reversal",
        "number_filtering", "dice", "leg_counting", "family_relationships", "puzzle24",
    ),
}  # fmt: skip


def _rg():
    return require("reasoning_gym", EXTRA, what="the reasoning_gym env adapter")


def _generators() -> list[str]:
    return sorted(_rg().factory.DATASETS)


def _check_generator(name: str) -> None:
    known = _generators()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reasoning_gym generator {name!r}{hint} (reasoning_gym has "
            f"{len(known)}: {', '.join(known[:8])}, ...; reasoning_gym.factory.DATASETS)"
        )


class ReasoningGymEnv(Env):
    """One reasoning-gym generator as an env (module docstring).

    generator: a name in `reasoning_gym.factory.DATASETS`; config: the generator's
    config fields (difficulty etc., its `<Name>Config`), seed and size excepted;
    dataset_seed: the dataset's seed (task ids carry it); eval_every: 1 in this many
    questions (by hash) is eval-only.
    """

    reward_range = (0.0, 1.0)

    def __init__(
        self,
        generator: str,
        config: dict[str, Any] | None = None,
        *,
        dataset_seed: int = 0,
        eval_every: int = 4,
        system_prompt: str | None = None,
    ):
        rg = _rg()
        _check_generator(generator)
        if eval_every < 2:
            raise ValueError(f"ReasoningGymEnv: eval_every must be >= 2, got {eval_every}")
        config = dict(config or {})
        for key in ("seed", "size"):
            if key in config:
                raise ValueError(
                    f"ReasoningGymEnv({generator!r}): config sets {key!r}, which the adapter "
                    "owns (dataset_seed= for the seed; indices are drawn per split)"
                )
        self.generator, self.dataset_seed, self.eval_every = generator, dataset_seed, eval_every
        self.name = generator
        try:
            self.dataset = rg.create_dataset(generator, seed=dataset_seed, size=SIZE, **config)
        except ValueError as e:
            if "size" not in str(e).lower():
                raise
            self.dataset = rg.create_dataset(generator, seed=dataset_seed, **config)
        self.size = int(self.dataset.size)
        self.system_prompt = (
            system_prompt if system_prompt is not None else rg.utils.SYSTEM_PROMPTS["default"]
        )

    def _split_of(self, question: str) -> str:
        h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
        return "eval" if h % self.eval_every == 0 else "train"

    def task_at(self, index: int) -> Task:
        """Item `index` of the dataset as a Task (its entry in metadata["entry"])."""
        entry = self.dataset[index]
        return Task(
            task_id=f"{self.generator}-{self.dataset_seed}-{index}",
            prompt=entry["question"],
            answer=entry["answer"],
            domain=self.generator,
            metadata={"index": index, "entry": entry},
        )

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"ReasoningGymEnv: split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(hashed_seed("reasoning_gym", self.generator, seed, split))
        tasks: list[Task] = []
        seen: set[int] = set()
        # A split takes 1/eval_every or the rest of the items: a bounded search.
        for _ in range(max(64, 64 * n * self.eval_every)):
            if len(tasks) == n:
                break
            index = rng.randrange(self.size)
            if index in seen:
                continue
            seen.add(index)
            task = self.task_at(index)
            if self._split_of(task.prompt) == split:
                tasks.append(task)
        if len(tasks) < n:
            raise ValueError(
                f"ReasoningGymEnv({self.generator!r}): found {len(tasks)} of {n} {split} "
                f"items (the generator has too few distinct questions for this size)"
            )
        return tasks

    def _entry(self, task: Task) -> dict[str, Any]:
        entry = task.metadata.get("entry")
        return entry if entry is not None else self.dataset[int(task.metadata["index"])]

    def verify(self, task: Task, answer: str | None) -> float:
        """The generator's `score_answer` of the `<answer>` text (None without one).

        reasoning-gym's contract is 0.0 for a wrong answer; a `score_answer` that
        raises (prime_factorization's on an answer that is not a factor list) is the
        library's bug, never a score: RuntimeError naming the generator and the
        answer, so the attempt ends infra_error (counted, never trained)."""
        extracted = None if answer is None else _rg().utils.extract_answer(answer)
        try:
            return float(self.dataset.score_answer(extracted, self._entry(task)))
        except Exception as exc:
            raise RuntimeError(
                f"reasoning_gym {self.generator!r}: its score_answer raised "
                f"{type(exc).__name__}({str(exc)[:120]!r}) on the answer {extracted!r:.80} "
                "(its contract is 0.0 for a wrong answer: a bug of the library, so this "
                "attempt is infra_error, not trained; verifier_audit flags such "
                "generators: leave them out of a mix)"
            ) from exc

    def reference_answer(self, task: Task) -> str | None:
        """The item's oracle answer in the answer tags (None when the generator has
        none: boxnet, graph_color, propositional_logic ... grade by checking)."""
        answer = self._entry(task).get("answer")
        return None if answer is None else f"<answer>{answer}</answer>"

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The oracle answer in the tags (SFT warm start); a generator without one
        has no demonstration (ValueError naming it)."""
        ref = self.reference_answer(task)
        if ref is None:
            raise ValueError(
                f"reasoning_gym {self.generator!r} has no oracle answer to demonstrate "
                f"({task.task_id}); leave it out of SFT"
            )
        return [*self.initial_messages(task), {"role": "assistant", "content": ref}]

    def hint(self, task: Task) -> str | None:
        """The oracle answer (distillation's hint; None without one)."""
        answer = self._entry(task).get("answer")
        return None if answer is None else f"The answer is {answer}."


def reasoning_gym_env(arg: str) -> Env:
    """The launcher's `--env=reasoning_gym:<arg>`: "<generator>" is its env,
    "<g1>,<g2>,..." a DomainMixer of them (equal weights), "@<preset>" a preset of
    `MIX_PRESETS`. Unknown names are one line with the nearest."""
    arg = arg.strip()
    if arg.startswith("@"):
        preset = arg[1:]
        if preset not in MIX_PRESETS:
            raise ValueError(
                f"unknown reasoning_gym preset {arg!r}; presets: "
                f"{', '.join('@' + p for p in MIX_PRESETS)}"
            )
        names: Sequence[str] = MIX_PRESETS[preset]
    else:
        names = [n.strip() for n in arg.split(",") if n.strip()]
    if not names:
        raise ValueError(
            "--env=reasoning_gym:<generator>[,<generator>...] names no generator "
            "(e.g. reasoning_gym:chain_sum,gcd)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--env=reasoning_gym:{arg}: a generator is named twice")
    for name in names:
        _check_generator(name)
    envs: dict[str, Env] = {name: ReasoningGymEnv(name) for name in names}
    return envs[names[0]] if len(names) == 1 else DomainMixer(envs)


def verifier_audit(env: Env, n: int = 8, seed: int = 0) -> dict[str, Any]:
    """Probes each domain's verifier with no model: on `n` train tasks with a
    reference answer, it must earn the top reward, and wrong answers must not pass
    (reward below the top): another task's reference answer when its text differs,
    an empty answer and a non-answer ("no idea"); a verifier that raises on one is
    flagged too (a rollout would end infra_error). Tasks without a reference answer
    are counted, not probed (their verifier may grade a harness's record, not an
    answer text). Returns
    {"domains": {domain: {"tasks", "no_reference",
    "rejects_reference": [ids], "accepts_wrong": [[task id, answer, reward]],
    "partial_credit_wrong": max reward below the top a wrong answer got,
    "raises_on_wrong": [[task id, answer, error]]}}, "flagged": [domains with a
    rejected reference, an accepted wrong answer or a crash on one]}."""
    envs = env.envs if isinstance(env, DomainMixer) else {getattr(env, "name", "env"): env}
    out: dict[str, Any] = {"domains": {}, "flagged": []}
    for domain, e in envs.items():
        top = e.reward_range[1]
        tasks = e.sample_tasks(n, seed=seed, split="train")
        refs = [e.reference_answer(t) for t in tasks]
        found: dict[str, Any] = {
            "tasks": len(tasks),
            "no_reference": sum(r is None for r in refs),
            "rejects_reference": [],
            "accepts_wrong": [],
            "partial_credit_wrong": 0.0,
            "raises_on_wrong": [],
        }
        for i, (task, ref) in enumerate(zip(tasks, refs, strict=True)):
            if ref is None:
                continue  # no answer text to probe with (its verify may grade a record)
            if e.verify(task, ref) < top:
                found["rejects_reference"].append(task.task_id)
            other = refs[(i + 1) % len(refs)]
            wrong = ["<answer></answer>", "<answer>no idea</answer>"]
            if other is not None and other.strip() != ref.strip():
                wrong.append(other)
            for answer in wrong:
                try:
                    reward = e.verify(task, answer)
                except Exception as exc:  # noqa: BLE001 - a verifier that crashes is a finding
                    found["raises_on_wrong"].append([task.task_id, answer, repr(exc)[:200]])
                    continue
                if reward >= top:
                    found["accepts_wrong"].append([task.task_id, answer, reward])
                else:
                    found["partial_credit_wrong"] = max(found["partial_credit_wrong"], reward)
        if found["rejects_reference"] or found["accepts_wrong"] or found["raises_on_wrong"]:
            out["flagged"].append(domain)
        out["domains"][domain] = found
    return out
