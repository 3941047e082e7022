"""Static HTML viewer for one trace: every episode, tokens coloured by loss mask.

The page is self-contained (inline CSS, no scripts, no CDN) so it opens from
disk. It reads as the attempt happened: the episodes in recording order, each
with its agent label (`main`, `compactor`, `subagent:<name>`); inside each, the
requests that built it (`.turn`): the messages the request added (`.msg`,
tool results as `.tool-result`) and the agent's output, with the tool calls it
made as `.tool-call`; then its tokens. Tokens the agent generated
(loss_mask 1) are `.tok.agent`, context tokens `.tok.ctx`; each span carries
data-i (index in the episode) and data-id (token id). With a tokenizer
(anything with `.decode(list[int])`) tokens and outputs show as text, else as
ids; outputs are split into text and tool calls by `tool_parser` (default: the
hermes parser, `ac2_jax.text.parse_tool_calls`).

Where compaction cut the main agent's history, a `.compaction` marker with
the memo (and `memo_ok` when the env judged it) sits after the compactor's
episode that wrote it, before the main agent's restart. Rule: the n-th
"compaction" event of `Trace.events` is the n-th compactor request (each
compaction is one compactor request, recorded in order); events without a
compactor request to sit after, and other events (e.g. compaction_error), are
listed under "Events not placed between episodes" (counted).
All text is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import pathlib
from collections.abc import Callable
from typing import Any

from ac2_jax.trace import Trace

BASE_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:80em}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em} h3{font-size:1em}
table.kv{border-collapse:collapse;margin:.5em 0} table.kv td{border:1px solid #ccc;padding:2px 8px;
font-family:monospace;font-size:.9em}
.tokens{font-family:ui-monospace,monospace;font-size:.9em;white-space:pre-wrap;word-break:break-all;
line-height:1.6;border:1px solid #ddd;padding:.6em;border-radius:4px;background:#fff}
.tok{border-radius:2px}
.tok.ctx{color:#777}
.tok.agent{background:#d8ecff;color:#003a70}
.tokens.ids .tok{margin-right:.35em}
.legend span{padding:0 .4em;margin-right:.6em;border-radius:2px}
.badge{display:inline-block;padding:0 .5em;border-radius:3px;background:#eee;margin-right:.4em}
.status-finished{background:#d4f5d4} .status-agent_error,.status-timed_out{background:#f8d0d0}
.status-infra_error{background:#e0e0e0}
.turn{border-left:3px solid #ccd;margin:.4em 0;padding:.1em .6em}
.msg{margin:.25em 0;font-size:.9em} .msg .role{font-weight:bold;margin-right:.4em}
.msg pre{white-space:pre-wrap;word-break:break-word;margin:.1em 0;
font-family:ui-monospace,monospace}
.msg.output{background:#eef6ff;border-radius:3px;padding:.2em .4em}
.tool-call{background:#fff4d6;border:1px solid #e8c66a;border-radius:3px;padding:.1em .4em;
margin:.2em 0;font-family:ui-monospace,monospace;font-size:.9em}
.tool-result{background:#eaf7ea;border-radius:3px;padding:.1em .4em}
.compaction{border:2px dashed #c0392b;background:#fdf0ee;border-radius:6px;padding:.5em .8em;
margin:1em 0} .compaction .memo{white-space:pre-wrap;font-family:ui-monospace,monospace}
.memo-ok{background:#d4f5d4} .memo-lost{background:#f8d0d0}
"""


