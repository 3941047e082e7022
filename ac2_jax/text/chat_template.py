"""Chat templates rendered the way `transformers` renders them, without torch.

Sandboxed Jinja2 with trim_blocks and lstrip_blocks, transformers' `tojson`
(no HTML escaping), `raise_exception` and `strftime_now`; special tokens are
passed in as template variables by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: no HTML escaping, json.dumps options exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(template: str) -> jinja2.Template:
    """Compiles a chat template in the environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def select_template(chat_template: str | dict[str, str] | None, has_tools: bool) -> str:
    """The template source to use: named templates are chosen as transformers does
    ("tool_use" when tools are given and it exists, else "default")."""
    t = chat_template
    if isinstance(t, dict):
        if has_tools and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        raise ValueError(f"chat_template has no 'default' entry (names: {sorted(t)})")
    if not t:
        raise ValueError(
            "this tokenizer has no chat template (tokenizer_config.json's 'chat_template' "
            "or chat_template.jinja in its directory); copy the one of the model's instruct "
            "release there, or pass chat_template= to Tokenizer"
        )
    return t


def _call_as_object(call: Any) -> Any:
    """A tool call whose `function.arguments` is a JSON string holding an object, with
    the object in its place (a copy); any other call as it is."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(args := fn.get("arguments"), str):
        return call
    try:
        obj = json.loads(args)
    except ValueError:
        return call
    if not isinstance(obj, dict):
        return call
    return {**call, "function": {**fn, "arguments": obj}}


def clean_messages(messages: Sequence[dict]) -> list[dict[str, Any]]:
    """Copies of `messages` ready for a chat template: without the keys whose value is
    None (as transformers does), and with each tool call's `function.arguments` given as
    a JSON string (the OpenAI form) turned into the object it holds, as vLLM does:
    published templates render `tool_call.arguments | tojson` (Qwen2.5, Llama 3.x,
    Mistral), which would encode a string twice. Arguments that are not a JSON object
    stay as given. The input is not changed."""
    if not messages:
        raise ValueError("apply_chat_template: messages is empty")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_call_as_object(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def render_chat(
    template: jinja2.Template,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool = True,
    **variables,
) -> str:
    """Renders cleaned `messages` (and `tools`) with `variables` (special tokens, kwargs)."""
    return template.render(
        messages=clean_messages(messages),
        tools=list(tools) if tools else None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
