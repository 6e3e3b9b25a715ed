#!/usr/bin/env python
"""Samplers side by side on a digits diffusion checkpoint: class accuracy, Frechet distance and time of each.

    python tools/compare_samplers.py ckpt=<run>/checkpoints/last.pt arms=ddpm:250,dpm++:25 per_class=20 \\
        out=docs/bench/epyc-2026-12-02/samplers_digits.json

Every arm samples the same labels from the same noise in one process, one after the other, and is timed and scored
with the digits classifier (sample/class_acc, sample/fd_digits); the first arm is the reference the others are
compared with (differences, tolerances, speed-up against the step ratio). :mod:`moh_vision.apps.sampler_comparison`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from moh_vision.cli import Option, boolean, integer, list_of, number, run_tool, text
from moh_vision.apps.sampler_comparison import compare_samplers

OPTIONS = (
    Option("ckpt", required=True, help="a digits diffusion checkpoint written by train.py"),
    Option("arms", ["ddpm:250", "dpm++:25"], list_of(text), "sampler:steps, the first the reference"),
    Option("per_class", 20, integer, "samples of each class (one batch)", minimum=1),
    Option("seeds", [0], list_of(integer), "one stream per seed and arm (more seeds: the draw-to-draw spread)"),
    Option("cfg_scale", type=number, minimum=1, help="guidance (default: the checkpoint's task.sample.cfg_scale)"),
    Option("ema", True, boolean, "sample the EMA weights"),
    Option("acc_tolerance", 3.0, number, "largest class-accuracy difference (points) that counts as the same"),
    Option("fd_tolerance", 3.0, number, "largest Frechet-distance difference that counts as the same"),
    Option("digits_classifier", help="the proxy-metric classifier (default: <run dir>/digits_classifier.pt)"),
    Option("device", "cpu", help="cpu | cuda"),
    Option("out", help="JSON record to write"),
)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_tool(compare_samplers, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
