"""Timing that can tell: dense and MoH side by side in one process, a median and a spread per figure.

Every benchmark of the project (``tools/bench_models.py``, ``tools/bench_kernels.py``, ``tools/bench_backbones.py``)
times its candidates with :func:`interleave`: after a warm-up, each *round* calls every candidate once, in an order that
rotates from round to round, each call timed on its own. A slow phase of the machine then hits all candidates of a round
alike, and the ratio of two candidates is taken *per round* (:func:`paired_ratio`), whose median and quartiles the
tables report. Here: :func:`bench_models` (MoH models against their dense twins) and :func:`bench_kernels` (one model
under several ``kernels`` configs: whether an implementation pays on the whole model's step, and what it saves)."""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from moh_vision.analysis.device_peaks import cpu_name
from moh_vision.cli import Option, integer, number
from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels, resolved


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
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def interleave(calls: Dict[str, Callable[[], None]], rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0,
               device: torch.device = torch.device("cpu"), clock: Callable[[], float] = time.perf_counter,
               progress: Optional[Callable[[int], None]] = None) -> Dict[str, List[float]]:
    """Seconds of every call of every candidate: ``rounds`` rounds, and more until ``min_seconds`` have passed."""
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
    """A progress bar on stderr over the timed rounds: yields the ``progress`` callback of :func:`interleave`."""
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
    """What one ``call`` hands the device, from the profiler. On CUDA: ``kernels`` launched and ``device_ms``, their
    summed durations (a call whose wall time is well above it waits on the host's launches). On the CPU: ``aten_ops``,
    the ATen operators called at top level (each a fixed dispatch cost, which sets a small call's time)."""
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
    """The CPU allocations (bytes > 0) and frees (bytes < 0) the profiler recorded as ``(time_ns, address, bytes)`` in
    time order, and the ``(start, end)`` time of the ``_MEASURED_CALL`` range; None where torch hides its event tree."""
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
    """Bytes held at the peak of one ``call`` above what was held before it (None if unmeasurable): on CUDA the
    allocator's high-water mark; on the CPU, tensors only, from the profiler's allocation and free events.

    CPU: ``call`` runs twice under the profiler and the second run is measured by replaying every allocation and free in
    time order (the first run allocates what the second frees, e.g. a training step's previous gradients, which the
    profiler cannot size otherwise; summing each op's *net* memory would credit a backward node's frees of its saved
    tensors before the gradients it allocates)."""
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


def _parameter_copy(tensor: torch.Tensor, held: Set[int]) -> bool:
    """Whether ``tensor`` is (a view of) autocast's cast of one parameter: a per-step cost, not a per-image one."""
    base = tensor._base if tensor._is_view() else tensor
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return False
    sources = [source for source, _ in node.next_functions if source is not None]
    leaf = getattr(sources[0], "variable", None) if len(sources) == 1 else None  # AccumulateGrad holds its leaf
    return leaf is not None and leaf.untyped_storage().data_ptr() in held


