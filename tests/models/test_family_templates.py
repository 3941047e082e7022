"""Qwen2.5 and Mistral chat templates and tool calls: our rendering equals
transformers' `apply_chat_template` on a tokenizer whose tokenizer_config.json
carries the family's template, and each family's parser reads back the calls
its template renders.

The templates are data written for this test (nothing is downloaded): QWEN25
follows the template Qwen2.5-Instruct tokenizers ship (Hermes `<tool_call>`
JSON; the default system prompt), MISTRAL_V3 the tool-use template of
Mistral-7B-Instruct-v0.3 (`[AVAILABLE_TOOLS]`, `[TOOL_CALLS] [...]` with
9-character ids, `[TOOL_RESULTS]`). Both were written from the published
templates' structure, not copied byte for byte from the shipped files.
"""

import json

import pytest
from tokenizers import AddedToken, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ac2_jax.text.tokenizer import Tokenizer
from ac2_jax.text.tool_parsers import get_parser

transformers = pytest.importorskip("transformers")

QWEN25 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL_V3 = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or \
(message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must \
alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of \
an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

FAMILIES = {  # name: (template, special tokens, added special tokens, parser)
    "qwen2.5": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
                "hermes"),
    "mistral": (MISTRAL_V3, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "mistral"),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    template, special, added, parser = FAMILIES[request.param]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["the weather in Paris is sunny", "call get_weather"] * 20,
                           trainer=trainers.BpeTrainer(
                               vocab_size=300, show_progress=False, special_tokens=added,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    Tokenizer(hf, chat_template=template, special_tokens=special).save_pretrained(str(path))
    return (request.param, Tokenizer.from_pretrained(str(path), tool_parser=parser),
            transformers.AutoTokenizer.from_pretrained(str(path)))


def conversation(name, calls):
    """A tool round trip in OpenAI form, with the ids the family's parser gives."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris and Lyon?"},
                {"role": "assistant", "content": None, "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 21}'}
                 for c in calls]
    return messages


def as_template_calls(calls):  # arguments as objects, as templates render them
    return [{**c, "function": {**c["function"],
                               "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls]


def test_renders_as_transformers_apply_chat_template(family):
    name, ours, theirs = family
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Paris?"}]
    for tools in (None, TOOLS):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, tools, gen) == theirs.apply_chat_template(
                msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
    assert ours.apply_chat_template(msgs, TOOLS, tokenize=True) == theirs.apply_chat_template(
        msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_rendered_calls_parse_back_and_render_again(family):
    """The family's parser reads the calls out of the assistant turn its template renders;
    those calls (with the parser's ids) render again, byte for byte as transformers does."""
    name, ours, theirs = family
    model_text = {  # what the model emits for two calls, in the family's format
        "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                   '{"city": "Lyon", "days": 2}}\n</tool_call>',
        "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}]',
    }[name]
    content, calls = ours.parse_tool_calls(model_text, TOOLS)
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"}, {"city": "Lyon", "days": 2}]
    messages = conversation(name, as_template_calls(calls))
    rendered = ours.apply_chat_template(messages, TOOLS, add_generation_prompt=False)
    assert rendered == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                  add_generation_prompt=False)
    # The rendered assistant turn parses back to the same calls.
    start = rendered.index("<|im_start|>assistant" if name == "qwen2.5" else "[TOOL_CALLS]")
    turn = rendered[start:].split("<|im_end|>")[0].split("</s>")[0]
    _, again = ours.parse_tool_calls(turn.removeprefix("<|im_start|>assistant"))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in again] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_mistral_parser_format_and_malformed_text():
    p = get_parser("mistral")
    text = 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}] done'
    parsed = p.parse(text)
    assert parsed.content == "Sure.  done" and parsed.malformed == 0
    (call,) = parsed.calls
    assert call["function"] == {"name": "f", "arguments": '{"x": [1, 2]}'}
    assert len(call["id"]) == 9 and call["id"].isalnum()
    forced = p.named_opening("f") + '{"x": 1}}]'
    assert p.parse(forced).calls[0]["function"]["name"] == "f"
    for bad in ('[TOOL_CALLS] [{"name": 3}]', "[TOOL_CALLS] {not json", "[TOOL_CALLS] []",
                "[TOOL_CALLS]" * 3000, '[TOOL_CALLS] [{"arguments": {}}]'):
        parsed = p.parse(bad)
        assert parsed == (bad.strip(), []) and parsed.malformed == 1
        assert parsed.steps <= 4 * len(bad) + 64  # linear work
    capped = type(p)(max_chars=20).parse(text)  # the array runs past the cap: text
    assert capped.calls == [] and capped.unparsed_chars == len(text) - 20


def test_openai_form_arguments_reach_the_template_as_objects(family):
    """Issue 68, finding 4: OpenAI messages carry a call's arguments as a JSON string; the
    Qwen2.5 template renders `tool_call.arguments | tojson`, so a string was encoded twice
    (`"arguments": "{\\"city\\": ...}"`) in SFT demos and prompts. They reach the template
    as the object (as vLLM passes them), so the prompt equals transformers' rendering of
    the object, the form the model emits."""
    name, ours, theirs = family
    calls = [{"id": "abcDEF123", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]
    messages = conversation(name, calls)
    rendered = ours.apply_chat_template(messages, TOOLS, add_generation_prompt=False)
    assert rendered == theirs.apply_chat_template(
        conversation(name, as_template_calls(calls)), tools=TOOLS, tokenize=False,
        add_generation_prompt=False)
    assert '"arguments": {"city": "Paris", "days": 2}' in rendered, rendered
    assert messages[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # untouched
    # Arguments that are not a JSON object stay as given (the template shows what came).
    bad = [{**calls[0], "function": {"name": "get_weather", "arguments": "not json"}}]
    assert '"not json"' in ours.apply_chat_template(conversation(name, bad), TOOLS,
                                                    add_generation_prompt=False)
