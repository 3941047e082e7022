"""Tokenizer: ids, chat rendering and tool-call parsing, checked against transformers."""

import json
import os

import pytest

from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.text.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]

CONVERSATION = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 3 + 4? Then add 10."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": "{\"a\": 3, \"b\": 4}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    {"role": "assistant", "content": "Now the second step.", "tool_calls": [
        {"id": "call_2", "type": "function",
         "function": {"name": "add", "arguments": {"a": 7, "b": 10}}},
        {"id": "call_3", "type": "function",
         "function": {"name": "add", "arguments": "{\"a\": 0, \"b\": 0}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "17"},
    {"role": "tool", "tool_call_id": "call_3", "content": "0"},
    {"role": "assistant", "content": "The answer is 17."},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    return path, build_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def hf_tok(tiny):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny[0])


@pytest.mark.parametrize("text", [
    "What is 123 + 456? The answer is 579.",
    "hello  world\n\n\tindented {\"name\": \"add\", \"arguments\": {\"a\": 1}}",
    "<|im_start|>user\nHi<|im_end|>\n<tool_call>x</tool_call>",
    "unicode: café ∑ 日本 🙂",
    "",
])
def test_encode_matches_transformers_and_round_trips(tiny, hf_tok, text):
    _, tok = tiny
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids)


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("n_messages", [2, 3, 4, 8])
def test_chat_template_matches_transformers(tiny, hf_tok, tools, gen, n_messages):
    _, tok = tiny
    msgs = CONVERSATION[:n_messages]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen)
    assert text == hf_tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen,
                                              tokenize=False)
    ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=True)
    hf_ids = hf_tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen,
                                        tokenize=True, return_dict=False)
    assert ids == list(hf_ids)


def test_rendered_tool_turn_equals_generation_prompt_plus_output(tiny):
    # The template renders an assistant turn exactly as the generation
    # prompt followed by the text the model emits, ending in the EOS token.
    _, tok = tiny
    prompt = tok.apply_chat_template(CONVERSATION[:2], tools=TOOLS)
    full = tok.apply_chat_template(CONVERSATION[:3], tools=TOOLS, add_generation_prompt=False)
    emitted = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
    assert full == prompt + emitted
    content, calls = tok.parse_tool_calls(emitted.replace("<|im_end|>\n", ""))
    assert content == "" and calls[0]["function"] == {"name": "add",
                                                      "arguments": '{"a": 3, "b": 4}'}


def test_from_pretrained_reads_transformers_saved_dir(tiny, hf_tok, tmp_path):
    # transformers writes the template to chat_template.jinja; we read it back.
    hf_tok.save_pretrained(str(tmp_path))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS) == \
        tiny[1].apply_chat_template(CONVERSATION, tools=TOOLS)
    assert tok.eos_token_id == tiny[1].eos_token_id


def test_named_templates_pick_tool_use(tiny, tmp_path):
    path, tok = tiny
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "plain{{ messages|length }}"},
                            {"name": "tool_use", "template": "tools{{ tools|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    named = Tokenizer.from_pretrained(str(tmp_path))
    assert named.apply_chat_template(CONVERSATION[:2]) == "plain2"
    assert named.apply_chat_template(CONVERSATION[:2], tools=TOOLS) == "tools1"


def test_errors_are_clear(tiny, tmp_path):
    _, tok = tiny
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(TypeError, match="dicts"):
        tok.apply_chat_template(["hi"])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    no_template = Tokenizer(tok.hf, special_tokens=tok.special_tokens)
    with pytest.raises(ValueError, match="no chat template .tokenizer_config.json.s .chat_template. or chat_template.jinja"):
        no_template.apply_chat_template(CONVERSATION[:2])
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="unknown message role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_tool_parser_is_named_and_used(tiny, tmp_path):
    path, tok = tiny
    assert tok.tool_parser.name == "hermes"
    hermes = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    coder = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
    assert tok.parse_tool_calls(hermes)[1][0]["function"] == {"name": "add",
                                                               "arguments": '{"a": 3}'}
    assert tok.parse_tool_calls(coder) == (coder, [])  # not this model's format
    xml = Tokenizer.from_pretrained(path, tool_parser="qwen3_coder")
    assert xml.tool_parser.name == "qwen3_coder"
    _, calls = xml.parse_tool_calls(coder, TOOLS)  # the schema types "a" as an integer
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 3}'}
    with pytest.raises(ValueError, match="unknown tool parser 'llama9'"):
        Tokenizer(tok.hf, tool_parser="llama9")
