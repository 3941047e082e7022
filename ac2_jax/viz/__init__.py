"""viz: static HTML trace viewer, self-distillation report, training curves."""

from ac2_jax.viz.curves import curves_figure, load_metrics, plot_curves
from ac2_jax.viz.distill_report import distill_report_html, write_distill_report
from ac2_jax.viz.trace_html import trace_html, write_trace_html

__all__ = [
    "curves_figure",
    "distill_report_html",
    "load_metrics",
    "plot_curves",
    "trace_html",
    "write_distill_report",
    "write_trace_html",
]