def saved_tensor_bytes(call: Callable[[], object], parameters: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``call()`` runs, each distinct storage once at its full
    size; ``parameters``, tensors sharing their storage (``weight.t()``) and autocast's copies of them are left out (the
    model holds the first anyway; the copies are per step). Only a forward saves: ``call`` may be a training step."""
    held = {p.untyped_storage().data_ptr() for p in parameters}
    saved: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # the graph keeps what it saved alive: no other storage reuses the address while ``call`` runs
        if not (isinstance(tensor, nn.Parameter) or storage.data_ptr() in held or _parameter_copy(tensor, held)):
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return sum(saved.values())


# -- Where a benchmark runs --------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What every timing tool (tools/bench_models.py, bench_kernels.py, bench_backbones.py) takes after its rounds.
TIMING_OPTIONS = (
    Option("min_seconds", 0.0, number, "keep adding rounds until this much time", minimum=0),
    Option("device", "auto", help="auto | cpu | cuda"),
    Option("dtype", "float32", choices=tuple(DTYPES), help="autocast precision (float32: none)"),
    Option("threads", type=integer, minimum=1, help="torch.set_num_threads (CPU)"),
)


def resolve_device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def machine_description() -> str:
    """The CPU model and core count (``/proc/cpuinfo`` where there is one)."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def where_measured(device: torch.device) -> str:
    """The machine and threads a benchmark ran with (for its header)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({machine_description()}), {torch.get_num_threads()} threads"


# -- Whole MoH models against their dense twins (``tools/bench_models.py``) --------------------------------------------
DEFAULT_PAIRS = ("moh_transnext_base_50:transnext_base", "moh_dit_xl_2_75:dit_xl_2", "moh_dit_b_2_75:dit_b_2")
QUICK_PAIRS = ("moh_dit_s_2_75:dit_s_2",)


def build_for_bench(name: str, img_size: int, device: torch.device, attention: Optional[Dict] = None,
                    kernels: Optional[Kernels] = None) -> torch.nn.Module:
    """Model ``name`` as registered, or with ``attention`` (a config group) in every layer, running ``kernels``."""
    from moh_vision.models import build_model, model_family

    # DiT works on 256px images as 32x32 latents (1/8); TransNeXt and ViT on the images.
    kwargs: Dict = {"input_size": img_size // 8} if model_family(name) == "dit" else {"img_size": img_size}
    return build_model(name, attention=attention, kernels=kernels, **kwargs).to(device)


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


def time_candidates(models: Dict[Any, torch.nn.Module], base: Any, batch: int, rounds: int, warmup: int,
                    min_seconds: float, device: torch.device, dtype: torch.dtype, label: str,
                    count_launches: bool = False) -> Dict[Any, Dict]:
    """Inference and training steps of every model interleaved round by round: per model its ms, images/s and the
    per-round ratio to ``base``'s step (``x_base``), the training peak memory and, with ``count_launches``, what one
    step of each mode launches (:func:`launches`)."""
    rows: Dict[Any, Dict] = {key: {} for key in models}
    for mode in ("infer", "train"):
        steps = {key: make_step(m, batch, device, mode == "train", dtype) for key, m in models.items()}
        with rounds_bar(rounds, f"{label}, {'training' if mode == 'train' else 'inference'}") as progress:
            times = interleave(steps, rounds=rounds, warmup=warmup, min_seconds=min_seconds, device=device,
                               progress=progress)
        for key, t in times.items():
            rows[key][f"{mode}_ms"] = Spread.of([1e3 * v for v in t]).as_dict()
            rows[key][f"{mode}_img_s"] = batch / statistics.median(t)
            rows[key][f"{mode}_x_base"] = paired_ratio(t, times[base]).as_dict()
            if count_launches:
                rows[key][f"{mode}_launches"] = launches(steps[key], device)
        if mode == "train":
            for key, step in steps.items():
                peak = peak_memory(step, device)
                rows[key]["train_peak_mb"] = None if peak is None else peak / 2 ** 20
    return rows


def bench_pair(moh: str, dense: str, batch: int, img_size: int, rounds: int, warmup: int, min_seconds: float,
               device: torch.device, dtype: torch.dtype, attention: Optional[Dict] = None,
               kernels: Optional[Kernels] = None, compile_models: bool = False, compile_mode: str = "default",
               count_launches: bool = False) -> List[Dict]:
    """The dense twin and the MoH model (with ``attention``, if given), both with ``kernels``, interleaved round by
    round; ``compile_models``: each one ``torch.compile``d with ``compile_mode`` (as ``trainer.compile=true``), its
    first call per mode (the compilation) left out of the timings."""
    label = moh if attention is None else f"{moh} ({attention_label(attention)})"
    models = {dense: build_for_bench(dense, img_size, device, kernels=kernels),
              label: build_for_bench(moh, img_size, device, attention, kernels)}
    if compile_models:
        from moh_vision.attention.recorder import compile_model

        models = {key: compile_model(m, compile_mode) for key, m in models.items()}
        warmup = max(warmup, 1)
    timed = time_candidates(models, dense, batch, rounds, warmup, min_seconds, device, dtype, f"{label} vs {dense}",
                            count_launches)
    rows = []
    for key, row in timed.items():
        row = {"model": key, "batch": batch, "compiled": compile_models, **row}
        for mode in ("infer", "train"):
            row[f"{mode}_x_dense"] = row.pop(f"{mode}_x_base")
        rows.append(row)
    return rows


def attention_label(attention: Dict) -> str:
    """``moh 0.5`` for ``{"name": "moh", "activation_ratio": 0.5, ...}`` (the options a row was run with)."""
    ratio = attention.get("activation_ratio")
    return attention.get("name", "?") + ("" if ratio is None else f" {ratio:g}")


def _spread(d: Dict[str, float]) -> str:
    return f"{d['median']:.3f} [{d['q1']:.3f}-{d['q3']:.3f}]"


def models_table(rows: Sequence[Dict], header: str) -> str:
    def launched(d: Dict[str, float]) -> str:  # kernels (GPU-busy ms) on CUDA, ATen operators on the CPU
        return f"{d['kernels']} ({d['device_ms']:.2f} ms)" if "kernels" in d else f"{d['aten_ops']}"

    counted = "infer_launches" in rows[0]
    extra = (" inference launches | training launches |", "---|---|") if counted else ("", "")
    lines = [header, "", "| model | inference ms | x dense | training ms | x dense | training peak MB |"
             + extra[0], "|---|---|---|---|---|---|" + extra[1]]
    for r in rows:
        peak = "-" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.0f}"
        more = f" {launched(r['infer_launches'])} | {launched(r['train_launches'])} |" if counted else ""
        lines.append(f"| {r['model']} | {r['infer_ms']['median']:.1f} | {_spread(r['infer_x_dense'])} | "
                     f"{r['train_ms']['median']:.1f} | {_spread(r['train_x_dense'])} | {peak} |" + more)
    return "\n".join(lines) + "\n"


def write_record(out: Optional[str], table: str, record: Dict) -> None:
    """The table to ``out`` and the record (every number) to ``out``'s ``.json`` sibling."""
    if out:
        Path(out).write_text(table)
        Path(out).with_suffix(".json").write_text(json.dumps(record, indent=1))


