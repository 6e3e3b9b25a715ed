"""Timing that can tell: dense and MoH side by side in one process, a median and a spread per figure.

Every benchmark of the project (``tools/bench_attention.py``, ``tools/bench_models.py``) times its
candidates with :func:`interleave`: after a warm-up, each *round* calls every candidate once (in an
order that rotates from round to round, so no candidate always runs first or last), and each call
is timed on its own. A slow phase of the machine then hits all candidates of a round alike, and the
ratio of two candidates is taken *per round* (:func:`paired_ratio`), whose median and quartiles
are what the tables report. Rounds continue until ``rounds`` are done and at least ``min_seconds``
have passed, so short calls get many rounds.

The two benchmarks themselves are below: :func:`bench_attention` (MoH's execution paths against dense
MHA, one attention layer) and :func:`bench_models` (MoH models against their dense twins, images/s).

Peak memory (:func:`peak_memory`): on CUDA the allocator's high-water mark of one call; on the CPU
the peak of the bytes PyTorch's CPU allocator holds during one call, replayed from the profiler's
individual allocation and free events (tensors only: Python objects and the allocator's own caches
are not counted).
"""
from __future__ import annotations

import contextlib
import csv
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from moh_vision.attention.auto_table import cpu_name
from moh_vision.errors import ConfigError


@dataclass
class Spread:
    """Median and quartiles of a sample."""

    median: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        values = sorted(values)
        if len(values) < 2:
            v = values[0] if values else float("nan")
            return cls(v, v, v, len(values))
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median, q1, q3, len(values))

    def text(self, digits: int = 2) -> str:
        """``"0.93 [0.91-0.95]"``: median [first quartile - third quartile]."""
        return f"{self.median:.{digits}f} [{self.q1:.{digits}f}-{self.q3:.{digits}f}]"

    def as_dict(self) -> Dict[str, float]:
        return {"median": self.median, "q1": self.q1, "q3": self.q3, "n": self.n}


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def interleave(calls: Dict[str, Callable[[], None]], rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0,
               device: torch.device = torch.device("cpu"), clock: Callable[[], float] = time.perf_counter,
               progress: Optional[Callable[[int], None]] = None) -> Dict[str, List[float]]:
    """Seconds of every call of every candidate, ``rounds`` (or more, see ``min_seconds``) per candidate."""
    sync = synchronizer(device)
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    sync()
    times: Dict[str, List[float]] = {name: [] for name in names}
    start, r = time.perf_counter(), 0
    while r < rounds or time.perf_counter() - start < min_seconds:
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = clock()
            calls[name]()
            sync()
            times[name].append(clock() - t0)
        r += 1
        if progress is not None:
            progress(r)
    return times


