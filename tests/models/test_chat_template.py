"""Chat templates: the transformers Jinja environment, template choice, message cleaning."""

import jinja2
import pytest

from ac2_jax.text.chat_template import (
    clean_messages,
    compile_chat_template,
    render_chat,
    select_template,
)
from ac2_jax.text.tiny_tokenizer import TINY_CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "add", "description": "<a> & 'b'",
                                           "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "system", "content": "Be brief <b>&</b>."},
            {"role": "user", "content": "Hi é 🙂", "name": None},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "add", "arguments": {"a": 1, "b": "x"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"}]

# Features transformers' environment has: loopcontrols, tojson options, trim/lstrip blocks.
FEATURES = """\
{%- for m in messages %}
  {%- if loop.index > 3 %}{% break %}{% endif %}
  {%- if m.role == 'user' %}{% continue %}{% endif %}
  {{ m.role }}={{ m | tojson(indent=1, sort_keys=True) }}|
{%- endfor %}
{{ tools | tojson(separators=(',', ':')) }}{{ bos_token }}
"""


@pytest.mark.parametrize("template", [TINY_CHAT_TEMPLATE, FEATURES])
@pytest.mark.parametrize("gen", [True, False])
def test_renders_as_transformers_does(template, gen):
    from transformers.utils.chat_template_utils import render_jinja_template
    ours = render_chat(compile_chat_template(template), MESSAGES, TOOLS, gen, bos_token="<s>")
    theirs = render_jinja_template([clean_messages(MESSAGES)], tools=TOOLS,
                                   chat_template=template, add_generation_prompt=gen,
                                   bos_token="<s>")[0][0]
    assert ours == theirs


def test_tojson_does_not_html_escape_and_sandbox_holds():
    t = compile_chat_template("{{ x | tojson }}")
    assert t.render(x={"s": "<a href='b'>&</a>", "u": "é"}) == \
        '{"s": "<a href=\'b\'>&</a>", "u": "é"}'
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ messages.append(1) }}").render(messages=[])
    with pytest.raises(jinja2.TemplateError, match="nope"):
        compile_chat_template("{{ raise_exception('nope') }}").render()
    assert compile_chat_template("{{ strftime_now('%Y') }}").render().isdigit()


def test_select_template():
    named = {"default": "d", "tool_use": "t"}
    assert select_template(named, has_tools=True) == "t"
    assert select_template(named, has_tools=False) == "d"
    assert select_template({"default": "d"}, has_tools=True) == "d"
    assert select_template("plain", has_tools=True) == "plain"
    with pytest.raises(ValueError, match=r"no 'default' entry \(names: \['rag'\]\)"):
        select_template({"rag": "r"}, has_tools=False)
    for missing in (None, ""):
        with pytest.raises(ValueError, match="has no chat template .*instruct release"):
            select_template(missing, has_tools=False)


def test_clean_messages_drops_none_and_refuses_bad_input():
    cleaned = clean_messages(MESSAGES)
    assert cleaned[1] == {"role": "user", "content": "Hi é 🙂"}
    assert "content" not in cleaned[2] and MESSAGES[1]["name"] is None  # input untouched
    with pytest.raises(ValueError, match="empty"):
        clean_messages([])
    with pytest.raises(TypeError, match="dicts, got str"):
        clean_messages(["hi"])
