"""Judges: relevance judges for RMSD, and rubric judges that give rewards.

Relevance judges (RMSD: which candidate positions matter for the hint). A
judge sees one `JudgeExample` (the trace text, the response tokens, the
hint and the numbered candidate positions, i.e. the high-divergence positions
from `ac2_jax.losses.candidate_mask`) and returns the positions it selects, a
subset of the candidates, at most `top_s` of them. Positions index
`response_tokens`; `ac2_jax.losses.selection_mask` turns them into a [.., L]
mask. Results are cached per example (key = hash of the example's content).

`RuleJudge` is deterministic (hint keywords, regexes, teacher/response diff),
for tests and offline runs; `NoisyJudge` flips an oracle's verdicts at a set rate.
`LLMJudge` asks any OpenAI-compatible endpoint through an `openai.OpenAI`-like client
passed in.

Rubric judges (rewards from an LLM: verifiers' rubrics, ART's RULER, verl's
GenRM). `RubricJudge` asks any OpenAI-compatible chat endpoint (a provider's
URL, or the library's own endpoint serving another model, reached with its
admin key) to score an answer against a rubric, 0 to 1; `JudgedEnv` makes it
an env's verifier. Scores are cached by content hash; a failed request or an
invalid reply is retried with exponential backoff; when no valid score comes
the judge raises `JudgeUnavailable`: our failure, never the agent's, so the
rollout ends `infra_error` (never trained; counted by the collector and in
the judge's `stats["unavailable"]`), never a score.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import hashlib
import json
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from ac2_jax.envs.base import Env, Task

_STOPWORDS = frozenset(
    "a an and are as at be but by for from has have in is it its of on or that the this to "
    "was were will with you your not should would could which when what".split()
)


class JudgeError(RuntimeError):
    """A judge could not produce a valid selection (LLMJudge with on_error='raise')."""


class JudgeUnavailable(JudgeError):
    """A rubric judge gave no valid score after its retries (endpoint down, timed
    out, invalid replies). Not an `AgentError`: a rollout whose verifier raises it
    ends `infra_error`, never trained."""


@dataclasses.dataclass(frozen=True)
class JudgeExample:
    """What a judge sees for one response.

    `candidates` are positions into `response_tokens`, in priority order
    (largest divergence first). `teacher_tokens[i]`, if given, is the
    hint-conditioned teacher's argmax token at response position i (for the
    diff rule).
    """

    prompt: str
    response: str
    response_tokens: tuple[str, ...]
    hint: str
    candidates: tuple[int, ...]
    teacher_tokens: tuple[str, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "response_tokens", tuple(str(t) for t in self.response_tokens))
        object.__setattr__(self, "candidates", tuple(int(c) for c in self.candidates))
        n = len(self.response_tokens)
        bad = [c for c in self.candidates if not 0 <= c < n]
        if bad:
            raise ValueError(
                f"JudgeExample: candidate positions {bad} are outside the {n} response tokens"
            )
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"JudgeExample: duplicate candidate positions in {self.candidates}")
        if self.teacher_tokens is not None:
            object.__setattr__(self, "teacher_tokens", tuple(str(t) for t in self.teacher_tokens))
            if len(self.teacher_tokens) != n:
                raise ValueError(
                    f"JudgeExample: teacher_tokens has {len(self.teacher_tokens)} "
                    f"entries, response_tokens has {n}"
                )

    def key(self) -> str:
        """sha256 of the content (the judge cache key)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class Judge(abc.ABC):
    """Selects the candidate positions relevant to the hint; caches per example.

    `stats` counts: examples (select calls), cache_hits, selected (positions
    returned); subclasses add their own counters.
    """

    def __init__(self, top_s: int | None = None):
        if top_s is not None and (not isinstance(top_s, int) or top_s < 1):
            raise ValueError(
                f"{type(self).__name__}: top_s must be a positive int or None, got {top_s!r}"
            )
        self.top_s = top_s
        self.stats: dict[str, int] = {"examples": 0, "cache_hits": 0, "selected": 0}
        self._cache: dict[str, list[int]] = {}

    def select(self, example: JudgeExample) -> list[int]:
        """Selected positions (subset of example.candidates, at most top_s)."""
        self.stats["examples"] += 1
        key = example.key()
        if key in self._cache:
            self.stats["cache_hits"] += 1
            return list(self._cache[key])
        picked = self._select(example)
        if picked is None:  # skipped after errors: not cached, a later call may succeed
            return []
        out = list(dict.fromkeys(int(p) for p in picked))
        if self.top_s is not None:
            out = out[: self.top_s]
        self._cache[key] = out
        self.stats["selected"] += len(out)
        return list(out)

    @abc.abstractmethod
    def _select(self, example: JudgeExample) -> list[int] | None:
        """Positions in priority order, or None to skip (not cached)."""


