"""viz: static HTML trace viewer, self-distillation report, training curves.

The curves and the distillation report (which draws curves) load on first
use, so `import ac2_jax.viz` for trace pages does not import matplotlib.
"""

import importlib

from ac2_jax.viz.trace_html import (
    BASE_CSS,
    HEATMAP_CSS,
    compaction_html,
    episode_html,
    esc,
    kv_table,
    message_html,
    page,
    place_compactions,
    token_texts,
    tool_call_html,
    trace_html,
    trace_section,
    turns_html,
    write_trace_html,
)

_LAZY = {
    "curves_figure": "ac2_jax.viz.curves",
    "load_metrics": "ac2_jax.viz.curves",
    "plot_curves": "ac2_jax.viz.curves",
    "distill_report_html": "ac2_jax.viz.distill_report",
    "heatmap_html": "ac2_jax.viz.distill_report",
    "write_distill_report": "ac2_jax.viz.distill_report",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BASE_CSS",
    "HEATMAP_CSS",
    "compaction_html",
    "curves_figure",
    "distill_report_html",
    "episode_html",
    "esc",
    "heatmap_html",
    "kv_table",
    "load_metrics",
    "message_html",
    "page",
    "place_compactions",
    "plot_curves",
    "token_texts",
    "tool_call_html",
    "trace_html",
    "trace_section",
    "turns_html",
    "write_distill_report",
    "write_trace_html",
]