@contextlib.contextmanager
def rounds_bar(total: int, desc: str) -> Iterator[Callable[[int], None]]:
    """A progress bar over the timed rounds on stderr (a whole-model benchmark runs for minutes): yields the
    ``progress`` callback :func:`interleave` takes."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="round", leave=False, file=sys.stderr)
    try:
        yield lambda done: bar.update(done - bar.n)
    finally:
        bar.close()


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Spread of ``numerator[i] / denominator[i]`` over the rounds (both timed in the same rounds)."""
    return Spread.of([a / b for a, b in zip(numerator, denominator)])


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines on file descriptor 2: send them to /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def launches(call: Callable[[], None], device: torch.device) -> Dict[str, float]:
    """What one ``call`` hands the device, from the profiler. On CUDA: ``kernels`` launched and ``device_ms``,
    the time they kept the GPU busy (their summed durations); a call whose wall time is well above
    ``device_ms`` waits on the host's launches, not on the GPU. On the CPU: ``aten_ops``, the ATen operators
    called at top level (each carries a fixed dispatch cost, which is what sets a small call's time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with _native_stderr_silenced(), profile(activities=[activity]) as prof:
        call()
        synchronizer(device)()
    if cuda:
        ran = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        return {"kernels": sum(e.count for e in ran), "device_ms": sum(e.self_device_time_total for e in ran) / 1e3}

    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return {"aten_ops": sum(1 for e in prof.events() if e.name.startswith("aten::") and top_level(e))}


_MEASURED_CALL = "peak_memory: measured call"


def _cpu_memory_trace(prof) -> Optional[tuple]:
    """The CPU allocations (bytes > 0) and frees (bytes < 0) the profiler recorded as ``(time_ns,
    address, bytes)`` in time order, and the ``(start, end)`` time of the ``_MEASURED_CALL`` range;
    None where this torch does not expose its event tree."""
    try:
        from torch._C._profiler import _EventType
        nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    except (ImportError, AttributeError):
        return None
    events, measured = [], None
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == _MEASURED_CALL:
            measured = (node.start_time_ns, node.end_time_ns)
        nodes.extend(node.children)
    return (sorted(events, key=lambda event: event[0]), measured) if measured else None


def peak_memory(call: Callable[[], None], device: torch.device) -> Optional[int]:
    """Bytes held at the peak of one ``call`` above what was held before it (None if unmeasurable).

    CPU: ``call`` runs twice under the profiler and the second run is measured by replaying every
    allocation and free in time order. (The first run allocates what the second frees, e.g. a
    training step's previous gradients: the profiler cannot size blocks allocated before it
    started. Summing each op's *net* memory at the op's start instead would credit a backward node's
    frees of its saved tensors before the gradients it allocates: several MB too little for paths
    with large autograd nodes, such as masked MoH.)
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    if device.type != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
        with record_function(_MEASURED_CALL):
            call()
    trace = _cpu_memory_trace(prof)
    if trace is None:
        return None
    events, (start, end) = trace
    sizes, held, before, peak = {}, 0, None, 0  # sizes: address -> bytes of the blocks allocated while profiling
    for time_ns, address, size in events:
        if time_ns > end:
            break
        if before is None and time_ns >= start:
            before = peak = held
        if size > 0:
            sizes[address] = size
            held += size
        elif address in sizes:
            held -= sizes.pop(address)
        if before is not None:
            peak = max(peak, held)
    return None if before is None else peak - before


# ----------------------------------------------------------------------------------------------
# MoH execution paths against dense attention (``tools/bench_attention.py``)
# ----------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class AttentionBench:
    """One attention benchmark: shapes, ratios and timing settings (``batch=None``: about 2048 tokens)."""

    dim: int = 768
    heads: int = 12
    batch: Optional[int] = None
    ratios: Sequence[float] = (0.5, 0.75, 0.9)
    seqlens: Sequence[int] = (196, 1024, 4096)
    repeats: int = 15
    warmup: int = 2
    device: str = "auto"
    dtype: str = "float32"
    clock: str = "wall"
    modes: Sequence[str] = ("fwd", "fwdbwd")
    kernel: str = "sdpa"
    sr_ratio: int = 2

    def kernel_options(self, seqlen: int) -> Dict:
        """What the kernel needs besides width and heads at ``seqlen`` tokens: TransNeXt's kernels their token
        grid (``seqlen`` a square) and, the aggregated one, its pooling ratio."""
        from moh_vision.attention.registry import attention_class
        from moh_vision.attention.sparse import kernel_class

        options = {"kernel": self.kernel}
        params = inspect.signature(kernel_class(attention_class("mha", self.kernel)).__init__).parameters
        if "input_resolution" in params:
            side = math.isqrt(seqlen)
            if side * side != seqlen:
                raise ConfigError(f"kernel {self.kernel} works on a square token grid: seqlen={seqlen} is not a square")
            options["input_resolution"] = side
        if "sr_ratio" in params:
            options["sr_ratio"] = self.sr_ratio
        return options


# a smoke test; 64 tokens: a square token grid, so any kernel= runs it
QUICK_ATTENTION = dict(dim=64, heads=4, seqlens=(64,), ratios=(0.5,), repeats=3, warmup=1, batch=2)


def resolve_device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def moh_paths(bench: AttentionBench, ratio: float, device, dtype,
              options: Optional[Dict] = None) -> Dict[str, torch.nn.Module]:
    """Masked, sparse and auto MoH at ``ratio``, all with the same weights; ``options``: the kernel's
    (:meth:`AttentionBench.kernel_options`)."""
    from moh_vision.attention import build_attention

    paths = {impl: build_attention("moh", bench.dim, bench.heads, activation_ratio=ratio, impl=impl, **(options or {}))
             for impl in ("masked", "sparse", "auto")}
    for module in paths.values():
        module.load_state_dict(paths["masked"].state_dict())
    return {name: m.to(device=device, dtype=dtype) for name, m in paths.items()}


def forward_fn(module, x) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            module(x)
    return run