def hint_keywords(hint: str, min_len: int = 4) -> set[str]:
    """Lower-cased words of the hint with at least `min_len` chars, minus stopwords."""
    return {
        w for w in re.findall(r"[^\W_]+", hint.lower()) if len(w) >= min_len and w not in _STOPWORDS
    }


class RuleJudge(Judge):
    """Deterministic judge: the union of three rules, restricted to candidates.

    - patterns: regexes; a token matches if `re.search` finds one in its text.
    - use_hint_keywords: the token's word characters (lower-cased, >= 3 chars)
      are a substring of a hint keyword (see `hint_keywords`) or contain one,
      so sub-word pieces of hint words match.
    - diff: the hint-conditioned teacher's argmax differs from the response
      token there (needs example.teacher_tokens).
    Selections come in candidate order.
    """

    def __init__(
        self,
        patterns: Sequence[str] = (),
        use_hint_keywords: bool = True,
        diff: bool = False,
        min_keyword_len: int = 4,
        top_s: int | None = None,
    ):
        super().__init__(top_s)
        self.patterns = [re.compile(p) for p in patterns]
        self.use_hint_keywords = use_hint_keywords
        self.diff = diff
        self.min_keyword_len = min_keyword_len
        if not (self.patterns or use_hint_keywords or diff):
            raise ValueError(
                "RuleJudge: enable at least one rule (patterns, use_hint_keywords, diff)"
            )

    def _matches(self, example: JudgeExample, pos: int, keywords: set[str]) -> bool:
        text = example.response_tokens[pos]
        if any(p.search(text) for p in self.patterns):
            return True
        if keywords:
            word = "".join(re.findall(r"[^\W_]+", text.lower()))
            if (
                len(word) >= 3
                and word not in _STOPWORDS
                and any(word in kw or kw in word for kw in keywords)
            ):
                return True
        teacher = example.teacher_tokens
        return self.diff and teacher is not None and teacher[pos] != text

    def _select(self, example: JudgeExample) -> list[int]:
        if self.diff and example.teacher_tokens is None:
            raise ValueError("RuleJudge(diff=True): the example has no teacher_tokens")
        keywords = (
            hint_keywords(example.hint, self.min_keyword_len) if self.use_hint_keywords else set()
        )
        return [c for c in example.candidates if self._matches(example, c, keywords)]


