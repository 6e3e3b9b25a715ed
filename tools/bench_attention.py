"""Time MoH execution paths against dense multi-head attention.

For each sequence length, one round-robin over: dense MHA (SDPA), and for each activation ratio
the official-style masked MoH (every head computed, unselected ones zeroed), the exact sparse MoH
(pure PyTorch gather/scatter) and, on CUDA, the sparse MoH with the Triton routed-attention
kernel. Every time is reported as a ratio of the dense time measured in the same round-robin, for
the forward pass (eval, no grad: inference) and forward+backward (train mode, gradient w.r.t. the
input and every parameter). ``bound`` is the analytic lower bound of the sparse path: FLOPs of
the work it must do (router, keys/values for every head, queries + attention + output projection
of the active heads) over dense FLOPs. ``auto`` is the path ``impl="auto"`` picks there.
``max_rel_err`` checks, once per point, that every path matches masked (output and input
gradient); a Triton path that fails to compile is reported and left out.

Usage::

    python tools/bench_attention.py                       # dim 768, 12 heads, 196/1024/4096 tokens
    python tools/bench_attention.py --quick               # a few seconds, for CI
    python tools/bench_attention.py --threads 1 --clock cpu   # robust on a busy shared machine
    python tools/bench_attention.py --device cuda --dtype bfloat16 --out bench.md

Timing: ``--warmup`` untimed calls, then ``--repeats`` round-robins whose median is reported
(CUDA: synchronised before and after each call). ``--clock cpu`` measures this process's CPU
time instead of wall time: insensitive to other processes on the machine, meaningful with
``--threads 1``. Modules use PyTorch's default initialisation (routers included), which routes
tokens close to evenly; a trained, less balanced router pads the packed heads more.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from moh_vision.attention import build_attention
from moh_vision.attention.sparse import sparse_flops_ratio

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=None,
                   help="images per batch (default: max(1, 2048 // seqlen), about 2048 tokens per batch)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    p.add_argument("--seqlens", type=int, nargs="+", default=[196, 1024, 4096])
    p.add_argument("--repeats", type=int, default=5, help="timed round-robins; the median is reported")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"])
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats: a smoke test for CI")
    p.add_argument("--out", default=None, help="also write the table: .csv, otherwise markdown")
    args = p.parse_args(argv)
    if args.clock == "cpu" and torch.device(args.device).type == "cuda":
        p.error("--clock cpu measures host CPU time; use the wall clock on CUDA")
    if args.quick:
        args.dim, args.heads, args.seqlens, args.ratios = 64, 4, [50], [0.5]
        args.repeats, args.warmup, args.batch = 3, 1, 2
    return args


# ----------------------------------------------------------------------------------------------
# What to time
# ----------------------------------------------------------------------------------------------
def build_variants(args, ratio: float, device, dtype) -> Dict[str, torch.nn.Module]:
    """Masked, sparse (and Triton on CUDA) MoH at ``ratio``, all with the same weights."""
    masked = build_attention("moh", args.dim, args.heads, activation_ratio=ratio, impl="masked")
    variants = {"masked": masked, "sparse": build_attention("moh", args.dim, args.heads, activation_ratio=ratio,
                                                            impl="sparse"),
                "auto": build_attention("moh", args.dim, args.heads, activation_ratio=ratio, impl="auto")}
    if torch.device(device).type == "cuda":
        variants["triton"] = build_attention("moh", args.dim, args.heads, activation_ratio=ratio, impl="triton")
    for m in variants.values():
        m.load_state_dict(masked.state_dict())
    return {name: m.to(device=device, dtype=dtype) for name, m in variants.items()}


def forward_fn(m, x) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            m(x)
    return run


def forward_backward_fn(m, x, grad) -> Callable[[], None]:
    def run():
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(grad)
    return run


def flops_ratio_bound(dim: int, heads: int, head_dim: int, tokens: int, shared: int, topk: int) -> float:
    """Sparse FLOPs over dense FLOPs (see :func:`moh_vision.attention.sparse.sparse_flops_ratio`)."""
    return sparse_flops_ratio(dim, heads, head_dim, tokens, shared, topk)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
def make_clock(kind: str, device) -> Callable[[], float]:
    cuda = torch.device(device).type == "cuda"
    base = time.process_time if kind == "cpu" else time.perf_counter

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return base()
    return now


def time_round_robin(fns: Dict[str, Callable[[], None]], warmup: int, repeats: int, now) -> Dict[str, float]:
    """Median seconds per call; one call of every function per round, so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            samples[name].append(now() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def check_against_masked(models: Dict[tuple, torch.nn.Module], x, grad) -> Dict[float, float]:
    """Per ratio, the largest relative difference from masked of any other path's output or input
    gradient (exactness at the benchmark's own shapes; the unit tests use small ones). A Triton
    path that fails to compile or run is reported on stderr and dropped."""
    results: Dict[tuple, tuple] = {}
    for key, m in list(models.items()):
        if key[0] == "dense":
            continue
        xi = x.detach().clone().requires_grad_(True)
        try:
            y = m.train()(xi)
            y.backward(grad)
        except Exception as err:  # noqa: BLE001 - an unverified kernel must not stop the benchmark
            if key[0] != "triton":
                raise
            print(f"triton path dropped: {type(err).__name__}: {err}", file=sys.stderr)
            models.pop(key)
            continue
        results[key] = (y.detach().float(), xi.grad.float())
    errors: Dict[float, float] = {}
    for (name, ratio), (y, gx) in results.items():
        y_ref, gx_ref = results[("masked", ratio)]
        err = max(float((y - y_ref).abs().max() / y_ref.abs().max()), float((gx - gx_ref).abs().max() / gx_ref.abs().max()))
        errors[ratio] = max(errors.get(ratio, 0.0), err)
    return errors


def bench_seqlen(args, seqlen: int, device, dtype, now) -> List[dict]:
    batch = args.batch or max(1, 2048 // seqlen)
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    dense = build_attention("mha", args.dim, args.heads).to(device=device, dtype=dtype)
    models = {("dense", None): dense}
    for ratio in args.ratios:
        for name, m in build_variants(args, ratio, device, dtype).items():
            models[(name, ratio)] = m
    errors = check_against_masked(models, x, grad)

    rows = {ratio: {"seqlen": seqlen, "batch": batch, "ratio": ratio} for ratio in args.ratios}
    for mode in args.modes:
        fns = {}
        for (name, ratio), m in models.items():
            if name == "auto":
                continue  # auto runs one of the others; its pick is reported below
            m.train(mode == "fwdbwd")
            fns[(name, ratio)] = forward_fn(m, x) if mode == "fwd" else forward_backward_fn(m, x, grad)
        times = time_round_robin(fns, args.warmup, args.repeats, now)
        dense_time = times[("dense", None)]
        for ratio in args.ratios:
            row = rows[ratio]
            row[f"dense_{mode}_ms"] = 1e3 * dense_time
            for (name, r), t in times.items():
                if r == ratio:
                    row[f"{name}_{mode}"] = t / dense_time
            auto = models[("auto", ratio)].train(mode == "fwdbwd")
            with torch.set_grad_enabled(mode == "fwdbwd"):
                pick = auto.execution_path(x)
            row[f"auto_{mode}_pick"] = pick
            row[f"auto_{mode}"] = row[f"{pick}_{mode}"]

    for ratio in args.ratios:
        m = models[("masked", ratio)]
        rows[ratio].update(shared=m.shared_heads, topk=m.topk, active=m.active_heads / m.num_heads,
                           bound=flops_ratio_bound(args.dim, args.heads, m.head_dim, seqlen, m.shared_heads, m.topk),
                           max_rel_err=errors[ratio])
    return list(rows.values())


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------
def table_columns(rows: List[dict]) -> List[str]:
    cols = ["seqlen", "batch", "ratio", "shared", "topk", "active", "bound"]
    for mode in ("fwd", "fwdbwd"):
        if f"dense_{mode}_ms" not in rows[0]:
            continue
        cols.append(f"dense_{mode}_ms")
        cols += [f"{name}_{mode}" for name in ("masked", "sparse", "triton") if f"{name}_{mode}" in rows[0]]
        cols += [f"auto_{mode}_pick", f"auto_{mode}"]
    return cols + ["max_rel_err"]


def fmt(value, column: str = "") -> str:
    if column == "max_rel_err":
        return f"{value:.1e}"
    if isinstance(value, float):
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return str(value)


def markdown(rows: List[dict], header: str) -> str:
    cols = table_columns(rows)
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c], c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    now = make_clock(args.clock, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    header = (f"MoH attention benchmark: dim {args.dim}, {args.heads} heads, {args.dtype}, {where}, "
              f"{args.clock} clock, median of {args.repeats}. Times are x dense MHA of the same run "
              f"(dense_*_ms is absolute); bound = sparse FLOPs / dense FLOPs; max_rel_err = largest "
              f"difference of any path's output or input gradient from masked.")
    rows = []
    for seqlen in args.seqlens:
        rows += bench_seqlen(args, seqlen, device, dtype, now)
        print(f"done seqlen {seqlen}", file=sys.stderr, flush=True)
    table = markdown(rows, header)
    print(table)
    if args.out:
        with open(args.out, "w", newline="") as f:
            if args.out.endswith(".csv"):
                writer = csv.DictWriter(f, fieldnames=table_columns(rows))
                writer.writeheader()
                writer.writerows([{c: r[c] for c in table_columns(rows)} for r in rows])
            else:
                f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
