"""The tool-call parser is chosen by the model (issue 68, finding 5): the format its chat
template renders calls in, else its family's (config.json's model_type), else Hermes;
`tool_parser` overrides it. Per family, the published template's rendered call and the
model's output in that format parse to the call.

LLAMA31 follows the template Llama-3.1-Instruct tokenizers ship (custom tools in the
first user message, a call rendered as `{"name": ..., "parameters": ...}`, results in
the `ipython` role), GEMMA3 the one gemma-3-*-it tokenizers ship (no tools: Google's
function-calling guide has the model answer a ```tool_code``` block). Both are written
from the published templates' structure (the builtin-tools branches left out), nothing
is downloaded.
"""

import json

import pytest
from tokenizers import AddedToken, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ac2_jax.text.tokenizer import Tokenizer, choose_tool_parser
from ac2_jax.text.tool_parsers import get_parser, parser_for_template
from tests.models.test_family_templates import MISTRAL_V3, QWEN25, TOOLS

transformers = pytest.importorskip("transformers")

LLAMA31 = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first \
user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument \
name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ \
message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA3 = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# name: (template, config.json model_type, special tokens, added tokens, the format picked,
#        why, what the model emits for one get_weather(city="Paris", days=2) call)
FAMILIES = {
    "qwen2.5": (QWEN25, "qwen2", {"eos_token": "<|im_end|>"},
                ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"], "hermes",
                "template",
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
                '\n</tool_call>'),
    "llama3.1": (LLAMA31, "llama", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|python_tag|>"], "llama3_json", "template",
                 '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    "mistral": (MISTRAL_V3, "mistral", {"bos_token": "<s>", "eos_token": "</s>"},
                ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "mistral", "template",
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    "gemma3": (GEMMA3, "gemma3_text", {"bos_token": "<bos>", "eos_token": "<end_of_turn>"},
               ["<bos>", "<start_of_turn>", "<end_of_turn>"], "gemma_tool_code", "family",
               '```tool_code\nget_weather(city="Paris", days=2)\n```'),
    # A fine-tune's template wins over its architecture (Hermes-3 on Llama 3.1).
    "hermes-on-llama": (QWEN25, "llama", {"eos_token": "<|im_end|>"},
                        ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"], "hermes",
                        "template",
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                        '"days": 2}}\n</tool_call>'),
}
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}


def _tokenizer_dir(path, template, model_type, special, added):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["the weather in Paris", "call get_weather"] * 10,
                           trainer=trainers.BpeTrainer(
                               vocab_size=280, show_progress=False, special_tokens=added,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    Tokenizer(hf, chat_template=template, special_tokens=special).save_pretrained(str(path))
    if model_type:
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    template, model_type, special, added, *_ = FAMILIES[request.param]
    path = _tokenizer_dir(tmp_path_factory.mktemp(request.param.replace(".", "_")), template,
                          model_type, special, added)
    return request.param, path


def test_the_parser_is_the_models_format_and_reads_its_calls(family):
    name, path = family
    _, _, _, _, expected, why, emitted = FAMILIES[name]
    tok = Tokenizer.from_pretrained(path)
    assert tok.tool_parser.name == expected, (name, tok.tool_parser_source)
    assert why in tok.tool_parser_source
    content, calls = tok.parse_tool_calls(emitted, TOOLS)
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                              for c in calls] == [(CALL["name"], CALL["arguments"])]
    if expected == "gemma_tool_code":  # its template renders no calls: nothing to read back
        return
    # The call its published template renders (OpenAI-form arguments, as a demo holds
    # them) parses back to the same call; our rendering is transformers'.
    call = {"id": "abcDEF123", "type": "function",
            "function": {"name": CALL["name"], "arguments": json.dumps(CALL["arguments"])}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21}'}]
    ours = tok.apply_chat_template(messages, TOOLS, add_generation_prompt=False)
    theirs = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        [*messages[:1], {**messages[1], "tool_calls": [
            {**call, "function": {**call["function"], "arguments": CALL["arguments"]}}]},
         messages[2]], tools=TOOLS, tokenize=False, add_generation_prompt=False)
    assert ours == theirs
    opening = {"hermes": "<|im_start|>assistant", "mistral": "[TOOL_CALLS]",
               "llama3_json": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[expected]
    turn = ours[ours.index(opening):]
    turn = turn.removeprefix("<|im_start|>assistant").removeprefix(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    turn = turn.split("<|im_end|>")[0].split("</s>")[0].split("<|eot_id|>")[0]
    _, again = tok.parse_tool_calls(turn, TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in again] == [
        (CALL["name"], CALL["arguments"])]


def test_the_choice_without_a_family_and_the_override(tmp_path):
    assert choose_tool_parser(None, None)[0] == "hermes"
    assert choose_tool_parser(GEMMA3, None) == (
        "hermes", "the default (no tool markup in the chat template, no known family)")
    assert parser_for_template({"default": GEMMA3, "tool_use": LLAMA31}) == "llama3_json"
    path = _tokenizer_dir(tmp_path, LLAMA31, "llama", {"eos_token": "<|eot_id|>"},
                          ["<|eot_id|>"])
    tok = Tokenizer.from_pretrained(path, tool_parser="hermes")
    assert tok.tool_parser.name == "hermes" and tok.tool_parser_source == "asked"
    with pytest.raises(ValueError, match=r"unknown tool parser 'llama3'.*did you mean 'llama3_json'"):
        tok.set_tool_parser("llama3")


def test_llama3_json_reads_only_an_answer_that_is_calls():
    p = get_parser("llama3_json")
    # <|python_tag|> first, two calls separated by ';', "arguments" read like "parameters".
    content, calls = p.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                             '{"name": "b", "arguments": {}}')
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"])
                              for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    # Prose that mentions JSON later is content, not a call (the template renders a
    # call as the whole answer).
    text = 'The call would be {"name": "a", "parameters": {}}.'
    assert p.parse(text) == (text, []) and p.parse(text).malformed == 0
    bad = p.parse('{"name": "a", "parameters": {"x": 1}')  # cut: stays text, counted
    assert bad == ('{"name": "a", "parameters": {"x": 1}', []) and bad.malformed == 1
    assert p.parse('{"parameters": {}}').malformed == 1  # no name
    # Text after the calls stays content.
    assert p.parse('{"name": "a", "parameters": {}}\nDone.')[0] == "Done."


def test_gemma_tool_code_takes_keyword_literals_only():
    p = get_parser("gemma_tool_code")
    content, calls = p.parse('Let me look.\n```tool_code\nsearch(q="a b", k=[1, 2], '
                             'opt={"x": None}, on=True)\n```')
    assert content == "Let me look." and json.loads(calls[0]["function"]["arguments"]) == {
        "q": "a b", "k": [1, 2], "opt": {"x": None}, "on": True}
    for body in ('search("a")', "search(q=x)", "search(q=1+os.system('x'))", "a = 1",
                 "search(q={1, 2})"):
        out = p.parse(f"```tool_code\n{body}\n```")
        assert out.calls == [] and out.malformed == 1, body
