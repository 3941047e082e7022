"""Self-distillation report: where the hint-conditioned teacher and the student
disagree, and which of those positions the judge kept.

A standalone HTML page (inline CSS/JS, images base64-embedded, no server or
CDN): the student's context, the teacher's context with the inserted hint
highlighted (`mark.hint`), the response as a divergence heatmap (each token a
`span.tok` with data-pos / data-div; candidates (top-T) have class `cand`,
judge selections (top-S) class `sel`), radio toggles all / top-T / top-S, the
ranked candidate table, training curves (target metric, retention metric,
loss) and optionally the full trace.
"""

from __future__ import annotations

import base64
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from ac2_jax.viz.curves import plot_curves
from ac2_jax.viz.trace_html import HEATMAP_CSS, esc, kv_table, page, token_texts, trace_section

DEFAULT_CURVES = {"target metric": "target", "retention metric": "retention", "loss": "loss"}


_JS = """
(function(){
  var resp = document.getElementById('response');
  document.querySelectorAll('input[name="view"]').forEach(function(el){
    el.addEventListener('change', function(){ if (el.checked) resp.setAttribute('data-view', el.value); });
  });
})();
"""


def _checked(who: str, response_tokens, divergence, candidates, selected, tokenizer):
    """(token texts, divergences, candidates, selected set), or a ValueError naming `who`
    and what does not line up with the response tokens."""
    tokens = list(response_tokens)
    if tokens and not isinstance(tokens[0], str):
        tokens = token_texts(tokens, tokenizer)
    div = [float(d) for d in divergence]
    if len(div) != len(tokens):
        raise ValueError(f"{who}: {len(div)} divergences for {len(tokens)} response tokens")
    out = []
    for name, positions in (("candidate", candidates), ("selected", selected)):
        pos = [int(p) for p in positions]
        bad = [p for p in pos if not 0 <= p < len(tokens)]
        if bad:
            raise ValueError(
                f"{who}: {name} positions {bad} are outside the {len(tokens)} response tokens"
            )
        out.append(pos)
    return tokens, div, out[0], set(out[1])


def _teacher_context(prompt: str, hint: str, teacher_prompt: str | None) -> str:
    mark = f'<mark class="hint">{esc(hint)}</mark>'
    if teacher_prompt is None:  # the hint goes right before the response
        return esc(prompt) + mark
    if hint not in teacher_prompt:
        raise ValueError("distill_report_html: the hint does not occur in teacher_prompt")
    return mark.join(esc(part) for part in teacher_prompt.split(hint))


def _response(tokens: list[str], div: list[float], cands: set[int], sel: set[int]) -> str:
    finite = [d for d in div if math.isfinite(d)]
    top = max(finite) if finite and max(finite) > 0 else 1.0
    spans = []
    for i, (text, d) in enumerate(zip(tokens, div, strict=True)):
        h = min(max(d / top, 0.0), 1.0) if math.isfinite(d) else 0.0
        cls = "tok" + (" cand" if i in cands else "") + (" sel" if i in sel else "")
        spans.append(
            f'<span class="{cls}" data-pos="{i}" data-div="{d:.6g}" style="--h:{h:.3f}" '
            f'title="pos {i} · divergence {d:.4g}">{esc(text)}</span>'
        )
    return "".join(spans)


def _candidate_table(tokens, div, cands: list[int], sel: set[int]) -> str:
    rows = "".join(
        f'<tr class="{"sel" if p in sel else "cand"}"><td>{rank}</td><td>{p}</td>'
        f"<td>{esc(repr(tokens[p]))}</td><td>{div[p]:.4g}</td>"
        f"<td>{'yes' if p in sel else ''}</td></tr>"
        for rank, p in enumerate(sorted(cands, key=lambda q: (-div[q], q)))
    )
    return (
        '<table class="cands"><tr><th>rank</th><th>pos</th><th>token</th><th>divergence</th>'
        f"<th>judge selected</th></tr>{rows}</table>"
    )