HEATMAP_CSS = """
pre.ctx{white-space:pre-wrap;word-break:break-word;border:1px solid #ddd;padding:.6em;
border-radius:4px;background:#fafafa;font-size:.9em}
mark.hint{background:#ffe066;outline:1px solid #e0a800;padding:0 2px}
.heat .tok{background:rgba(214,39,40,calc(var(--h,0)*0.85))}
.heat .tok.cand{outline:1px dashed #b22}
.heat .tok.sel{outline:2px solid #1a7f37;font-weight:bold}
#response[data-view="topT"] .tok:not(.cand),#response[data-view="topS"] .tok:not(.sel){
background:transparent;opacity:.35;outline:none}
.toggles label{margin-right:1.2em}
table.cands{border-collapse:collapse} table.cands td,table.cands th{border:1px solid #ccc;
padding:2px 8px;font-family:monospace;font-size:.9em}
tr.sel td{background:#dff5e3}
img.curves{max-width:100%;border:1px solid #ddd}
"""
"""The CSS of divergence heatmaps (`distill_report`: the report page, `heatmap_html`
fragments on any `page`)."""


def esc(x: Any) -> str:
    """HTML-escape any value (quotes too, so it is safe inside attributes)."""
    return html.escape(x if isinstance(x, str) else str(x), quote=True)


def kv_table(d: dict[str, Any]) -> str:
    """A two-column table of a dict, values JSON-encoded unless strings."""
    rows = "".join(
        f"<tr><td>{esc(k)}</td>"
        f"<td>{esc(v if isinstance(v, str) else json.dumps(v, default=str))}</td></tr>"
        for k, v in d.items()
    )
    return f'<table class="kv">{rows}</table>'


def token_texts(token_ids, tokenizer=None) -> list[str]:
    """Per-token display strings: tokenizer.decode([id]) or the id."""
    if tokenizer is None:
        return [str(int(t)) for t in token_ids]
    return [tokenizer.decode([int(t)]) for t in token_ids]


def _output_text(ids, tokenizer) -> str:
    try:
        return tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)
    except TypeError:  # a decode without the keyword
        return tokenizer.decode([int(t) for t in ids])


def _hermes(text: str):
    from ac2_jax.text.tool_parsers import parse_tool_calls  # only with a tokenizer

    return parse_tool_calls(text)


def tool_call_html(call: dict[str, Any]) -> str:
    """One OpenAI tool call as `.tool-call` (name, arguments, id)."""
    fn = call.get("function") or {}
    return (
        f'<div class="tool-call" data-name="{esc(fn.get("name", ""))}" '
        f'data-id="{esc(call.get("id", ""))}">&#128295; <b class="tool-name">'
        f'{esc(fn.get("name", "?"))}</b>(<span class="tool-args">'
        f"{esc(fn.get('arguments', ''))}</span>)</div>"
    )


def message_html(msg: dict[str, Any], extra_class: str = "") -> str:
    """One chat message: role, content, tool calls; a tool message is a `.tool-result`."""
    role = str(msg.get("role", "?"))
    cls = f"msg role-{esc(role)}" + (" tool-result" if role == "tool" else "") + extra_class
    label = role if role != "tool" else f"tool result ({msg.get('tool_call_id') or '?'})"
    content = msg.get("content")
    if isinstance(content, list):  # content parts: show their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    body = f"<pre>{esc(content)}</pre>" if content else ""
    body += "".join(tool_call_html(c) for c in msg.get("tool_calls") or [])
    return f'<div class="{cls}"><span class="role">{esc(label)}</span>{body}</div>'


