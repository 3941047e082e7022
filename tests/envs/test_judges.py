"""judges: RuleJudge rules, and LLMJudge over real HTTP through the real `openai`
client against a FastAPI server on 127.0.0.1 that plays scripted judge-model
answers (valid JSON, malformed JSON, out-of-range / non-candidate positions,
HTTP errors): retries, skip/raise, stats counts and the per-example cache.
"""

import json
import socket
import threading
import time

import numpy as np
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ac2_jax.envs.judges import (
    JudgeError,
    JudgeExample,
    LLMJudge,
    NoisyJudge,
    RuleJudge,
    parse_judge_reply,
)
from ac2_jax.losses import selection_mask

TOKENS = ("The", " area", " is", " 3", " *", " 4", " =", " 7", ".", " Done")


def _example(hint="Multiply, don't add: the area is width times height.", candidates=(7, 3, 6, 1),
             teacher=None):
    return JudgeExample(prompt="User: a rectangle is 3 by 4; its area?\nAssistant:",
                        response="".join(TOKENS), response_tokens=TOKENS, hint=hint,
                        candidates=candidates, teacher_tokens=teacher)


class ScriptedJudgeServer:
    """OpenAI /v1/chat/completions answering from a script; records requests."""

    def __init__(self):
        self.script: list = []  # str = reply content, int = HTTP error status
        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            item = self.script.pop(0) if self.script else '{"relevant": []}'
            if isinstance(item, int):
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=item)
            return {"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion",
                    "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": item}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "judge test server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def server():
    with ScriptedJudgeServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    server.script.clear()
    server.requests.clear()
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="test",
                         max_retries=0, timeout=20)


def test_valid_reply_and_cache(server, client):
    judge = LLMJudge(client, "judge-model")
    ex = _example()
    server.script += ['{"relevant": [7, 3]}', '```json\n{"relevant": [6]}\n```']
    assert judge.select(ex) == [7, 3]
    req = server.requests[0]
    assert req["model"] == "judge-model"
    user = req["messages"][-1]["content"]
    assert ex.hint in user and ex.prompt in user
    for c in ex.candidates:  # numbered candidate tokens
        assert f"{c}: {json.dumps(TOKENS[c])}" in user
    # Same content -> cache hit, no HTTP call; a new example -> a call (fenced JSON accepted).
    assert judge.select(_example()) == [7, 3]
    assert len(server.requests) == 1
    assert judge.select(_example(hint="Use multiplication.")) == [6]
    assert len(server.requests) == 2
    assert judge.stats == {"examples": 3, "cache_hits": 1, "selected": 3, "requests": 2,
                           "request_errors": 0, "invalid_replies": 0, "retries": 0, "skipped": 0}
    np.testing.assert_array_equal(selection_mask([judge.select(ex)], len(TOKENS))[0],
                                  [0, 0, 0, 1, 0, 0, 0, 1, 0, 0])


def test_malformed_then_valid_is_retried_with_feedback(server, client):
    judge = LLMJudge(client, "m", max_retries=2)
    server.script += ['relevant: 7, 3 (sorry)', '{"relevant": [7]}']
    assert judge.select(_example()) == [7]
    assert judge.stats["requests"] == 2 and judge.stats["retries"] == 1
    assert judge.stats["invalid_replies"] == 1 and judge.stats["skipped"] == 0
    retry = server.requests[1]["messages"]
    assert retry[-2] == {"role": "assistant", "content": "relevant: 7, 3 (sorry)"}
    assert "malformed JSON" in retry[-1]["content"]


def test_malformed_every_time_skips_uncached(server, client):
    judge = LLMJudge(client, "m", max_retries=2, on_error="skip")
    server.script += ["not json"] * 3 + ['{"wrong": [1]}', "{}", '{"relevant": "7"}']
    assert judge.select(_example()) == []
    assert len(server.requests) == 3
    assert judge.stats["skipped"] == 1 and judge.stats["invalid_replies"] == 3
    assert judge.stats["retries"] == 2 and judge.stats["selected"] == 0
    # A skipped example is not cached: asking again calls the endpoint again.
    assert judge.select(_example()) == []
    assert len(server.requests) == 6 and judge.stats["cache_hits"] == 0
    assert judge.stats["skipped"] == 2 and judge.stats["invalid_replies"] == 6


def test_out_of_range_and_non_candidate_raise(server, client):
    judge = LLMJudge(client, "m", max_retries=1, on_error="raise")
    server.script += ['{"relevant": [3, 42]}', '{"relevant": [0]}']
    with pytest.raises(JudgeError, match="position 0 is not a candidate"):
        judge.select(_example())
    assert "out of range" in server.requests[1]["messages"][-1]["content"]
    assert judge.stats["requests"] == 2 and judge.stats["invalid_replies"] == 2
    assert judge.stats["skipped"] == 0
    judge0 = LLMJudge(client, "m", max_retries=0, on_error="raise")
    server.script += ['{"relevant": [true]}']
    with pytest.raises(JudgeError, match="not an integer"):
        judge0.select(_example())
    assert judge0.stats["requests"] == 1 and judge0.stats["retries"] == 0


