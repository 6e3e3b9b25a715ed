"""Time MoH execution paths against dense multi-head attention.

    python tools/bench_attention.py                        # dim 768, 12 heads, 196/1024/4096 tokens
    python tools/bench_attention.py quick=true             # a few seconds, for CI
    python tools/bench_attention.py threads=1 clock=cpu    # robust on a busy shared machine
    python tools/bench_attention.py device=cuda dtype=bfloat16 out=bench.md
    python tools/bench_attention.py threads=1 clock=cpu out=b768.md fit=moh_vision/attention/auto_cpu.json
    python tools/bench_attention.py fit_from=b768.json,b384.json fit=auto_cpu.json   # fit without measuring

For each sequence length, one round-robin over dense MHA (SDPA) and, per activation ratio, the official
masked MoH, the exact sparse MoH and, on CUDA, the Triton kernel; forward (inference) and forward+backward.
Every time is a ratio of dense MHA's in the same round (median and quartiles); ``bound`` is the sparse
path's FLOPs over dense, ``auto`` the path ``impl="auto"`` picks, ``max_rel_err`` the largest deviation
of any path from masked. ``clock=cpu`` measures this process's CPU time (meaningful with ``threads=1``).
``fit=<file>`` writes the thresholds ``impl="auto"`` reads (``moh_vision/attention/auto_<device>.json``, see
:mod:`moh_vision.attention.auto_table`) fitted from this run, or from the ``.json`` records of earlier runs
given as ``fit_from`` (several widths and lengths together), keeping that device's kernel rules.
How it times: :mod:`moh_vision.analysis.benchmark`.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Optional, Sequence

from moh_vision.analysis.benchmark import (CLOCKS, DTYPES, QUICK_ATTENTION, AttentionBench, bench_attention,
                                           fitted_table, resolve_device, run_record)
from moh_vision.attention.auto_table import write_table
from moh_vision.cli import Option, boolean, integer, list_of, number, run_tool, text
from moh_vision.errors import ConfigError

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
    Option("quick", False, boolean, "tiny shapes, 3 repeats: a smoke test for CI"),
    Option("out", help="also write the table: .csv, otherwise markdown (and every number to .json)"),
    Option("fit", help="write the impl=auto thresholds fitted from the measurements to this .json file"),
    Option("fit_from", type=list_of(text), help="fit from these earlier runs' .json records instead of measuring"),
    Option("max_predicted", 1.0, number, "fit: pick sparse where its predicted time x dense is at most this"),
)


def load_runs(paths: Sequence[str]) -> list:
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"fit_from {path}: cannot read a benchmark record ({err})") from None
        if not isinstance(run, dict) or "rows" not in run or "device" not in run:
            raise ConfigError(f"fit_from {path}: not a bench_attention record (written with out=<file>)")
        runs.append(run)
    return runs


def bench(opts) -> int:
    if opts.fit_from:
        if not opts.fit:
            raise ConfigError("fit_from needs fit=<file> (where to write the thresholds)")
        runs = load_runs(opts.fit_from)
    else:
        settings = {f.name: opts[f.name] for f in fields(AttentionBench)}
        setup = AttentionBench(**{**settings, **(QUICK_ATTENTION if opts.quick else {})})
        rows = bench_attention(setup, opts.threads, opts.out)
        runs = [run_record(setup, resolve_device(setup.device), "", rows)]
    if opts.fit:
        table = fitted_table(runs, opts.max_predicted)
        path = write_table(table, opts.fit)
        rule = table.sdpa
        print(f"impl=auto thresholds written to {path}: overhead {[list(p) for p in rule.overhead]}, "
              f"max_predicted {rule.max_predicted}, min_dim {rule.min_dim}, min_head_dim {rule.min_head_dim}, "
              f"min_batch_tokens {rule.min_batch_tokens}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