def bench_models(pairs: Optional[Sequence[str]] = None, batch: int = 2, img_size: Optional[int] = None,
                 rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0, device: str = "auto",
                 dtype: str = "float32", threads: Optional[int] = None, quick: bool = False, out: Optional[str] = None,
                 attention: Optional[Dict] = None, kernels: Optional[Kernels] = None, compile_models: bool = False,
                 compile_mode: str = "default", count_launches: bool = False) -> List[Dict]:
    """Images/s of each ``moh:dense`` pair (inference and training), print the table and return its rows; ``out`` also
    gets the table, and every number goes to ``<out>.json``. ``quick``: one small pair at 64 px. ``attention``: the MoH
    side's attention in every layer (e.g. ``{"name": "moh", "activation_ratio": 0.5}``; None: as registered);
    ``kernels``: both models' kernels config; ``compile_models``: every model ``torch.compile``d with ``compile_mode``;
    ``count_launches``: two more columns (:func:`launches`)."""
    from moh_vision.models import model_family
    if threads:
        torch.set_num_threads(threads)
    where, torch_dtype = resolve_device(device), DTYPES[dtype]
    kernels = Kernels.of(kernels)
    rows = []
    for pair in pairs or (QUICK_PAIRS if quick else DEFAULT_PAIRS):
        moh, _, dense = pair.partition(":")
        if not dense:
            raise ConfigError(f"pairs wants moh:dense, got {pair}")
        size = img_size or (64 if quick else (256 if model_family(moh) == "dit" else 224))
        rows += bench_pair(moh, dense, batch, size, rounds, warmup, min_seconds, where, torch_dtype, attention,
                           kernels, compile_models, compile_mode, count_launches)
    mode = "" if compile_mode == "default" else f" (mode {compile_mode})"
    compiled = f", every model torch.compile'd{mode}" if compile_models else ""
    header = (f"{where_measured(where)}, {dtype}, batch {batch}{compiled}, kernels {kernels_text(kernels)}; dense and "
              f"MoH interleaved, {rounds}+ rounds: median ms per step, and the per-round ratio to the dense twin as "
              f"median [quartiles]")
    table = models_table(rows, header)
    print(table)
    write_record(out, table, {"header": header, "torch": torch.__version__, "kernels": kernels.as_dict(), "rows": rows})
    return rows