def forward_backward_fn(module, x, grad) -> Callable[[], None]:
    def run():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)
    return run


def check_against_masked(models: Dict[tuple, torch.nn.Module], x, grad) -> Dict[float, float]:
    """Per ratio, the largest relative difference from masked of any other path's output or input
    gradient (exactness at the benchmark's own shapes; the unit tests use small ones)."""
    results: Dict[tuple, tuple] = {}
    for key, m in list(models.items()):
        if key[0] == "dense":
            continue
        xi = x.detach().clone().requires_grad_(True)
        y = m.train()(xi)
        y.backward(grad)
        results[key] = (y.detach().float(), xi.grad.float())
    errors: Dict[float, float] = {}
    for (name, ratio), (y, gx) in results.items():
        y_ref, gx_ref = results[("masked", ratio)]
        err = max(float((y - y_ref).abs().max() / y_ref.abs().max()),
                  float((gx - gx_ref).abs().max() / gx_ref.abs().max()))
        errors[ratio] = max(errors.get(ratio, 0.0), err)
    return errors


def bench_seqlen(bench: AttentionBench, seqlen: int, device: torch.device) -> List[dict]:
    """One row per ratio at ``seqlen`` tokens: every path's time over dense MHA's in the same rounds."""
    from moh_vision.attention import build_attention
    from moh_vision.attention.sparse import sparse_flops_ratio

    dtype = DTYPES[bench.dtype]
    batch = bench.batch or max(1, 2048 // seqlen)
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, bench.dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    options = bench.kernel_options(seqlen)
    models = {("dense", None): build_attention("mha", bench.dim, bench.heads, **options).to(device=device, dtype=dtype)}
    for ratio in bench.ratios:
        models.update({(name, ratio): m for name, m in moh_paths(bench, ratio, device, dtype, options).items()})
    errors = check_against_masked(models, x, grad)

    rows = {ratio: {"seqlen": seqlen, "batch": batch, "ratio": ratio} for ratio in bench.ratios}
    for mode in bench.modes:
        fns = {}
        for (name, ratio), m in models.items():
            if name == "auto":
                continue  # auto runs one of the others; its pick is reported below
            m.train(mode == "fwdbwd")
            fns[(name, ratio)] = forward_fn(m, x) if mode == "fwd" else forward_backward_fn(m, x, grad)
        with rounds_bar(bench.repeats, f"{seqlen} tokens, {mode}") as progress:
            samples = interleave(fns, rounds=bench.repeats, warmup=bench.warmup, device=device,
                                 clock=CLOCKS[bench.clock], progress=progress)
        dense_samples = samples[("dense", None)]
        for ratio in bench.ratios:
            row = rows[ratio]
            row[f"dense_{mode}_ms"] = 1e3 * statistics.median(dense_samples)
            for (name, r), t in samples.items():
                if r == ratio:
                    spread = paired_ratio(t, dense_samples)
                    row[f"{name}_{mode}"] = spread.median
                    row[f"{name}_{mode}_q"] = f"{spread.q1:.2f}-{spread.q3:.2f}"
                    if mode == "fwdbwd":
                        peak = peak_memory(fns[(name, r)], device)
                        row[f"{name}_peak_mb"] = float("nan") if peak is None else peak / 2 ** 20
            auto = models[("auto", ratio)].train(mode == "fwdbwd")
            with torch.set_grad_enabled(mode == "fwdbwd"):
                pick = auto.execution_path(x)
            row[f"auto_{mode}_pick"] = pick
            row[f"auto_{mode}"] = row[f"{pick}_{mode}"]
            row[f"auto_{mode}_q"] = row[f"{pick}_{mode}_q"]

    for ratio in bench.ratios:
        m = models[("masked", ratio)]
        # the FLOPs bound is sdpa's (TransNeXt's kernels attend to windows and pooled keys: theirs differs)
        bound = (sparse_flops_ratio(bench.dim, bench.heads, m.head_dim, seqlen, m.shared_heads, m.topk)
                 if bench.kernel == "sdpa" else float("nan"))
        rows[ratio].update(kernel=bench.kernel, dim=bench.dim, heads=bench.heads, head_dim=m.head_dim,
                           shared=m.shared_heads, topk=m.topk, active=m.active_heads() / m.num_heads,
                           bound=bound, max_rel_err=errors[ratio])
    return list(rows.values())


def attention_columns(rows: List[dict]) -> List[str]:
    cols = ["seqlen", "batch", "ratio", "shared", "topk", "active", "bound"]
    for mode in ("fwd", "fwdbwd"):
        if f"dense_{mode}_ms" not in rows[0]:
            continue
        cols.append(f"dense_{mode}_ms")
        for name in ("masked", "sparse"):
            if f"{name}_{mode}" in rows[0]:
                cols += [f"{name}_{mode}", f"{name}_{mode}_q"]
        cols += [f"auto_{mode}_pick", f"auto_{mode}", f"auto_{mode}_q"]
    if "masked_peak_mb" in rows[0]:
        cols += [f"{name}_peak_mb" for name in ("masked", "sparse") if f"{name}_peak_mb" in rows[0]]
    return cols + ["max_rel_err"]


def _cell(value, column: str = "") -> str:
    if column == "max_rel_err":
        return f"{value:.1e}"
    if isinstance(value, float):
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return str(value)


def attention_table(rows: List[dict], header: str) -> str:
    cols = attention_columns(rows)
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c], c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def bench_attention(bench: AttentionBench, threads: Optional[int] = None, out: Optional[str] = None) -> dict:
    """Time every MoH path against dense MHA at every sequence length, print the table and return the run
    (:func:`run_record`: its rows and where they were measured); ``out`` (``.csv``, else markdown) also gets
    the table, and that record goes to ``<out>.json``."""
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(bench.device)
    if bench.clock == "cpu" and device.type == "cuda":
        raise ConfigError("clock=cpu measures host CPU time; use the wall clock on CUDA")
    kernel = "" if bench.kernel == "sdpa" else f"kernel {bench.kernel}, "
    header = (f"MoH attention benchmark: {kernel}dim {bench.dim}, {bench.heads} heads, {bench.dtype}, "
              f"{where_measured(device)}, {bench.clock} clock, {bench.repeats} interleaved rounds. "
              f"Times are x dense MHA in the same round: median, and *_q its quartiles (dense_*_ms is absolute); "
              f"bound = sparse FLOPs / dense FLOPs; *_peak_mb = training peak memory of one call; max_rel_err = "
              f"largest difference of any path's output or input gradient from masked.")
    rows = []
    for seqlen in bench.seqlens:
        rows += bench_seqlen(bench, seqlen, device)
        print(f"done seqlen {seqlen}", file=sys.stderr, flush=True)
    table = attention_table(rows, header)
    print(table)
    record = run_record(bench, device, header, rows)
    if out:
        Path(out).with_suffix(".json").write_text(json.dumps(record, indent=1))
        with open(out, "w", newline="") as f:
            if str(out).endswith(".csv"):
                writer = csv.DictWriter(f, fieldnames=attention_columns(rows))
                writer.writeheader()
                writer.writerows([{c: r[c] for c in attention_columns(rows)} for r in rows])
            else:
                f.write(table + "\n")
    return record


