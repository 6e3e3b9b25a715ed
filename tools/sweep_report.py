"""Collect every job of a multirun into one table (markdown + csv) and plot.

    python tools/sweep_report.py dir=multirun/train/<date>/<time> [metric=val/acc1] [margin=0.5] [out=<dir>]

Jobs that differ only in their seed form one arm; per arm the report gives mean and standard deviation
over seeds of the metric, active GFLOPs, GFLOPs, parameters and training images/s; each arm's difference
of means against the dense arm with its 95% interval (Welch) and a verdict for the margin; and flags every
run that had not converged (:mod:`moh_vision.apps.sweep_report`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from moh_vision.apps.sweep_report import DEFAULT_EXTRA, DEFAULT_MARGIN, write_sweep_report
from moh_vision.cli import Option, list_of, number, run_tool, text

OPTIONS = (
    Option("dir", required=True, help="a multirun directory (searched recursively for summary.json)"),
    Option("metric", help="metric to report (default: val_ema/acc1 when the runs kept an EMA, else val/acc1; sample/class_acc for diffusion)"),
    Option("extra", list(DEFAULT_EXTRA), type=list_of(text), help="further summary keys to aggregate"),
    Option("margin", DEFAULT_MARGIN, type=number, minimum=0.0,
           help="equivalence margin of the verdict, in the metric's units (points of top-1)"),
    Option("reference", help="the arm the others are compared with (default: the dense arm, ratio 1.0)"),
    Option("out", help="output directory (default: the multirun directory)"),
)


def report(opts) -> int:
    write_sweep_report(opts.dir, opts.metric, opts.extra, opts.out, opts.margin, opts.reference)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(report, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
