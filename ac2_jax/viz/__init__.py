"""viz: static HTML trace viewer, self-distillation report, training curves.

The curves and the distillation report (which draws curves) load on first
use, so `import ac2_jax.viz` for trace pages does not import matplotlib.
"""

import importlib

from ac2_jax.viz.trace_html import HEATMAP_CSS as HEATMAP_CSS
from ac2_jax.viz.trace_html import esc as esc
from ac2_jax.viz.trace_html import kv_table as kv_table
from ac2_jax.viz.trace_html import message_html as message_html
from ac2_jax.viz.trace_html import page as page
from ac2_jax.viz.trace_html import trace_html, write_trace_html

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
    "trace_html",
    "write_trace_html",
    "plot_curves",
    "curves_figure",
    "load_metrics",
    "distill_report_html",
    "write_distill_report",
]