class NoisyJudge(Judge):
    """An `oracle` judge with a configured error rate: each candidate's verdict (selected
    or not) is flipped with probability `error_rate`, so a relevant position is missed
    and an irrelevant one picked at the same rate. The flips are a pure function of
    (`seed`, the example's content, the position): reruns and cache misses agree.
    stats["flips"] counts them. For measuring how RMSD depends on judge quality.
    """

    def __init__(self, oracle: Judge, error_rate: float, seed: int = 0, top_s: int | None = None):
        super().__init__(top_s)
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"NoisyJudge: error_rate must be in [0, 1], got {error_rate!r}")
        self.oracle, self.error_rate, self.seed = oracle, float(error_rate), int(seed)
        self.stats["flips"] = 0

    def _flipped(self, key: str, pos: int) -> bool:
        digest = hashlib.sha256(f"{self.seed}:{key}:{pos}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64 < self.error_rate

    def _select(self, example: JudgeExample) -> list[int]:
        truth, key = set(self.oracle.select(example)), example.key()
        out = []
        for c in example.candidates:
            flip = self._flipped(key, c)
            self.stats["flips"] += int(flip)
            if (c in truth) != flip:
                out.append(c)
        return out


_SYSTEM = (
    "You review an AI agent's response after feedback (a hint) about it. Some response tokens "
    "are numbered candidates. Decide which candidate tokens are relevant to the hint: tokens "
    "the hint is about, where the response went wrong or should change. Reply with JSON only, "
    'exactly {"relevant": [positions]}, most relevant first, using only candidate positions.'
)


class LLMJudge(Judge):
    """Judge backed by an OpenAI-compatible chat endpoint.

    client: an `openai.OpenAI`-like object (`client.chat.completions.create`).
    A reply must be JSON {"relevant": [int, ...]} naming only candidate
    positions. A bad reply (malformed JSON, wrong shape, out-of-range or
    non-candidate positions) or a failed request is retried up to
    `max_retries` times with the error fed back; then on_error="skip" returns
    [] (uncached, counted in stats["skipped"]) and on_error="raise" raises
    JudgeError. `context_tokens` response tokens either side are shown with
    each candidate.
    """

    def __init__(
        self,
        client: Any,
        model: str,
        max_retries: int = 2,
        on_error: str = "skip",
        top_s: int | None = None,
        temperature: float = 0.0,
        max_tokens: int = 256,
        context_tokens: int = 6,
        max_prompt_chars: int = 8000,
    ):
        super().__init__(top_s)
        if on_error not in ("skip", "raise"):
            raise ValueError(f"LLMJudge: on_error must be 'skip' or 'raise', got {on_error!r}")
        if max_retries < 0:
            raise ValueError(f"LLMJudge: max_retries must be >= 0, got {max_retries}")
        self.client, self.model = client, model
        self.max_retries, self.on_error = max_retries, on_error
        self.temperature, self.max_tokens = temperature, max_tokens
        self.context_tokens, self.max_prompt_chars = context_tokens, max_prompt_chars
        self.stats.update(requests=0, request_errors=0, invalid_replies=0, retries=0, skipped=0)

    def messages(self, example: JudgeExample) -> list[dict[str, str]]:
        """The chat request for one example (trace text, hint, numbered candidates)."""
        toks, k = example.response_tokens, self.context_tokens
        lines = []
        for c in example.candidates:
            left, right = "".join(toks[max(0, c - k) : c]), "".join(toks[c + 1 : c + 1 + k])
            lines.append(f"{c}: {json.dumps(toks[c])}   context: ...{left}[[{toks[c]}]]{right}...")
        prompt = example.prompt
        if len(prompt) > self.max_prompt_chars:
            prompt = "...(earlier text cut)..." + prompt[-self.max_prompt_chars :]
        cap = f" Select at most {self.top_s}." if self.top_s else ""
        user = (
            f"## Trace (context before the response)\n{prompt}\n\n"
            f"## Response\n{example.response}\n\n"
            f"## Hint\n{example.hint}\n\n## Candidate tokens (position: token)\n"
            + "\n".join(lines)
            + f"\n\nWhich candidate positions are relevant to the hint?{cap} "
            'Answer with JSON only: {"relevant": [positions]}.'
        )
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]

    def _select(self, example: JudgeExample) -> list[int] | None:
        messages = self.messages(example)
        reason = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
            self.stats["requests"] += 1
            try:
                resp = self.client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    temperature=self.temperature,
                    max_tokens=self.max_tokens,
                )
                text = resp.choices[0].message.content or ""
            except Exception as e:  # endpoint down, HTTP error, ...: retried like a bad reply
                self.stats["request_errors"] += 1
                reason = f"request failed: {type(e).__name__}: {e}"
                continue
            try:
                return parse_judge_reply(text, example)
            except ValueError as e:
                self.stats["invalid_replies"] += 1
                reason = str(e)
                messages = messages + [
                    {"role": "assistant", "content": text},
                    {
                        "role": "user",
                        "content": f"Invalid reply: {reason}. Reply again with JSON only: "
                        '{"relevant": [positions]} using only candidate positions.',
                    },
                ]
        if self.on_error == "raise":
            raise JudgeError(
                f"LLMJudge({self.model}): no valid reply after {self.max_retries + 1} "
                f"attempts for example {example.key()[:12]}: {reason}"
            )
        self.stats["skipped"] += 1
        return None


def _extract_json(text: str):
    body = text.strip()
    fence = re.match(r"^```(?:json)?\s*(.*?)\s*```$", body, re.DOTALL)
    if fence:
        body = fence.group(1)
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        pass
    match = re.search(r"\{.*\}", body, re.DOTALL)
    if match:
        try:
            return json.loads(match.group(0))
        except json.JSONDecodeError:
            pass
    raise ValueError(f"malformed JSON: {text[:200]!r}")