def machine_description() -> str:
    """The CPU model and core count (``/proc/cpuinfo`` where there is one)."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def where_measured(device: torch.device) -> str:
    """The machine, threads and ``impl="auto"`` table a benchmark ran with (for its header)."""
    from moh_vision.attention.auto_table import auto_table

    table = auto_table(device.type)
    source = f"auto table {Path(table.source).name}" if table is not None else "no auto table"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {source}"
    return f"cpu ({machine_description()}), {torch.get_num_threads()} threads, {source}"


def run_record(bench: AttentionBench, device: torch.device, header: str, rows: List[dict]) -> dict:
    """One benchmark run as JSON: what was measured, where, and every row (what ``fit_from`` reads).
    ``processor``: the name a table fitted from it is matched by
    (:func:`~moh_vision.attention.auto_table.machine_name`)."""
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    where = processor if device.type == "cuda" else machine_description()
    return {"header": header, "device": device.type, "machine": where, "processor": processor,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(bench).items()},
            "rows": rows}


# ----------------------------------------------------------------------------------------------
# impl="auto" thresholds fitted from attention benchmark runs (``tools/bench_attention.py fit=...``)
# ----------------------------------------------------------------------------------------------
def _cents_up(value: float) -> float:
    return math.ceil(round(value * 100, 6)) / 100


def fit_sdpa_rule(rows: Sequence[dict], max_predicted: float = 1.0):
    """The ``sdpa`` rule of :mod:`moh_vision.attention.auto_table` from benchmark rows (any number of
    runs, widths and batch sizes together). A layer shape measured in several runs counts once, with the
    median of its runs' figures (:func:`combine_runs`): one run on a busy phase of a shared machine then
    neither sets nor vetoes a threshold alone.

    One set of curves per measured width (a layer uses those of the widest width it reaches), and in it
    one overhead curve per mode: inference (``overhead``, from the forward timings) and, where the rows
    have forward and backward timings too, training (``training_overhead``). Overhead at a sequence
    length: the largest ``sparse/dense - bound`` among the rows there where sparse beat masked in that
    mode, rounded up to 0.01, so the predicted sparse time is never below a measured winner's. A length
    where sparse never won gets the smallest ``sparse/dense - bound`` of its rows (what the measurement
    that came closest implies), at least enough to keep every measured row masked. Otherwise rows where
    sparse lost do not set the overhead; instead, where the rule would still send one of them to the sparse
    path, that length's overhead is raised until it goes masked: in each mode auto never picks a path that measured
    slower. ``max_predicted`` 1.0: sparse where it is predicted no slower than dense attention (masked MoH
    measured at or above dense everywhere). The limits are the smallest width, head width and tokens per
    call measured (outside them auto runs masked)."""
    from moh_vision.attention.auto_table import SdpaRule, WidthCurves

    rows = [r for r in rows if any(f"sparse_{mode}" in r for mode in ("fwd", "fwdbwd"))]
    if not rows:
        raise ConfigError("fit: the benchmark rows hold no sparse-path timings")
    others = sorted({r["kernel"] for r in rows if r.get("kernel", "sdpa") != "sdpa"})
    if others:
        raise ConfigError(f"fit: only the sdpa rule is fitted; these runs measured kernel {', '.join(others)} "
                          f"(its rule in the table's 'kernels' is set from such runs by hand)")
    missing = [k for k in ("dim", "head_dim", "seqlen", "batch", "bound") if k not in rows[0]]
    if missing:
        raise ConfigError(f"fit: benchmark rows lack {', '.join(missing)} (written by an older version: rerun it)")
    modes = [mode for mode in ("fwd", "fwdbwd") if f"sparse_{mode}" in rows[0]]
    rows = combine_runs(rows, [f"{path}_{mode}" for path in ("sparse", "masked") for mode in modes])
    curves = []
    for dim in sorted({r["dim"] for r in rows}):  # one set of curves per measured width
        at_dim = [r for r in rows if r["dim"] == dim]
        inference = _fit_overhead(at_dim, modes[0], max_predicted)  # the forward timings if measured
        training = _fit_overhead(at_dim, "fwdbwd", max_predicted) if modes == ["fwd", "fwdbwd"] else None
        curves.append(WidthCurves(dim, inference, training))
    return SdpaRule(tuple(curves), max_predicted=max_predicted, min_head_dim=min(r["head_dim"] for r in rows),
                    min_batch_tokens=min(r["batch"] * r["seqlen"] for r in rows))


def combine_runs(rows: Sequence[dict], fields: Sequence[str]) -> List[dict]:
    """One row per layer shape (width, heads, tokens, batch, shared and routed heads): ``fields`` are the
    median over the rows of that shape (one per run), in the order the shapes first appear."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        key = tuple(r.get(k) for k in ("dim", "heads", "head_dim", "seqlen", "batch", "shared", "topk"))
        groups.setdefault(key, []).append(r)
    combined = []
    for same in groups.values():
        row = dict(same[0])
        row.update({f: statistics.median(r[f] for r in same) for f in fields})
        combined.append(row)
    return combined


