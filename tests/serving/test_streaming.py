"""TextStream: streamed deltas + the rest equal the non-streamed content exactly."""

import random

import pytest

from ac2_jax.sampling import SampleResult, truncate_at_stop
from ac2_jax.serving.core import chat
from ac2_jax.serving.core.streaming import TextStream, _held_suffix
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_held_suffix():
    assert _held_suffix("abc <tool", ["<tool_call>"]) == 5
    assert _held_suffix("abc", ["<tool_call>"]) == 0
    assert _held_suffix("say EN", ["END", "N!"]) == 2
    assert _held_suffix("x<tool_call>", ["<tool_call>"]) == 0  # whole: not a proper prefix


TEXTS = [
    ("plain words and more words here", (), False, ""),
    ("alpha beta END gamma delta", ("END",), False, ""),
    ("  thinking first <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n"
     "</tool_call>  ", (), True, ""),
    ("no calls but tools on, trailing space   ", (), True, ""),
    ('{"a": 3, "b": 4}}\n</tool_call>', (), True, '<tool_call>\n{"name": "add", "arguments": '),
    ("stop inside <tool_call> STOP after", ("STOP",), True, ""),
]


@pytest.mark.parametrize("text, stop, parse_tools, prefix", TEXTS)
def test_deltas_plus_rest_equal_the_final_content(tok, text, stop, parse_tools, prefix):
    ids = tok.encode(text) + [tok.eos_token_id]
    rng = random.Random(0)
    for _ in range(20):  # random split points of the token stream
        result = SampleResult(ids, [-0.5] * len(ids), "stop", 0)
        cut, matched = truncate_at_stop(result, stop, tok.decode)
        final = chat.choice_from_result(0, cut, matched, tok, parse_tools, prefix=prefix)
        want = final.content if parse_tools else final.text
        stream = TextStream(tok, stop, parse_tools, prefix)
        sent, shown = "", []
        i = 0
        while i < len(cut.output_ids):
            k = rng.randint(1, 4)
            delta, new_ids, _ = stream.push(cut.output_ids[i:i + k], [-0.5] * k)
            sent += delta
            shown += new_ids
            i += k
        assert sent + stream.rest(want) == (want or "")
        assert shown == cut.output_ids[:len(shown)]  # logprobs only of tokens that stay
        if stop and matched:
            assert matched not in sent


def test_nothing_is_shown_that_could_start_a_stop_string(tok):
    stream = TextStream(tok, ("THE END",), False)
    seen = ""
    for word in ["once", " upon", " THE", " E"]:
        delta, _, _ = stream.push(tok.encode(word), [0.0] * len(tok.encode(word)))
        seen += delta
    assert "THE" not in seen and seen.startswith("once upon")