def parse_judge_reply(text: str, example: JudgeExample) -> list[int]:
    """Validated positions from a reply {"relevant": [...]}; ValueError says what is wrong."""
    data = _extract_json(text)
    if not isinstance(data, dict) or not isinstance(data.get("relevant"), list):
        raise ValueError(
            f'expected an object {{"relevant": [positions]}}, got {json.dumps(data)[:200]}'
        )
    n, cands = len(example.response_tokens), set(example.candidates)
    out = []
    for p in data["relevant"]:
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"position {p!r} is not an integer")
        if not 0 <= p < n:
            raise ValueError(f"position {p} is out of range [0, {n})")
        if p not in cands:
            raise ValueError(f"position {p} is not a candidate (candidates: {sorted(cands)})")
        out.append(p)
    return out


_RUBRIC_SYSTEM = (
    "You grade an AI agent's answer to a task against a rubric. Reply with JSON only, "
    'exactly {"score": s}, where s is a number from 0 (fails the rubric) to 1 (meets it '
    "fully)."
)


def parse_score_reply(text: str) -> float:
    """The score of a reply {"score": s} with 0 <= s <= 1; ValueError says what is wrong."""
    data = _extract_json(text)
    if not isinstance(data, dict) or "score" not in data:
        raise ValueError(f'expected an object {{"score": s}}, got {json.dumps(data)[:200]}')
    s = data["score"]
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s <= 1.0:
        raise ValueError(f"score {s!r} is not a number in [0, 1]")
    return float(s)