def _fit_overhead(rows: Sequence[dict], mode: str, max_predicted: float) -> Tuple[Tuple[int, float], ...]:
    """One mode's ``[tokens, overhead]`` points (see :func:`fit_sdpa_rule`)."""
    def wins(r: dict) -> bool:
        return r[f"sparse_{mode}"] < r[f"masked_{mode}"]

    def masking(bound: float) -> float:  # the smallest overhead (in cents) that sends ``bound`` masked
        return _cents_up(max_predicted - bound + 0.005)

    overhead: Dict[int, float] = {}
    for n in sorted({r["seqlen"] for r in rows}):
        at_n = [r for r in rows if r["seqlen"] == n]
        winners = [r[f"sparse_{mode}"] - r["bound"] for r in at_n if wins(r)]
        if winners:
            overhead[n] = _cents_up(max(winners))
        else:  # sparse lost every row here: the overhead the closest of them implies, so that a layer with
            # fewer active heads than any measured is sent to sparse only where that overhead allows it
            implied = _cents_up(min(r[f"sparse_{mode}"] - r["bound"] for r in at_n))
            overhead[n] = max(implied, masking(min(r["bound"] for r in at_n)))
    for r in rows:
        if not wins(r) and r["bound"] + overhead[r["seqlen"]] <= max_predicted + 1e-9:
            overhead[r["seqlen"]] = masking(r["bound"])
    return tuple(sorted(overhead.items()))