def turns_html(episode, tokenizer=None, tool_parser: Callable | None = None) -> str:
    """The requests that built an episode, in order: for each, the messages it added
    (the echo of the previous output left out: it is shown as that output) and the
    agent's output (text and tool calls with a tokenizer, else its token count)."""
    try:
        lists = episode.messages_at()
    except ValueError as e:  # a stored delta that does not rebuild: say so, show the rest
        lists, note = [None] * len(episode.completions), f"messages not shown: {e}"
    else:
        note = ""
    parse = tool_parser or _hermes
    parts, prev = [], None
    for k, (c, full) in enumerate(zip(episode.completions, lists, strict=True)):
        added = []
        if full is not None:
            start = len(prev) if prev is not None and full[: len(prev)] == prev else 0
            added = full[start:]
            if start and added and added[0].get("role") == "assistant":
                added = added[1:]
        prev = full
        if tokenizer is not None:
            content, calls = parse(_output_text(c.output_ids, tokenizer))[:2]
            out = message_html(
                {"role": "assistant", "content": content, "tool_calls": calls}, " output"
            )
        else:
            out = (
                f'<div class="msg role-assistant output"><span class="role">assistant</span>'
                f"{len(c.output_ids)} tokens (ids below)</div>"
            )
        parts.append(
            f'<div class="turn" data-k="{k}"><div class="added">'
            f"{''.join(message_html(m) for m in added)}</div>{out}"
            f'<span class="badge">finish: {esc(c.finish_reason)}</span>'
            f'<span class="badge">policy v{esc(c.policy_version)}</span></div>'
        )
    return (f'<p class="cut">{esc(note)}</p>' if note else "") + "".join(parts)


def episode_html(
    episode,
    index: int,
    tokenizer=None,
    max_tokens: int | None = None,
    tool_parser: Callable | None = None,
) -> str:
    """One episode: agent label, counts, its requests (messages, tool calls) and tokens."""
    ids = list(episode.token_ids)
    shown = ids if max_tokens is None else ids[:max_tokens]
    texts = token_texts(shown, tokenizer)
    spans = []
    for i, (tid, text) in enumerate(zip(shown, texts, strict=True)):
        agent = i < len(episode.loss_mask) and episode.loss_mask[i] > 0
        cls = "agent" if agent else "ctx"
        title = f"#{i} id {tid}"
        if agent and i < len(episode.sampler_logprobs):
            title += f" logprob {episode.sampler_logprobs[i]:.4f}"
        spans.append(
            f'<span class="tok {cls}" data-i="{i}" data-id="{int(tid)}" '
            f'title="{esc(title)}">{esc(text)}</span>'
        )
    more = (
        f'<p class="cut">… {len(ids) - len(shown)} more tokens not shown</p>'
        if len(shown) < len(ids)
        else ""
    )
    kind = "text" if tokenizer is not None else "ids"
    turns = turns_html(episode, tokenizer, tool_parser) if episode.completions else ""
    return (
        f'<section class="episode" data-agent="{esc(episode.agent)}" data-index="{index}">'
        f'<h3>Episode {index}: <span class="agent-label">{esc(episode.agent)}</span></h3>'
        f'<p><span class="badge">{len(ids)} tokens</span>'
        f'<span class="badge">{episode.num_agent_tokens} agent tokens</span>'
        f'<span class="badge">{len(episode.completions)} requests</span></p>'
        f'<div class="turns">{turns}</div>'
        f'<div class="tokens {kind}">{"".join(spans)}</div>{more}</section>'
    )


def compaction_html(event: dict[str, Any], n: int) -> str:
    """The marker where compaction cut the main agent's history: the memo that replaced it."""
    ok = event.get("memo_ok")
    verdict = (
        ""
        if ok is None
        else f'<span class="badge {"memo-ok" if ok else "memo-lost"}">memo_ok: '
        f"{'yes' if ok else 'no'}</span>"
    )
    return (
        f'<div class="compaction" data-n="{n}" data-memo-ok="{esc(ok)}">'
        f"<b>&#9986; Compaction {n}</b>: the main agent's history was cut here; it "
        f'restarts from this memo. {verdict}<div class="memo">{esc(event.get("memo", ""))}'
        f"</div></div>"
    )