class RubricJudge:
    """Scores an answer against a rubric by asking an OpenAI-compatible chat endpoint.

    rubric: what earns what (shown to the judge with the task, the answer and,
    with `show_reference`, the task's reference answer). model: the endpoint's
    model name. base_url / api_key: where to ask (the library's own endpoint:
    its URL + "/v1" and its admin key, whose completions are not recorded);
    or pass `client` (an `openai.OpenAI`) and/or `async_client` (an
    `openai.AsyncOpenAI`) made elsewhere. timeout_s bounds each request.

    `score(prompt, answer, reference)` -> a float in [0, 1] (`ascore` awaits the
    async client; with only `client`, ascore runs it in a thread; with only
    `async_client`, score is refused). The score of the same request (endpoint,
    model, temperature, max_tokens, rubric, prompt, answer, reference: sha256,
    `key`) is asked once and cached (valid scores only).
    A request that fails (timeout, connection, 5xx, 408, 429) or a reply that is
    not {"score": s} with 0 <= s <= 1 is retried up to `max_retries` times, after
    backoff_s, 2 backoff_s, ... (at most max_backoff_s), a bad reply with the
    error fed back; then `JudgeUnavailable` is raised (one line: the model, the
    URL, the last reason); another 4xx (a wrong key, an unknown model) at once.
    `stats` counts: scored (calls), cache_hits, requests, retries, timeouts,
    request_errors, invalid_replies, unavailable.
    """

    def __init__(
        self,
        rubric: str,
        model: str,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        client: Any = None,
        async_client: Any = None,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        temperature: float = 0.0,
        max_tokens: int = 64,
        show_reference: bool = False,
    ):
        if not rubric or not isinstance(rubric, str):
            raise ValueError("RubricJudge: rubric must be a non-empty string")
        if base_url is None and client is None and async_client is None:
            raise ValueError(
                "RubricJudge: give base_url (an OpenAI-compatible endpoint, e.g. "
                "http://host:port/v1) or an openai client (client= / async_client=)"
            )
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(
                "RubricJudge: need max_retries >= 0, timeout_s > 0, backoff_s >= 0, "
                f"max_backoff_s >= 0; got {max_retries}, {timeout_s}, {backoff_s}, "
                f"{max_backoff_s}"
            )
        self.rubric, self.model, self.base_url = rubric, model, base_url
        self.api_key = api_key
        self.timeout_s, self.max_retries = float(timeout_s), int(max_retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.temperature, self.max_tokens = temperature, max_tokens
        self.show_reference = show_reference
        self._client, self._async_client = client, async_client
        self._own_async: dict[int, Any] = {}  # event loop id -> the AsyncOpenAI made for it
        self._cache: dict[str, float] = {}
        self._lock = threading.Lock()
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "scored",
                "cache_hits",
                "requests",
                "retries",
                "timeouts",
                "request_errors",
                "invalid_replies",
                "unavailable",
            ),
            0,
        )

    # -- clients

    def _openai_kwargs(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "api_key": self.api_key or "EMPTY",
            "timeout": self.timeout_s,
            "max_retries": 0,  # ours, with backoff
        }

    def _sync_client(self):
        if self._client is None and self.base_url is None:  # never openai's default URL
            raise ValueError(
                "RubricJudge.score: only async_client was given (no base_url, no client=); "
                "await ascore (JudgedEnv.averify does) or pass client= too"
            )
        if self._client is None:
            import openai

            self._client = openai.OpenAI(**self._openai_kwargs())
        return self._client

    def _aclient(self):
        """The async client, or None when only a sync `client` was given (ascore then
        runs it off the event loop; never openai's default URL)."""
        if self._async_client is not None:
            return self._async_client
        if self.base_url is None:
            return None
        loop = id(asyncio.get_running_loop())  # an httpx pool belongs to one loop
        if loop not in self._own_async:
            import openai

            self._own_async = {loop: openai.AsyncOpenAI(**self._openai_kwargs())}
        return self._own_async[loop]

    # -- the request

    def key(self, prompt: str, answer: str, reference: str | None = None) -> str:
        """sha256 of what the judge is asked and how (the cache key): the endpoint,
        model, sampling settings, system prompt, rubric, prompt, answer and the
        reference when it is shown."""
        ref = reference if self.show_reference else None
        where = self.base_url or "client"
        settings = [where, self.model, self.temperature, self.max_tokens, _RUBRIC_SYSTEM]
        blob = json.dumps([*settings, self.rubric, prompt, answer, ref], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def messages(self, prompt: str, answer: str, reference: str | None = None) -> list[dict]:
        """The chat request for one answer."""
        ref = (
            f"## Reference answer\n{reference}\n\n"
            if self.show_reference and reference is not None
            else ""
        )
        user = (
            f"## Task\n{prompt}\n\n{ref}## Answer\n{answer}\n\n## Rubric\n{self.rubric}\n\n"
            'Score the answer against the rubric. Reply with JSON only: {"score": s}.'
        )
        return [{"role": "system", "content": _RUBRIC_SYSTEM}, {"role": "user", "content": user}]

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    def _cached(self, key: str) -> float | None:
        self._count("scored")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self.stats["cache_hits"] += 1
            return hit

    def _delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s) if attempt else 0.0

    def _failed(self, exc: Exception) -> str:
        timeout = type(exc).__name__ in ("APITimeoutError", "TimeoutError", "ReadTimeout")
        self._count("timeouts" if timeout else "request_errors")
        return f"request failed: {type(exc).__name__}: {str(exc)[:200]}"

    @staticmethod
    def _refused(exc: Exception) -> bool:
        """A 4xx the endpoint answers the same way again (a wrong key, an unknown model,
        a request it cannot take): not retried. 408 and 429 are retried."""
        status = getattr(exc, "status_code", None)
        return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)

    def _reply(self, text: str, messages: list[dict]) -> tuple[float | None, list[dict], str]:
        try:
            return parse_score_reply(text), messages, ""
        except ValueError as e:
            self._count("invalid_replies")
            feedback = [
                {"role": "assistant", "content": text},
                {
                    "role": "user",
                    "content": f'Invalid reply: {e}. Reply with JSON only: {{"score": s}}, '
                    "s from 0 to 1.",
                },
            ]
            return None, messages + feedback, f"invalid reply: {e}"

    def _give_up(self, reason: str) -> JudgeUnavailable:
        self._count("unavailable")
        where = self.base_url or "the given client"
        return JudgeUnavailable(
            f"RubricJudge({self.model} at {where}): no valid score after "
            f"{self.max_retries + 1} attempts: {reason}"
        )

    def _store(self, key: str, score: float) -> float:
        with self._lock:
            self._cache[key] = score
        return score

    def _request(self, messages: list[dict]) -> dict[str, Any]:
        return dict(
            model=self.model,
            messages=messages,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
        )

    def _exchange(self, messages: list[dict]):
        """The retry loop, once for `score` and `ascore`: a generator that yields
        (seconds to wait, the request's keyword arguments) and is sent back the reply's
        text or the exception the request raised; it returns the score, or raises
        JudgeUnavailable after `max_retries` retries (a 4xx that is not 408/429 is not
        retried; an invalid reply is fed back to the judge)."""
        reason = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count("retries")
            self._count("requests")
            outcome = yield self._delay(attempt), self._request(messages)
            if isinstance(outcome, Exception):
                reason = self._failed(outcome)
                if self._refused(outcome):
                    break
                continue
            got, messages, reason = self._reply(outcome, messages)
            if got is not None:
                return got
        raise self._give_up(reason)

    def score(self, prompt: str, answer: str, reference: str | None = None) -> float:
        """The rubric score of `answer` in [0, 1]; JudgeUnavailable when none comes."""
        key = self.key(prompt, answer, reference)
        hit = self._cached(key)
        if hit is not None:
            return hit
        client = self._sync_client()  # only an async client: refused before any request
        exchange, outcome = self._exchange(self.messages(prompt, answer, reference)), None
        try:
            while True:
                delay, request = exchange.send(outcome)
                time.sleep(delay)
                try:
                    resp = client.chat.completions.create(**request)
                    outcome = resp.choices[0].message.content or ""
                except Exception as e:  # noqa: BLE001 - the exchange retries, then gives up
                    outcome = e
        except StopIteration as done:
            return self._store(key, done.value)

    async def ascore(self, prompt: str, answer: str, reference: str | None = None) -> float:
        """`score` without blocking the event loop (the async client; a judge with
        only a sync client calls it in a thread)."""
        key = self.key(prompt, answer, reference)
        hit = self._cached(key)
        if hit is not None:
            return hit
        exchange, outcome = self._exchange(self.messages(prompt, answer, reference)), None
        try:
            while True:
                delay, request = exchange.send(outcome)
                await asyncio.sleep(delay)
                try:
                    aclient = self._aclient()
                    if aclient is None:  # only a sync client: off the loop
                        create = self._sync_client().chat.completions.create
                        resp = await asyncio.to_thread(create, **request)
                    else:
                        resp = await aclient.chat.completions.create(**request)
                    outcome = resp.choices[0].message.content or ""
                except Exception as e:  # noqa: BLE001 - the exchange retries, then gives up
                    outcome = e
        except StopIteration as done:
            return self._store(key, done.value)