def fitted_table(runs: Sequence[dict], max_predicted: float = 1.0):
    """An auto table whose ``sdpa`` rule is fitted from benchmark ``runs`` (:func:`run_record` dicts of
    one device type); its kernel rules are kept from that device's current table."""
    from types import MappingProxyType

    from moh_vision.attention.auto_table import AutoTable, auto_table

    devices = {run.get("device") for run in runs}
    if len(devices) != 1 or None in devices:
        raise ConfigError(f"fit: runs from one device type expected, got {sorted(map(str, devices))}")
    device = devices.pop()
    current = auto_table(device)
    rule = fit_sdpa_rule([r for run in runs for r in run["rows"]], max_predicted)
    # earlier records have only "machine" ("<cpu model>, <n> cores")
    machines = sorted({run.get("processor") or run.get("machine", "").rsplit(", ", 1)[0] for run in runs} - {""})
    provenance = {"machine": sorted({run.get("machine", "?") for run in runs}),
                  "torch": sorted({run.get("torch", "?") for run in runs}),
                  "threads": sorted({run.get("threads", 0) for run in runs}),
                  "runs": [run.get("settings", {}) for run in runs],
                  "fitted": time.strftime("%Y-%m-%d"), "by": "tools/bench_attention.py fit=... (fit_sdpa_rule)"}
    notes = ("sdpa fitted by moh_vision.analysis.benchmark.fit_sdpa_rule from the runs in provenance.",)
    notes += tuple(n for n in (current.notes if current else ()) if not n.startswith("sdpa"))
    return AutoTable(source="fitted", sdpa=rule, kernels=current.kernels if current else MappingProxyType({}),
                     provenance=MappingProxyType(provenance), notes=notes, machines=tuple(machines))


def load_runs(paths: Sequence[str]) -> List[dict]:
    """Benchmark records (:func:`run_record`, written with ``out=``) read back for ``fit_from``."""
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


def bench_and_fit(bench: AttentionBench, threads: Optional[int] = None, out: Optional[str] = None,
                  fit: Optional[str] = None, fit_from: Optional[Sequence[str]] = None,
                  max_predicted: float = 1.0) -> Optional[object]:
    """``tools/bench_attention.py``: measure (:func:`bench_attention`), or read earlier runs (``fit_from``),
    and with ``fit`` write the auto thresholds fitted from them (:func:`fitted_table`); returns that table."""
    from moh_vision.attention.auto_table import write_table

    if fit_from:
        if not fit:
            raise ConfigError("fit_from needs fit=<file> (where to write the thresholds)")
        runs = load_runs(fit_from)
    else:
        runs = [bench_attention(bench, threads, out)]
    if not fit:
        return None
    table = fitted_table(runs, max_predicted)
    path = write_table(table, fit)
    rule = table.sdpa
    curves = "; ".join(f"dim >= {c.min_dim}: overhead {[list(p) for p in c.overhead]}" + (
        "" if c.training_overhead is None else f", training {[list(p) for p in c.training_overhead]}")
        for c in rule.curves)
    print(f"impl=auto thresholds written to {path}: {curves}; "
          f"max_predicted {rule.max_predicted}, min_dim {rule.min_dim}, min_head_dim {rule.min_head_dim}, "
          f"min_batch_tokens {rule.min_batch_tokens}")
    return table


# ----------------------------------------------------------------------------------------------
# Whole MoH models against their dense twins (``tools/bench_models.py``)
# ----------------------------------------------------------------------------------------------
DEFAULT_PAIRS = ("moh_transnext_base_50:transnext_base", "moh_dit_xl_2_75:dit_xl_2", "moh_dit_b_2_75:dit_b_2")
QUICK_PAIRS = ("moh_dit_s_2_75:dit_s_2",)


