"""serving/core/stream_generation.py: the SSE chunks of a streamed request."""

from ac2_jax.serving.core.requests import parse_chat_request, parse_completion_request
from ac2_jax.serving.core.stream_generation import incremental_logprobs

USER = {"role": "user", "content": "hi"}


def test_logprobs_go_out_with_the_tokens_only_without_top_logprobs():
    chat = lambda **kw: parse_chat_request({"model": "m", "messages": [USER], **kw})  # noqa: E731
    assert not incremental_logprobs(chat())
    assert incremental_logprobs(chat(logprobs=True))
    # top-logprobs are not in the token feed: every entry comes with the final result
    assert not incremental_logprobs(chat(logprobs=True, top_logprobs=2))
    assert incremental_logprobs(parse_completion_request({"model": "m", "prompt": "x",
                                                          "logprobs": 0}))
    assert not incremental_logprobs(parse_completion_request({"model": "m", "prompt": "x",
                                                              "logprobs": 2}))