# -- One model under several kernels configs (``tools/bench_kernels.py``) ----------------------------------------------
def kernels_text(kernels: Kernels) -> str:
    """``auto`` when every entry is ``auto``, else the entries that are not, ``routing=reference,...``."""
    changed = [f"{key}={value}" for key, value in kernels.as_dict().items() if value != "auto"]
    return ",".join(changed) or "auto"


def parse_kernels(text: str) -> Kernels:
    """``auto``, ``reference`` (every entry), or ``key=value`` entries joined by ``+`` (the rest ``auto``)."""
    if text in ("auto", "reference"):
        return Kernels(**{key: text for key in Kernels().as_dict()})
    entries = dict(part.split("=", 1) if "=" in part else (part, "") for part in text.split("+"))
    if any(not value for value in entries.values()):
        raise ConfigError(f"kernels variant '{text}': give auto, reference or key=value entries joined by '+'")
    return Kernels.of(entries)


def bench_kernels(model: str, variants: Sequence[str] = ("auto", "reference"), batch: int = 4,
                  img_size: Optional[int] = None, rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0,
                  device: str = "auto", dtype: str = "float32", threads: Optional[int] = None,
                  attention: Optional[Dict] = None, saved: bool = True, out: Optional[str] = None) -> List[Dict]:
    """``model`` (with ``attention``, if given) under each ``kernels`` variant (:func:`parse_kernels`), the same
    weights, its inference and training steps interleaved round by round: ms, the per-round ratio to the first variant
    (``x first``), the training peak memory and (``saved``) the MiB per image autograd keeps for backward
    (:func:`saved_tensor_bytes`)."""
    from moh_vision.models import build_model, model_family
    if threads:
        torch.set_num_threads(threads)
    where, torch_dtype = resolve_device(device), DTYPES[dtype]
    if img_size is None and model_family(model) != "dit":  # the model's own size (DiT: 256px, 32x32 latents)
        with torch.device("meta"):
            img_size = build_model(model, attention=attention).pretrained_cfg["input_size"][-1]
    size = img_size or 256
    models = {variant: build_for_bench(model, size, where, attention, parse_kernels(variant)) for variant in variants}
    first = models[variants[0]]
    for m in models.values():
        m.load_state_dict(first.state_dict())
    timed = time_candidates(models, variants[0], batch, rounds, warmup, min_seconds, where, torch_dtype,
                            f"{model}, kernels {' / '.join(variants)}")
    rows = []
    for variant, row in timed.items():
        kernels = parse_kernels(variant)
        row = {"model": model, "kernels": variant, "resolved": kernels.as_dict(), "in_use": resolved(kernels, where),
               "batch": batch, "img_size": size, **row}
        if saved:
            step = make_step(models[variant], batch, where, True, torch_dtype)
            row["saved_mib_per_image"] = saved_tensor_bytes(step, models[variant].parameters()) / batch / 2 ** 20
        rows.append(row)
    label = model if attention is None else f"{model} ({attention_label(attention)})"
    header = (f"{label} at {size} px, {where_measured(where)}, {dtype}, batch {batch}; the kernels variants "
              f"interleaved, {rounds}+ rounds: median ms per step, and the per-round ratio to the first variant "
              f"({variants[0]}) as median [quartiles]")
    lines = [header, "", "| kernels | inference ms | x first | training ms | x first | training peak MB | saved MiB/img |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.0f}"
        kept = f"{r['saved_mib_per_image']:.1f}" if "saved_mib_per_image" in r else "-"
        lines.append(f"| {r['kernels']} | {r['infer_ms']['median']:.1f} | {_spread(r['infer_x_base'])} | "
                     f"{r['train_ms']['median']:.1f} | {_spread(r['train_x_base'])} | {peak} | {kept} |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_record(out, table, {"header": header, "torch": torch.__version__, "machine": where_measured(where),
                        "rows": rows})
    return rows