class JudgedEnv(Env):
    """`env` with a rubric judge as its verifier (a reward from an LLM).

    Tasks, tools, harness, hints, demonstrations and replies are `env`'s. verify
    maps the judge's score s in [0, 1] to low + s (high - low) of env.reward_range;
    an attempt with no answer gets `low` without a judge call. `averify` (what a
    rollout awaits when an env has it) asks without blocking the event loop. When
    the judge cannot answer it raises `JudgeUnavailable`: the rollout ends
    infra_error, never trained. The reference answer is shown to the judge with
    `RubricJudge(show_reference=True)`; `reference_answer` is None here (the
    judge's scale is not the env's verifier's, so the contract's solvability
    check does not apply).
    """

    def __init__(self, env: Env, judge: RubricJudge):
        if hasattr(env, "env_for"):
            raise ValueError(
                "JudgedEnv: a DomainMixer routes each task to its domain's env (and "
                "verifier); wrap the domains that need a judge instead"
            )
        self.env, self.judge = env, judge
        self.name = f"{getattr(env, 'name', 'env')}+judge"
        self.system_prompt = env.system_prompt
        self.reward_range = env.reward_range

    def __getattr__(self, name: str):  # the optional methods: hint, demonstration, reply, ...
        if name in ("env", "judge"):
            raise AttributeError(name)
        return getattr(self.env, name)

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        return self.env.sample_tasks(n, seed, split)

    @property
    def tools(self):
        return self.env.tools

    def initial_messages(self, task: Task) -> list[dict[str, Any]]:
        return self.env.initial_messages(task)

    def judge_memo(self, task, messages, memo):
        return self.env.judge_memo(task, messages, memo)

    def _reference(self, task: Task) -> str | None:
        return None if task.answer is None else str(task.answer)

    def _reward(self, score: float) -> float:
        low, high = self.reward_range
        return float(low + score * (high - low))

    def verify(self, task: Task, answer: str | None) -> float:
        if answer is None:
            return float(self.reward_range[0])
        return self._reward(self.judge.score(task.prompt, answer, self._reference(task)))

    async def averify(self, task: Task, answer: str | None) -> float:
        if answer is None:
            return float(self.reward_range[0])
        score = await self.judge.ascore(task.prompt, answer, self._reference(task))
        return self._reward(score)
