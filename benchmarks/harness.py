"""The timing every script of ``benchmarks/`` shares: dense and MoH side by side in one process, a median and a spread
per figure.

Every timing benchmark (``benchmarks/bench_models.py``, ``bench_kernels.py``, ``bench_backbones.py``, ``bench_data.py``)
times its candidates with :func:`interleave`: after a warm-up, each *round* calls every candidate once, in an order that
rotates from round to round, each call timed on its own. A slow phase of the machine then hits all candidates of a round
alike, and the ratio of two candidates is taken *per round* (:func:`paired_ratio`), whose median and quartiles the
tables report. Here too: what a step keeps in memory (:func:`peak_memory`, :func:`saved_tensor_bytes`) and launches
(:func:`launches`), a model built for a benchmark and its step (:func:`build_for_bench`, :func:`make_step`), and the
record a run writes (:func:`write_record`)."""
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
from moh_vision.checkpoints import atomic_write
from moh_vision.cli import Option, integer, number
from moh_vision.ops import Kernels


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
# What every timing script (bench_models.py, bench_kernels.py, bench_backbones.py) takes after its rounds.
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


# -- A model, its inputs and its steps --------------------------------------------------------------------------------
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


def attention_label(attention: Dict) -> str:
    """``moh 0.5`` for ``{"name": "moh", "activation_ratio": 0.5, ...}`` (the options a row was run with)."""
    ratio = attention.get("activation_ratio")
    return attention.get("name", "?") + ("" if ratio is None else f" {ratio:g}")


def spread_text(d: Dict[str, float]) -> str:
    return f"{d['median']:.3f} [{d['q1']:.3f}-{d['q3']:.3f}]"


def write_record(out: Optional[str], table: str, record: Dict) -> None:
    """The table to ``out`` and the record (every number) to ``out``'s ``.json`` sibling."""
    if out:
        Path(out).write_text(table)
        Path(out).with_suffix(".json").write_text(json.dumps(record, indent=1))


def print_json_record(record: Dict, out: Optional[str]) -> Dict:
    """Print ``record`` as JSON and, if ``out``, write it there atomically; returns ``record``."""
    text = json.dumps(record, indent=1) + "\n"
    print(text, end="")
    if out:
        atomic_write(out, lambda f: f.write(text.encode()), what="record")
    return record


def kernels_text(kernels: Kernels) -> str:
    """``auto`` when every entry is ``auto``, else the entries that are not, ``routing=reference,...``."""
    changed = [f"{key}={value}" for key, value in kernels.as_dict().items() if value != "auto"]
    return ",".join(changed) or "auto"
