"""Time MoH execution paths against dense multi-head attention.

    python tools/bench_attention.py                        # dim 768, 12 heads, 196/1024/4096 tokens
    python tools/bench_attention.py quick=true             # a few seconds, for CI
    python tools/bench_attention.py threads=1 clock=cpu    # robust on a busy shared machine
    python tools/bench_attention.py device=cuda dtype=bfloat16 out=bench.md
    python tools/bench_attention.py threads=1 clock=cpu out=b768.md fit=moh_vision/attention/auto_cpu.json
    python tools/bench_attention.py fit_from=b768.json,b384.json fit=auto_cpu.json   # fit without measuring
    python tools/bench_attention.py kernel=transnext_aggregated dim=192 heads=8 seqlens=196,784 batch=2

For each sequence length, one round-robin over dense MHA (SDPA) and, per activation ratio, the official
masked MoH, the exact sparse MoH and, on CUDA, the Triton kernel; forward (inference) and forward+backward.
Every time is a ratio of dense MHA's in the same round (median and quartiles); ``bound`` is the sparse
path's FLOPs over dense, ``auto`` the path ``impl="auto"`` picks, ``max_rel_err`` the largest deviation
of any path from masked. ``clock=cpu`` measures this process's CPU time (meaningful with ``threads=1``).
``kernel=`` times MoH over another attention kernel against dense MHA over that kernel (TransNeXt's take
square ``seqlens``, their token grids; the FLOPs bound is sdpa's and left out for them): what a kernel's
``auto`` rule (the table's ``kernels``) is set from.
``fit=<file>`` writes the thresholds ``impl="auto"`` reads (``moh_vision/attention/auto_<device>.json``, see
:mod:`moh_vision.attention.auto_table`) fitted from this run, or from the ``.json`` records of earlier runs
given as ``fit_from`` (several widths and lengths together), keeping that device's kernel rules.
How it times: :mod:`moh_vision.analysis.benchmark`.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Optional, Sequence

from moh_vision.analysis.benchmark import CLOCKS, DTYPES, QUICK_ATTENTION, AttentionBench, bench_and_fit
from moh_vision.cli import Option, boolean, integer, list_of, number, run_tool, text

OPTIONS = (
    Option("dim", 768, integer, "model width", minimum=1),
    Option("heads", 12, integer, "attention heads", minimum=1),
    Option("batch", type=integer, minimum=1, help="images per batch (default: max(1, 2048 // seqlen))"),
    Option("ratios", [0.5, 0.75, 0.9], list_of(number), "activation ratios"),
    Option("seqlens", [196, 1024, 4096], list_of(integer), "sequence lengths"),
    Option("repeats", 15, integer, "timed rounds (every path once per round, interleaved)", minimum=1),
    Option("warmup", 2, integer, "untimed calls per path first", minimum=0),
    Option("device", "auto", help="auto | cpu | cuda"),
    Option("dtype", "float32", choices=tuple(DTYPES), help="precision"),
    Option("threads", type=integer, minimum=1, help="torch.set_num_threads (CPU)"),
    Option("clock", "wall", choices=tuple(CLOCKS), help="wall time, or this process's CPU time"),
    Option("modes", ["fwd", "fwdbwd"], list_of(text), "fwd and/or fwdbwd", choices=("fwd", "fwdbwd")),
    Option("kernel", "sdpa", help="attention kernel (dense MHA on the same kernel is the baseline): sdpa | "
                                  "transnext_aggregated | transnext_full (square seqlens) | ..."),
    Option("sr_ratio", 2, integer, "transnext_aggregated: its pooling ratio", minimum=1),
    Option("quick", False, boolean, "tiny shapes, 3 repeats: a smoke test for CI"),
    Option("out", help="also write the table: .csv, otherwise markdown (and every number to .json)"),
    Option("fit", help="write the impl=auto thresholds fitted from the measurements to this .json file"),
    Option("fit_from", type=list_of(text), help="fit from these earlier runs' .json records instead of measuring"),
    Option("max_predicted", 1.0, number, "fit: pick sparse where its predicted time x dense is at most this"),
)


def bench(opts) -> int:
    settings = {f.name: opts[f.name] for f in fields(AttentionBench)}
    setup = AttentionBench(**{**settings, **(QUICK_ATTENTION if opts.quick else {})})
    bench_and_fit(setup, opts.threads, opts.out, opts.fit, opts.fit_from, opts.max_predicted)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