def build_for_bench(name: str, img_size: int, impl: str, device: torch.device,
                    attention: Optional[Dict] = None) -> torch.nn.Module:
    """Model ``name`` as registered (a preset keeps its own attention and heads), or with ``attention``
    (``{"name": "moh", "activation_ratio": 0.5, ...}``) in every layer; layers whose variant has
    execution paths run ``impl`` (refused with the variant's reason where it cannot)."""
    from moh_vision.attention import find_attention
    from moh_vision.models import build_model, model_family

    # DiT works on 256px images as 32x32 latents (1/8); TransNeXt and ViT on the images.
    kwargs: Dict = {"input_size": img_size // 8} if model_family(name) == "dit" else {"img_size": img_size}
    if attention is not None:
        kwargs["attention"] = dict(attention)
    with torch.device("meta"):
        layers = find_attention(build_model(name, **kwargs))
    variant = layers[0][1] if layers else None
    if variant is not None and variant.reference_impl is not None:  # it has paths: ask for ``impl``
        kwargs["attention"] = {**kwargs.get("attention", {}), "name": variant.attention_name, "impl": impl}
    return build_model(name, **kwargs).to(device)


def model_inputs(model: torch.nn.Module, batch: int, device: Optional[torch.device] = None) -> Tuple:
    """Random inputs for one call of ``model``: ``(x, t, y)`` for DiT, ``(images,)`` otherwise."""
    if hasattr(model, "t_embedder"):  # DiT: (x, t, y)
        s = model.x_embedder.img_size
        return (torch.randn(batch, model.in_channels, *s, device=device),
                torch.randint(0, 1000, (batch,), device=device),
                torch.randint(0, model.y_embedder.num_classes, (batch,), device=device))
    return (torch.randn(batch, *model.pretrained_cfg["input_size"], device=device),)


def make_step(model: torch.nn.Module, batch: int, device: torch.device, train: bool,
              dtype: torch.dtype) -> Callable[[], None]:
    """One inference call, or one training step (forward, backward, AdamW), on random inputs."""
    inputs = model_inputs(model, batch, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6) if train else None

    def step() -> None:
        ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else \
            torch.autocast(device.type, enabled=False)
        if train:
            with ctx:
                out = model(*inputs)
            out.float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad(), ctx:
                model(*inputs)

    model.train(train)
    return step


def bench_pair(moh: str, dense: str, impls: Sequence[str], batch: int, img_size: int, rounds: int, warmup: int,
               min_seconds: float, device: torch.device, dtype: torch.dtype,
               attention: Optional[Dict] = None, compile_models: bool = False, compile_mode: str = "default",
               count_launches: bool = False) -> List[Dict]:
    """The dense twin and the MoH model (with ``attention``, if given) under every impl, interleaved round
    by round; ``compile_models``: each one ``torch.compile``d with ``compile_mode`` (as
    ``trainer.compile=true``), its first call per mode (the compilation) left out of the timings;
    ``count_launches``: also one profiled step per candidate and mode (:func:`launches`)."""
    models = {(dense, "-"): build_for_bench(dense, img_size, "masked", device)}
    label = moh if attention is None else f"{moh} ({attention_label(attention)})"
    for impl in impls:
        try:
            models[(label, impl)] = build_for_bench(moh, img_size, impl, device, attention)
        except Exception as err:  # an impl this model cannot run (e.g. sparse on TransNeXt's own kernels)
            print(f"skip {moh} impl={impl}: {err}", file=sys.stderr)
    if compile_models:
        from moh_vision.attention.recorder import compile_model

        models = {key: compile_model(m, compile_mode) for key, m in models.items()}
        warmup = max(warmup, 1)
    rows = {key: {"model": key[0], "impl": key[1], "batch": batch, "compiled": compile_models} for key in models}
    for mode in ("infer", "train"):
        steps = {key: make_step(m, batch, device, mode == "train", dtype) for key, m in models.items()}
        with rounds_bar(rounds, f"{label} vs {dense}, {'training' if mode == 'train' else 'inference'}") as progress:
            times = interleave(steps, rounds=rounds, warmup=warmup, min_seconds=min_seconds, device=device,
                               progress=progress)
        base = times[(dense, "-")]
        for key, t in times.items():
            rows[key][f"{mode}_ms"] = Spread.of([1e3 * v for v in t]).as_dict()
            rows[key][f"{mode}_img_s"] = batch / statistics.median(t)
            rows[key][f"{mode}_x_dense"] = paired_ratio(t, base).as_dict()
            if count_launches:
                rows[key][f"{mode}_launches"] = launches(steps[key], device)
        if mode == "train":
            for key, step in steps.items():
                peak = peak_memory(step, device)
                rows[key]["train_peak_mb"] = None if peak is None else peak / 2 ** 20
    return list(rows.values())


def attention_label(attention: Dict) -> str:
    """``moh 0.5`` for ``{"name": "moh", "activation_ratio": 0.5, ...}`` (the options a row was run with)."""
    ratio = attention.get("activation_ratio")
    return attention.get("name", "?") + ("" if ratio is None else f" {ratio:g}")


def models_table(rows: Sequence[Dict], header: str) -> str:
    def spread(d: Dict[str, float]) -> str:
        return f"{d['median']:.3f} [{d['q1']:.3f}-{d['q3']:.3f}]"

    def launched(d: Dict[str, float]) -> str:  # kernels (GPU-busy ms) on CUDA, ATen operators on the CPU
        return f"{d['kernels']} ({d['device_ms']:.2f} ms)" if "kernels" in d else f"{d['aten_ops']}"

    counted = "infer_launches" in rows[0]
    extra = (" inference launches | training launches |", "---|---|") if counted else ("", "")
    lines = [header, "", "| model | MoH impl | inference ms | x dense | training ms | x dense | training peak MB |"
             + extra[0], "|---|---|---|---|---|---|---|" + extra[1]]
    for r in rows:
        peak = "-" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.0f}"
        more = f" {launched(r['infer_launches'])} | {launched(r['train_launches'])} |" if counted else ""
        lines.append(f"| {r['model']} | {r['impl']} | {r['infer_ms']['median']:.1f} | {spread(r['infer_x_dense'])} | "
                     f"{r['train_ms']['median']:.1f} | {spread(r['train_x_dense'])} | {peak} |" + more)
    return "\n".join(lines) + "\n"


