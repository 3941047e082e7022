"""Static HTML viewer for one trace: every episode, tokens coloured by loss mask.

The page is self-contained (inline CSS, no scripts, no CDN) so it opens from
disk. Tokens the agent generated (loss_mask 1) are shown as `.tok.agent`,
context tokens as `.tok.ctx`; each span carries data-i (index in the episode)
and data-id (token id). With a tokenizer (anything with `.decode(list[int])`)
tokens show as text, else as ids. All text is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import pathlib
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
"""


def esc(x: Any) -> str:
    """HTML-escape any value (quotes too, so it is safe inside attributes)."""
    return html.escape(x if isinstance(x, str) else str(x), quote=True)


def kv_table(d: dict[str, Any]) -> str:
    """A two-column table of a dict, values JSON-encoded unless strings."""
    rows = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(v if isinstance(v, str) else json.dumps(v, default=str))}</td></tr>"
        for k, v in d.items())
    return f'<table class="kv">{rows}</table>'


def token_texts(token_ids, tokenizer=None) -> list[str]:
    """Per-token display strings: tokenizer.decode([id]) or the id."""
    if tokenizer is None:
        return [str(int(t)) for t in token_ids]
    return [tokenizer.decode([int(t)]) for t in token_ids]


def episode_html(episode, index: int, tokenizer=None, max_tokens: int | None = None) -> str:
    """One episode: agent label, counts, and its token spans."""
    ids = list(episode.token_ids)
    shown = ids if max_tokens is None else ids[:max_tokens]
    texts = token_texts(shown, tokenizer)
    spans = []
    for i, (tid, text) in enumerate(zip(shown, texts)):
        agent = i < len(episode.loss_mask) and episode.loss_mask[i] > 0
        cls = "agent" if agent else "ctx"
        title = f"#{i} id {tid}"
        if agent and i < len(episode.sampler_logprobs):
            title += f" logprob {episode.sampler_logprobs[i]:.4f}"
        spans.append(f'<span class="tok {cls}" data-i="{i}" data-id="{int(tid)}" '
                     f'title="{esc(title)}">{esc(text)}</span>')
    more = (f'<p class="cut">… {len(ids) - len(shown)} more tokens not shown</p>'
            if len(shown) < len(ids) else "")
    kind = "text" if tokenizer is not None else "ids"
    return (f'<section class="episode" data-agent="{esc(episode.agent)}" data-index="{index}">'
            f'<h3>Episode {index}: <span class="agent-label">{esc(episode.agent)}</span></h3>'
            f'<p><span class="badge">{len(ids)} tokens</span>'
            f'<span class="badge">{episode.num_agent_tokens} agent tokens</span>'
            f'<span class="badge">{len(episode.completions)} requests</span></p>'
            f'<div class="tokens {kind}">{"".join(spans)}</div>{more}</section>')


def trace_section(trace: Trace | dict, tokenizer=None, max_tokens: int | None = None) -> str:
    """The trace as an HTML fragment (header, outcome, metrics, episodes)."""
    if isinstance(trace, dict):
        trace = Trace.from_dict(trace)
    if not isinstance(trace, Trace):
        raise TypeError(f"trace_html: expected a Trace or its dict, got {type(trace).__name__}")
    reward = "none" if trace.reward is None else f"{trace.reward:g}"
    hints = "".join(f'<li class="hint">{esc(h)}</li>' for h in trace.hints)
    parts = [
        f'<div class="trace" data-task="{esc(trace.task_id)}">',
        f"<h2>Trace {esc(trace.key)}</h2>",
        f'<p><span class="badge status status-{esc(trace.status)}">status: {esc(trace.status)}</span>'
        f'<span class="badge reward">reward: {esc(reward)}</span>'
        f'<span class="badge">group: {esc(trace.group_id)}</span>'
        f'<span class="badge">{len(trace.episodes)} episodes</span></p>',
        f"<h3>Hints</h3><ul>{hints}</ul>" if hints else "",
        f'<h3>Metrics</h3><div class="metrics">{kv_table(trace.metrics)}</div>' if trace.metrics else "",
        '<p class="legend"><span class="tok agent">agent token (trained)</span>'
        '<span class="tok ctx">context token</span></p>',
    ]
    parts += [episode_html(e, i, tokenizer, max_tokens) for i, e in enumerate(trace.episodes)]
    parts.append("</div>")
    return "".join(parts)


def page(title: str, body: str, css: str = "", script: str = "") -> str:
    """A complete standalone HTML document."""
    js = f"<script>{script}</script>" if script else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{BASE_CSS}{css}</style></head><body>{body}{js}</body></html>")


def trace_html(trace: Trace | dict, tokenizer=None, *, title: str | None = None,
               max_tokens: int | None = None) -> str:
    """A standalone HTML page for one trace (see the module docstring)."""
    body = trace_section(trace, tokenizer, max_tokens)
    if title is None:
        t = trace if isinstance(trace, Trace) else Trace.from_dict(trace)
        title = f"Trace {t.key}"
    return page(title, f"<h1>{esc(title)}</h1>{body}")


def write_trace_html(path: str | pathlib.Path, trace: Trace | dict, tokenizer=None,
                     **kwargs) -> pathlib.Path:
    """Writes `trace_html(...)` to `path` (parents created); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace_html(trace, tokenizer, **kwargs), encoding="utf-8")
    return path