def heatmap_html(
    response_tokens: Sequence,
    divergence: Sequence[float],
    candidates: Sequence[int] = (),
    selected: Sequence[int] = (),
    tokenizer=None,
) -> str:
    """One response as a divergence heatmap, a fragment for any page (style: HEATMAP_CSS):
    the tokens shaded by divergence, candidates (top-T) dashed, judge selections (top-S)
    outlined in green, then the ranked candidate table. Arguments as in
    `distill_report_html`; several fit on one page (no ids)."""
    tokens, div, cands, sel = _checked(
        "heatmap_html", response_tokens, divergence, candidates, selected, tokenizer
    )
    return (
        f'<div class="tokens heat">{_response(tokens, div, set(cands), sel)}</div>'
        + _candidate_table(tokens, div, cands, sel)
    )


def distill_report_html(
    *,
    prompt: str,
    hint: str,
    response_tokens: Sequence,
    divergence: Sequence[float],
    candidates: Sequence[int] = (),
    selected: Sequence[int] = (),
    teacher_prompt: str | None = None,
    tokenizer=None,
    metrics=None,
    curves: dict[str, str] | None = None,
    trace=None,
    info: dict[str, Any] | None = None,
    title: str = "Self-distillation report",
) -> str:
    """The report page as a string.

    prompt: the student's context (trace text). hint: the inserted hint;
    teacher_prompt: the teacher's context containing it (default: prompt +
    hint). response_tokens: [n] token strings (or ids with `tokenizer`);
    divergence: [n] per-position teacher-student divergence; candidates /
    selected: response positions (top-T, judge top-S). metrics: anything
    `plot_curves` reads; curves: {label: metric key}, default DEFAULT_CURVES.
    trace: optional Trace appended as in `trace_html`; info: a key/value table.
    """
    if not hint:
        raise ValueError("distill_report_html: hint is empty")
    tokens, div, cands, sel = _checked(
        "distill_report_html", response_tokens, divergence, candidates, selected, tokenizer
    )
    n_t, n_s = len(cands), len(sel)
    body = [
        f"<h1>{esc(title)}</h1>",
        kv_table(info) if info else "",
        "<h2>Student context (trace / prompt)</h2>",
        f'<pre class="ctx" id="student">{esc(prompt)}</pre>',
        "<h2>Teacher context (hint inserted)</h2>",
        f'<pre class="ctx" id="teacher">{_teacher_context(prompt, hint, teacher_prompt)}</pre>',
        "<h2>Response: teacher-student divergence</h2>",
        '<p class="toggles">'
        '<label><input type="radio" name="view" id="view-all" value="all" checked>'
        " all tokens</label>"
        '<label><input type="radio" name="view" id="view-topT" value="topT">'
        f" top-T candidates ({n_t})</label>"
        '<label><input type="radio" name="view" id="view-topS" value="topS">'
        f" judge top-S ({n_s})</label></p>",
        '<div class="tokens heat" id="response" data-view="all">'
        f"{_response(tokens, div, set(cands), sel)}</div>",
        "<h2>Candidates by divergence</h2>",
        _candidate_table(tokens, div, cands, sel),
    ]
    if metrics is not None:
        curves = DEFAULT_CURVES if curves is None else curves
        png = plot_curves(metrics, keys=list(curves.values()), labels=list(curves.keys()))
        body += [
            "<h2>Training curves</h2>",
            f'<img class="curves" alt="training curves: {esc(", ".join(curves))}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">',
        ]
    if trace is not None:
        body += ["<h2>Full trace</h2>", trace_section(trace, tokenizer)]
    return page(title, "".join(body), css=HEATMAP_CSS, script=_JS)


def write_distill_report(path: str | pathlib.Path, **kwargs) -> pathlib.Path:
    """Writes `distill_report_html(**kwargs)` to `path`; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(distill_report_html(**kwargs), encoding="utf-8")
    return path