def test_http_error_is_retried_and_top_s_caps(server, client):
    judge = LLMJudge(client, "m", max_retries=2, top_s=2)
    server.script += [500, '{"relevant": [6, 7, 3, 7]}']
    assert judge.select(_example()) == [6, 7]  # deduplicated, judge order, capped at 2
    assert judge.stats["request_errors"] == 1 and judge.stats["requests"] == 2
    assert "at most 2" in server.requests[0]["messages"][-1]["content"]
    judge_raise = LLMJudge(client, "m", max_retries=0, on_error="raise")
    server.script += [503]
    with pytest.raises(JudgeError, match="request failed"):
        judge_raise.select(_example())


def test_parse_judge_reply_and_bad_config():
    ex = _example()
    assert parse_judge_reply('Sure! {"relevant": [1, 7]} hope this helps', ex) == [1, 7]
    with pytest.raises(ValueError, match="out of range"):
        parse_judge_reply('{"relevant": [-1]}', ex)
    with pytest.raises(ValueError, match="on_error"):
        LLMJudge(None, "m", on_error="ignore")
    with pytest.raises(ValueError, match="top_s"):
        LLMJudge(None, "m", top_s=0)


def test_rule_judge_keywords_patterns_diff():
    ex = _example(candidates=(7, 4, 3, 1, 9))
    # Hint keywords: " area" matches "area"; nothing else in the candidates does.
    assert RuleJudge().select(ex) == [1]
    assert RuleJudge(patterns=[r"^\s*[*+]$"], use_hint_keywords=False).select(ex) == [4]
    teacher = list(TOKENS)
    teacher[7], teacher[0] = " 12", "An"  # position 0 differs but is not a candidate
    diff = RuleJudge(use_hint_keywords=False, diff=True)
    assert diff.select(_example(candidates=(7, 4, 3, 1, 9), teacher=teacher)) == [7]
    both = RuleJudge(patterns=[r"\*"], diff=True, top_s=2)
    ex_t = _example(candidates=(9, 7, 4, 1), teacher=teacher)
    assert both.select(ex_t) == [7, 4]  # candidate order, capped
    assert both.select(ex_t) == [7, 4] and both.stats["cache_hits"] == 1
    with pytest.raises(ValueError, match="teacher_tokens"):
        diff.select(ex)
    with pytest.raises(ValueError, match="at least one rule"):
        RuleJudge(use_hint_keywords=False)


def test_judge_example_validation_and_key():
    with pytest.raises(ValueError, match="outside"):
        _example(candidates=(3, 10))
    with pytest.raises(ValueError, match="duplicate"):
        _example(candidates=(3, 3))
    with pytest.raises(ValueError, match="teacher_tokens"):
        _example(teacher=TOKENS[:-1])
    assert _example().key() == _example().key() != _example(candidates=(7, 3)).key()


def _noisy_examples(n=200):
    toks = tuple(f" w{i}" for i in range(12))
    return [JudgeExample(prompt=f"p{k}", response="".join(toks), response_tokens=toks,
                         hint="Spell w3 as w33.", candidates=tuple(range(12)),
                         teacher_tokens=None) for k in range(n)]


def test_noisy_judge_flips_the_oracles_verdicts_at_its_error_rate():
    oracle = RuleJudge(patterns=[r"w[37]$"], use_hint_keywords=False)
    examples = _noisy_examples()
    assert [NoisyJudge(oracle, 0.0).select(e) for e in examples[:5]] == [[3, 7]] * 5
    assert [NoisyJudge(oracle, 1.0).select(e) for e in examples[:5]] == [
        [c for c in range(12) if c not in (3, 7)]] * 5
    noisy = NoisyJudge(oracle, 0.2, seed=1)
    picks = [set(noisy.select(e)) for e in examples]
    missed = np.mean([p not in s for s in picks for p in (3, 7)])
    false = np.mean([p in s for s in picks for p in range(12) if p not in (3, 7)])
    # 400 relevant and 2,000 irrelevant verdicts at rate 0.2: binomial sd 0.020 / 0.009.
    assert abs(missed - 0.2) < 0.07 and abs(false - 0.2) < 0.035
    assert noisy.stats["flips"] == sum(len(s ^ {3, 7}) for s in picks)
    again = NoisyJudge(oracle, 0.2, seed=1)
    assert [set(again.select(e)) for e in examples] == picks  # a function of seed + content
    other = NoisyJudge(oracle, 0.2, seed=2)
    assert [set(other.select(e)) for e in examples] != picks
    assert NoisyJudge(oracle, 0.5, top_s=2).select(examples[0]).__len__() <= 2
    with pytest.raises(ValueError, match="error_rate must be in \\[0, 1\\], got 1.5"):
        NoisyJudge(oracle, 1.5)
