"""Tool-call parsers: Hermes and Qwen3-Coder formats, linear work, length cap, registry."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ac2_jax.text.tool_parsers import (
    HermesParser,
    ParsedText,
    Qwen3CoderParser,
    ToolCallParser,
    get_parser,
    parse_tool_calls,
    parser_names,
    register_parser,
)

ADD_TOOL = [{"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "number"}, "flag": {"type": "boolean"},
        "items": {"type": "array"}, "opts": {"type": "object"}, "note": {"type": "string"}}}}}]


def linear_bound(text: str) -> int:
    # Work budget: each character is searched at most twice (open tag, close tag),
    # stripped once and decoded a constant number of times.
    return 4 * len(text) + 64


def hermes_call(name, args):  # as the Qwen/Hermes chat templates render a call
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(args)}}}\n</tool_call>'


def coder_call(name, args):  # as the Qwen3-Coder chat template renders a call
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


RENDER = {"hermes": hermes_call, "qwen3_coder": coder_call}


# ---------------------------------------------------------------- the old regex, reproduced

_OLD_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def old_regex_parse(text):
    """The regex parser this module replaced (backtracks: cubic on '<tool_call>' + spaces)."""
    calls = []

    def take(match):
        try:
            obj = json.loads(match.group(1))
        except (json.JSONDecodeError, RecursionError):
            return match.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return match.group(0)
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append({"name": obj["name"], "arguments": args})
        return ""

    content = _OLD_RE.sub(take, text)
    return (content.strip() if calls else text.strip()), calls


DEGENERATE = [
    "<tool_call>" + " " * 5000,                         # the reported stall: 4000 spaces took 22 s
    "<tool_call>" + " \n\t" * 3000 + "x",
    "<tool_call>" * 3000,                               # many openings, no close
    ("<tool_call>" + " " * 50) * 200 + "</tool_call",   # almost-closing tag
    "<tool_call>{" + "[" * 20000 + "</tool_call>",      # nesting deeper than json can read
    "<tool_call>" + '{"name": "f", "arguments": ' + "1" * 6000 + "}</tool_call>",  # int limit
    "<tool_call><function=" + "<parameter=" * 2000 + "</tool_call>",
]


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("text", DEGENERATE, ids=range(len(DEGENERATE)))
def test_degenerate_text_is_parsed_in_linear_steps(name, text):
    parsed = get_parser(name).parse(text)
    assert parsed == (text.strip(), [])
    assert parsed.malformed >= 1 and parsed.unparsed_chars == 0
    assert 0 < parsed.steps <= linear_bound(text)


def test_steps_grow_linearly_not_quadratically():
    # The old regex's work grows ~8x per doubling of the spaces; ours 2x.
    steps = [parse_tool_calls("<tool_call>" + " " * n).steps for n in (1000, 2000, 4000, 8000)]
    for a, b in zip(steps, steps[1:]):
        assert b <= 2 * a + 16


# ---------------------------------------------------------------- Hermes (today's behaviour)

def test_parse_tool_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "mul", "arguments": "{\\"x\\": 3}"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 3}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_tool_calls_keeps_malformed_and_plain_text():
    assert parse_tool_calls("  just text ") == ("just text", [])
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(no_name) == (no_name, [])
    truncated = '<tool_call>\n{"name": "add", "argu'
    assert parse_tool_calls(truncated) == (truncated, [])
    mixed = bad + '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(mixed)
    assert content == bad and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_counters_say_what_was_left_as_text():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    good = hermes_call("f", {"x": 1})
    parsed = parse_tool_calls(f"{bad} mid {good} {bad} <tool_call> cut")
    assert isinstance(parsed, ParsedText) and len(parsed.calls) == 1
    assert parsed.content == f"{bad} mid  {bad} <tool_call> cut" and parsed.malformed == 3
    assert parse_tool_calls(good).malformed == 0


def test_parsed_text_copies_and_pickles_with_its_counters():
    import copy
    import pickle
    parsed = parse_tool_calls("a <tool_call>{bad}</tool_call> " + hermes_call("f", {}))
    for clone in (copy.deepcopy(parsed), pickle.loads(pickle.dumps(parsed))):
        assert clone == parsed and type(clone) is ParsedText
        assert (clone.steps, clone.malformed, clone.unparsed_chars) == (
            parsed.steps, parsed.malformed, parsed.unparsed_chars) and clone.malformed == 1


def test_parameters_key_and_missing_arguments():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"q": "é"}}</tool_call>')
    assert calls[0]["function"] == {"name": "f", "arguments": '{"q": "é"}'}
    _, calls = parse_tool_calls('<tool_call>{"name": "g"}</tool_call>')
    assert calls[0]["function"] == {"name": "g", "arguments": "{}"}


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "{", "}", "[",
             '"', '\\"', ":", ",", " ", "\n", "\t", "\u3000", "é", "🙂", "name", '"name"',
             '"arguments"', "add", "1", "null", "<function=f>", "</function>",
             "<parameter=a>", "</parameter>", hermes_call("add", {"a": 1}),
             coder_call("add", {"a": "1"}), '{"name": "f"}', "<", ">", "/"]
fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8))


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(fragment, max_size=40))
def test_hermes_matches_the_old_regex_on_short_text(parts):
    # Same content and same calls as the regex it replaces (short text: the
    # regex is cubic in the whitespace after an unclosed tag).
    text = "".join(parts)
    content, calls = parse_tool_calls(text)
    assert (content, [c["function"] for c in calls]) == old_regex_parse(text)


# ---------------------------------------------------------------- Qwen3-Coder XML

def test_qwen3_coder_parses_the_rendered_format():
    p = get_parser("qwen3_coder")
    text = ("I will add.\n\n" + coder_call("add", {"a": 3, "b": "2.5", "flag": "True",
                                                   "items": "[1, 2]", "opts": '{"k": "v"}',
                                                   "note": "line1\nline2", "extra": "null"})
            + "\n" + coder_call("lookup", {"query": "  spaced  "}))
    content, calls = p.parse(text, ADD_TOOL)
    assert content == "I will add."
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "a": 3, "b": 2.5, "flag": True, "items": [1, 2], "opts": {"k": "v"},
        "note": "line1\nline2", "extra": None}
    assert calls[1]["function"] == {"name": "lookup", "arguments": '{"query": "  spaced  "}'}
    # Without the schema every value is a string (vLLM's rule).
    _, untyped = p.parse(text)
    assert json.loads(untyped[0]["function"]["arguments"])["a"] == "3"


def test_qwen3_coder_values_that_do_not_read_as_their_type_stay_strings():
    p = get_parser("qwen3_coder")
    _, calls = p.parse(coder_call("add", {"a": "three", "b": "x", "flag": "maybe",
                                          "items": "[1,", "opts": "NaN", "note": "[]"}),
                       ADD_TOOL)
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "a": "three", "b": "x", "flag": "maybe", "items": "[1,", "opts": "NaN", "note": "[]"}
    _, calls = p.parse(coder_call("add", {"items": '{"k": 1}', "opts": "[1]"}), ADD_TOOL)
    assert json.loads(calls[0]["function"]["arguments"]) == {"items": '{"k": 1}', "opts": "[1]"}
    _, calls = p.parse(coder_call("add", {"b": "inf", "a": "9" * 5000}), ADD_TOOL)
    assert json.loads(calls[0]["function"]["arguments"]) == {"b": "inf", "a": "9" * 5000}


@pytest.mark.parametrize("bad", [
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=add>\nstray<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",                          # no name
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",     # open param
    "<tool_call>\n<function=add>\n<parameter=a>1</parameter><parameter=a>2</parameter>"
    "</function></tool_call>",                                                      # repeated key
    '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',                  # Hermes JSON
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>",     # cut
])
def test_qwen3_coder_malformed_stays_text(bad):
    parsed = get_parser("qwen3_coder").parse("x " + bad)
    assert parsed == ("x " + bad, []) and parsed.malformed == 1


def test_qwen3_coder_no_parameters_and_compact_whitespace():
    p = get_parser("qwen3_coder")
    _, calls = p.parse("<tool_call><function=ping></function></tool_call>")
    assert calls[0]["function"] == {"name": "ping", "arguments": "{}"}
    _, calls = p.parse("<tool_call><function=f><parameter=x>v</parameter></function></tool_call>")
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": "v"}'}


# ---------------------------------------------------------------- forcing a call

@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
def test_named_opening_starts_the_rendered_call(name):
    p = get_parser(name)
    rendered = RENDER[name]("add", {"a": 1})
    assert rendered.startswith(p.opening) and rendered.startswith(p.named_opening("add"))
    _, calls = p.parse(rendered)
    assert calls[0]["function"]["name"] == "add"


# ---------------------------------------------------------------- length cap

@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
def test_text_past_the_cap_is_not_parsed_and_is_counted(name):
    cls = type(get_parser(name))
    call = RENDER[name]("add", {"a": 1})
    text = call + " " * 100 + call
    parser = cls(max_chars=len(call) + 50)
    parsed = parser.parse(text)
    assert len(parsed.calls) == 1 and parsed.content == call  # the second stays text
    assert parsed.unparsed_chars == len(text) - (len(call) + 50) and parsed.malformed == 0
    cap = len(call) + 100 + len("<tool_call>") + 5  # the second opens inside, closes outside
    straddling = cls(max_chars=cap).parse(text)
    assert len(straddling.calls) == 1 and straddling.malformed == 1
    assert straddling.content == call and straddling.unparsed_chars == len(text) - cap
    assert cls().parse(text).unparsed_chars == 0 and len(cls().parse(text).calls) == 2
    with pytest.raises(ValueError, match="max_chars"):
        cls(max_chars=-1)


# ---------------------------------------------------------------- registry

def test_registry():
    assert {"hermes", "qwen3_coder"} <= set(parser_names())
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("qwen3_coder"), Qwen3CoderParser)
    with pytest.raises(ValueError, match="unknown tool parser 'nope'.*hermes"):
        get_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes", HermesParser())
    with pytest.raises(TypeError, match="ToolCallParser"):
        register_parser("x", object())
    with pytest.raises(TypeError, match="str"):
        get_parser("hermes").parse(b"<tool_call>")


def test_a_new_format_plugs_in():
    class Bracket(ToolCallParser):  # [[name]] with no arguments
        name, opening = "test_bracket", "[["
        block_open, block_close = "[[", "]]"

        def named_opening(self, function_name):
            return "[[" + function_name

        def parse_block(self, body, schema):
            return {"id": "call_b", "type": "function",
                    "function": {"name": body, "arguments": "{}"}} if body.isidentifier() else None

    register_parser("test_bracket", Bracket())
    parsed = get_parser("test_bracket").parse("go [[ping]] [[no way]]")
    assert parsed.content == "go  [[no way]]" and parsed.malformed == 1
    assert [c["function"]["name"] for c in parsed.calls] == ["ping"]


# ---------------------------------------------------------------- property: random model text

def _repeat(parts):
    return "".join(f * n for f, n in parts)[:65536]


noise_64k = st.lists(st.tuples(fragment, st.integers(1, 3000)), max_size=30).map(_repeat)
arg_value = st.one_of(st.integers(-999, 999), st.text(alphabet="abc xyz\u00e9", max_size=8))
a_call = st.tuples(st.sampled_from(["add", "get_weather", "f_1"]),
                   st.dictionaries(st.sampled_from(["a", "b", "city"]), arg_value, max_size=3))


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(text=noise_64k)
def test_random_text_never_raises_and_work_is_linear(name, text):
    parsed = get_parser(name).parse(text)
    assert isinstance(parsed.content, str) and isinstance(parsed.calls, list)
    assert parsed.steps <= linear_bound(text)
    if not parsed.calls:
        assert parsed.content == text.strip()


def _without(s, tag):
    while tag in s:
        s = s.replace(tag, "")
    return s


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(noises=st.lists(noise_64k.map(lambda s: s[:8000]), min_size=1, max_size=5),
       calls=st.lists(a_call, min_size=1, max_size=4))
def test_valid_calls_in_noise_are_found(name, noises, calls):
    # Noise without an opening tag before a call (an unclosed one would rightly
    # swallow the next call), everything else allowed, stray closing tags included.
    p = get_parser(name)
    noises = [_without(n, p.block_open) for n in noises][:len(calls) + 1]
    noises += [""] * (len(calls) + 1 - len(noises))
    text = noises[0] + "".join(RENDER[name](n, a) + noises[i + 1]
                               for i, (n, a) in enumerate(calls))
    parsed = p.parse(text)
    expected = [(n, a if name == "hermes" else {k: str(v) for k, v in a.items()})
                for n, a in calls]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.calls] == expected
    assert parsed.content == "".join(noises).strip() and parsed.malformed == 0
    assert parsed.steps <= linear_bound(text)
