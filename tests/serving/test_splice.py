"""Token-in/token-out splicing keeps append-only conversations append-only."""

import json

import pytest

from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids, turn_key
from ac2_jax.text import Tokenizer, parse_tool_calls
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids of `text` one character at a time: decodes to `text`, but BPE would merge."""
    return [i for ch in text for i in tok.encode(ch)]


def extends(prompt, prefix):
    return prompt[: len(prefix)] == prefix


def test_no_memory_is_plain_rendering(tok):
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    ids, n = build_prompt_ids(tok, msgs, TOOLS, TurnMemory())
    assert n == 0 and ids == tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True)


def test_spliced_turns_keep_the_conversation_append_only(tok):
    mem = TurnMemory()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    p1, _ = build_prompt_ids(tok, msgs, None, mem)
    text1 = "hello there, friend"
    out1 = char_ids(tok, text1) + [tok.eos_token_id]
    assert tok.encode(text1) != out1[:-1]  # re-tokenizing would change the ids
    mem.remember(text1, [], out1)
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Again."}]
    p2, n = build_prompt_ids(tok, msgs, None, mem)
    assert n == 1 and extends(p2, p1 + out1)
    plain = tok.apply_chat_template(msgs, tokenize=True)
    assert not extends(plain, p1 + out1)  # what splicing fixes

    # Second output ends by length (no EOS): the template's own end tag follows it.
    out2 = char_ids(tok, "again and")
    mem.remember("again and", None, out2)
    msgs += [{"role": "assistant", "content": "again and"}, {"role": "user", "content": "Bye."}]
    p3, n = build_prompt_ids(tok, msgs, None, mem)
    assert n == 2 and extends(p3, p2 + out2)
    assert p3[len(p2) + len(out2)] == tok.eos_token_id


def test_tool_call_turns_match_whatever_json_the_client_sends_back(tok):
    mem = TurnMemory()
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    p1, _ = build_prompt_ids(tok, msgs, TOOLS, mem)
    emitted = '<tool_call>\n{"name":"add","arguments":{"b":4,"a":3}}\n</tool_call>'
    out1 = tok.encode(emitted) + [tok.eos_token_id]
    content, calls = parse_tool_calls(emitted)
    mem.remember(content, calls, out1)
    # The client re-serializes arguments and invents its own ids and nulls.
    sent_back = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "other", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"a": 3, "b": 4}, indent=1)}}]}
    msgs += [sent_back, {"role": "tool", "tool_call_id": "other", "content": "7"}]
    p2, n = build_prompt_ids(tok, msgs, TOOLS, mem)
    assert n == 1 and extends(p2, p1 + out1)
    assert not extends(tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True), p1 + out1)


def test_edited_or_unknown_turns_are_rendered_plainly(tok):
    mem = TurnMemory()
    mem.remember("original answer", None, char_ids(tok, "original answer"))
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "edited answer"},
            {"role": "user", "content": "Q2"}]
    ids, n = build_prompt_ids(tok, msgs, None, mem)
    assert n == 0 and ids == tok.apply_chat_template(msgs, tokenize=True)


def test_template_that_drops_a_turn_falls_back_to_plain_rendering(tok):
    dropping = Tokenizer(tok.hf, chat_template=(
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}|{% endif %}"
        "{% endfor %}"), special_tokens=tok.special_tokens)
    mem = TurnMemory()
    mem.remember("hi", None, char_ids(tok, "hi"))
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "b"}]
    ids, n = build_prompt_ids(dropping, msgs, None, mem)
    assert n == 0 and ids == dropping.apply_chat_template(msgs, tokenize=True)


def test_turn_key_ignores_ids_whitespace_and_json_formatting():
    a = turn_key(" x \n", [{"id": "1", "function": {"name": "f", "arguments": '{"a":1,"b":[2]}'}}])
    b = turn_key("x", [{"id": "2", "function": {"name": "f", "arguments": {"b": [2], "a": 1}}}])
    assert a == b
    assert turn_key("x", None) == turn_key("x", [])
    assert turn_key("x", None) != turn_key("y", None)
    assert turn_key(None, [{"function": {"name": "f", "arguments": "not json"}}]) != \
        turn_key(None, [{"function": {"name": "f", "arguments": "not  json"}}])


def test_memory_lookup_only_for_assistant_messages(tok):
    mem = TurnMemory()
    mem.remember("same text", None, [5, 6])
    mem.remember("empty", None, [])  # nothing sampled: nothing to splice
    assert mem.lookup({"role": "assistant", "content": "same text"}) == [5, 6]
    assert mem.lookup({"role": "user", "content": "same text"}) is None
    assert mem.lookup({"role": "assistant", "content": "empty"}) is None
    assert len(mem) == 1


def test_turns_that_differ_only_in_surrounding_whitespace_keep_their_own_ids():
    """Two turns of one rollout, "\\n<tool_call>" and "<tool_call>\\n" (sampled as
    [201, 768] and [768, 201]), shared one whitespace-stripped key: the later one's
    ids were spliced in for the earlier one, so a previous_response_id chain on it
    opened a new episode (tests/serving/test_responses.py's chain test failed once in
    ~80 seeds). The exact text finds its own ids; a client that strips the text
    still finds the stripped key's."""
    memory = TurnMemory()
    memory.remember("\n<tool_call>", None, [201, 768])
    memory.remember("<tool_call>\n", None, [768, 201])
    assert memory.lookup({"role": "assistant", "content": "\n<tool_call>"}) == [201, 768]
    assert memory.lookup({"role": "assistant", "content": "<tool_call>\n"}) == [768, 201]
    assert memory.lookup({"role": "assistant", "content": "<tool_call>"}) == [768, 201]