def place_compactions(trace: Trace) -> tuple[dict[int, list[tuple[int, dict]]], list[dict]]:
    """({episode index: [(n, event)] to show after it}, unplaced events): the n-th
    compaction event goes after the episode of the n-th compactor request (module
    docstring); compaction events past the compactor's requests, and events of
    other kinds, are returned as unplaced."""
    requests = [
        i for i, e in enumerate(trace.episodes) if e.agent == "compactor" for _ in e.completions
    ]
    after: dict[int, list[tuple[int, dict]]] = {}
    unplaced, n = [], 0
    for ev in trace.events:
        if ev.get("kind") == "compaction" and n < len(requests):
            after.setdefault(requests[n], []).append((n + 1, ev))
            n += 1
        else:
            unplaced.append(ev)
    return after, unplaced


def trace_section(
    trace: Trace | dict,
    tokenizer=None,
    max_tokens: int | None = None,
    tool_parser: Callable | None = None,
) -> str:
    """The trace as an HTML fragment (header, outcome, metrics, episodes, compactions)."""
    if isinstance(trace, dict):
        trace = Trace.from_dict(trace)
    if not isinstance(trace, Trace):
        raise TypeError(f"trace_html: expected a Trace or its dict, got {type(trace).__name__}")
    reward = "none" if trace.reward is None else f"{trace.reward:g}"
    hints = "".join(f'<li class="hint">{esc(h)}</li>' for h in trace.hints)
    after, unplaced = place_compactions(trace)
    compactions = sum(len(v) for v in after.values())
    parts = [
        f'<div class="trace" data-task="{esc(trace.task_id)}">',
        f"<h2>Trace {esc(trace.key)}</h2>",
        f'<p><span class="badge status status-{esc(trace.status)}">'
        f"status: {esc(trace.status)}</span>"
        f'<span class="badge reward">reward: {esc(reward)}</span>'
        f'<span class="badge">group: {esc(trace.group_id)}</span>'
        f'<span class="badge">{len(trace.episodes)} episodes</span>'
        f'<span class="badge">{compactions} compactions</span></p>',
        f'<p class="agents">{" &#8594; ".join(esc(e.agent) for e in trace.episodes)}</p>',
        f"<h3>Hints</h3><ul>{hints}</ul>" if hints else "",
        f'<h3>Metrics</h3><div class="metrics">{kv_table(trace.metrics)}</div>'
        if trace.metrics
        else "",
        '<p class="legend"><span class="tok agent">agent token (trained)</span>'
        '<span class="tok ctx">context token</span></p>',
    ]
    for i, e in enumerate(trace.episodes):
        parts.append(episode_html(e, i, tokenizer, max_tokens, tool_parser))
        parts += [compaction_html(ev, n) for n, ev in after.get(i, [])]
    if unplaced:
        items = "".join(f'<li class="event">{kv_table(ev)}</li>' for ev in unplaced)
        parts.append(
            f"<h3>Events not placed between episodes ({len(unplaced)})</h3>"
            f'<ul class="unplaced">{items}</ul>'
        )
    parts.append("</div>")
    return "".join(parts)


def page(title: str, body: str, css: str = "", script: str = "") -> str:
    """A complete standalone HTML document."""
    js = f"<script>{script}</script>" if script else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{BASE_CSS}{css}</style></head><body>{body}{js}</body></html>"
    )


def trace_html(
    trace: Trace | dict,
    tokenizer=None,
    *,
    title: str | None = None,
    max_tokens: int | None = None,
    tool_parser: Callable | None = None,
) -> str:
    """A standalone HTML page for one trace (see the module docstring). tool_parser:
    text -> (content, tool calls), for outputs decoded with `tokenizer`."""
    body = trace_section(trace, tokenizer, max_tokens, tool_parser)
    if title is None:
        t = trace if isinstance(trace, Trace) else Trace.from_dict(trace)
        title = f"Trace {t.key}"
    return page(title, f"<h1>{esc(title)}</h1>{body}")


def write_trace_html(
    path: str | pathlib.Path, trace: Trace | dict, tokenizer=None, **kwargs
) -> pathlib.Path:
    """Writes `trace_html(...)` to `path` (parents created); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace_html(trace, tokenizer, **kwargs), encoding="utf-8")
    return path