def bench_models(pairs: Optional[Sequence[str]] = None, impls: Sequence[str] = ("auto", "masked"), batch: int = 2,
                 img_size: Optional[int] = None, rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0,
                 device: str = "auto", dtype: str = "float32", threads: Optional[int] = None, quick: bool = False,
                 out: Optional[str] = None, attention: Optional[Dict] = None,
                 compile_models: bool = False, compile_mode: str = "default",
                 count_launches: bool = False) -> List[Dict]:
    """Images/s of each ``moh:dense`` pair (inference and training), print the table and return its rows;
    ``out`` also gets the table, and every number goes to ``<out>.json``. ``quick``: one small pair at 64 px.
    ``attention``: the MoH side's attention in every layer (e.g. ``transnext_micro:transnext_micro`` with
    ``{"name": "moh", "activation_ratio": 0.5}``); None: as registered. ``compile_models``: every model
    ``torch.compile``d with ``compile_mode`` (under compile, ``impl="auto"`` runs masked). ``count_launches``:
    what each step launches, two more columns (:func:`launches`)."""
    from moh_vision.models import model_family

    if threads:
        torch.set_num_threads(threads)
    where, torch_dtype = resolve_device(device), DTYPES[dtype]
    rows = []
    for pair in pairs or (QUICK_PAIRS if quick else DEFAULT_PAIRS):
        moh, _, dense = pair.partition(":")
        if not dense:
            raise ConfigError(f"pairs wants moh:dense, got {pair}")
        size = img_size or (64 if quick else (256 if model_family(moh) == "dit" else 224))
        rows += bench_pair(moh, dense, impls, batch, size, rounds, warmup, min_seconds, where, torch_dtype, attention,
                           compile_models, compile_mode, count_launches)
    mode = "" if compile_mode == "default" else f" (mode {compile_mode})"
    compiled = f", every model torch.compile'd{mode}" if compile_models else ""
    header = (f"{where_measured(where)}, {dtype}, batch {batch}{compiled}; dense and MoH interleaved, {rounds}+ rounds: "
              f"median ms per step, and the per-round ratio to the dense twin as median [quartiles]")
    table = models_table(rows, header)
    print(table)
    if out:
        Path(out).write_text(table)
        Path(out).with_suffix(".json").write_text(json.dumps({"header": header, "torch": torch.__version__,
                                                              "rows": rows}, indent=1))
    return rows
