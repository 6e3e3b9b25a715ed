"""The trainer's running records, each saved in checkpoints so a resumed run reports as an uninterrupted one: epoch
meters (``EpochMeters``), throughput (``Throughput``) and unreadable images (``SkippedFiles``); and the routing files
written at the end of an epoch; and where a run's time goes (``StepClock``, ``StepTimes``, ``RunCosts``: data wait and
step time, achieved TFLOP/s, peak memory)."""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from moh_vision.analysis.device_peaks import device_name, peak_tflops, run_precision, training_gflops_per_image
from moh_vision.analysis.routing_stats import RoutingMeter

from .distributed import DistInfo, all_reduce_max, reduce_sums
from .loggers import Loggers

log = logging.getLogger(__name__)


class EpochMeters:
    """Sample-weighted sums of this epoch's training outputs on this rank (``loss``, ``ce``, ``aux``, every
    ``log/<name>``, and ``count``) over the steps not skipped, its routing statistics and its step times (``times``)."""

    def __init__(self, state: Optional[Mapping[str, Any]] = None):
        """Empty meters, or those of a checkpoint's ``meters`` entry (a mid-epoch resume)."""
        state = state or {}
        self.sums: Dict[str, float] = {"loss": 0.0, "count": 0.0, **(state.get("sums") or {})}
        self.routing = RoutingMeter()
        self.routing.load_state_dict(state.get("routing") or {})
        self.times = StepTimes(**(state.get("times") or {}))

    def state_dict(self) -> Dict[str, Any]:
        return {"sums": dict(self.sums), "routing": self.routing.state_dict(), "times": asdict(self.times)}

    def add(self, out: Mapping[str, Any]) -> None:
        """One training step's loss dict (see ``Task.training_step``)."""
        n = float(out["num_samples"])
        for key, value in out.items():
            if key in ("loss", "ce", "aux"):
                self.sums[key] = self.sums.get(key, 0.0) + float(value.detach()) * n
            elif key.startswith("log/"):
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * n
        self.sums["count"] += n
        self.routing.update(out.get("routing") or {})

    def row(self, dist: DistInfo) -> Dict[str, float]:
        """The epoch row's training columns, averaged over all ranks' samples, and this rank's routing."""
        sums = reduce_sums(self.sums, dist, dist.device)
        n = max(sums.get("count", 0.0), 1.0)
        row = {f"train/epoch_{key}": sums[key] / n for key in ("loss", "ce", "aux") if key in sums}
        row.update({f"train/{key[4:]}": value / n for key, value in sums.items() if key.startswith("log/")})
        row.update(self.routing.summary(prefix="routing"))
        return row


class StepWindow:
    """What one per-step log row averages over the optimizer steps since the previous row: ``train/loss`` and its
    parts (``train/ce``, ``train/aux``), the gradient norm before clipping (``train/grad_norm``) and the routers' mean
    entropy over routed layers (``train/router_entropy``, nats: routing trouble shows within tens of steps); ``times``
    are the window's step times (the row's rates: ``RunCosts.rates``)."""

    PARTS = ("ce", "aux")

    def __init__(self):
        self.sums: Dict[str, float] = {}
        self.counts: Dict[str, int] = {}
        self.steps = 0
        self.times = StepTimes()

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def add(self, out: Mapping[str, Any], grad_norm: Optional[float]) -> None:
        """One optimizer step: its last micro-batch's loss dict and the gradient norm (None: not stepped)."""
        if grad_norm is None:
            return
        self.steps += 1
        self._add("loss", float(out["loss"].detach()))
        for key in self.PARTS:
            if key in out:
                self._add(key, float(out[key]))
        if math.isfinite(grad_norm):  # fp16: an overflowing step the scaler skipped has an inf norm
            self._add("grad_norm", grad_norm)
        entropies = [float(st["entropy"]) for st in (out.get("routing") or {}).values()
                     if st.get("entropy") is not None and st.get("topk", 0) > 0]
        if entropies:
            self._add("router_entropy", sum(entropies) / len(entropies))

    def row(self) -> Dict[str, float]:
        return {f"train/{key}": self.sums[key] / self.counts[key] for key in self.sums}


class Throughput:
    """Training time, data wait and images over the whole run, and its peak memory. The first ``warmup_steps``
    optimizer steps of every process (compile, allocator and cudnn warm-up) are counted apart (:meth:`steady`)."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps
        self.record = {"time": 0.0, "samples": 0, "steps": 0, "data_wait": 0.0, "warmup_time": 0.0,
                       "warmup_samples": 0, "warmup_steps": 0, "warmup_data_wait": 0.0, "peak_memory_mb": None}
        self.steps_this_process = 0

    def state_dict(self) -> Dict[str, Any]:
        return dict(self.record)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.record.update(state)

    def count(self, seconds: float, samples: int, data_wait: float = 0.0) -> None:
        """One optimizer step's time, images (all ranks) and time blocked on the loader."""
        prefix = "warmup_" if self.steps_this_process < self.warmup_steps else ""
        self.record[prefix + "time"] += seconds
        self.record[prefix + "samples"] += samples
        self.record[prefix + "steps"] += 1
        self.record[prefix + "data_wait"] += data_wait
        self.steps_this_process += 1

    def note_peak_memory(self, mb: float) -> None:
        previous = self.record["peak_memory_mb"]
        self.record["peak_memory_mb"] = mb if previous is None else max(previous, mb)

    def steady(self) -> StepTimes:
        """The steps after the warm-up; a run too short for any step after it: the warm-up steps."""
        tp = self.record
        prefix = "" if tp["steps"] or not tp["warmup_steps"] else "warmup_"
        return StepTimes(tp[prefix + "time"], tp[prefix + "data_wait"], tp[prefix + "steps"], tp[prefix + "samples"])

    def images_per_sec(self) -> float:
        """After the warm-up (:meth:`steady`); NaN before any step."""
        times = self.steady()
        return times.samples / max(times.seconds, 1e-9) if times.steps else float("nan")

    def train_time(self) -> float:
        return self.record["time"] + self.record["warmup_time"]

    def compile_time(self) -> float:
        """The warm-up's time beyond that of as many steady steps (what compiling cost)."""
        tp = self.record
        if not tp["warmup_steps"]:
            return 0.0
        steady = tp["time"] / tp["steps"] if tp["steps"] else 0.0
        return max(0.0, tp["warmup_time"] - tp["warmup_steps"] * steady)


class SkippedFiles:
    """Unreadable images: the distinct files per split over the whole run, each named once in train.log (by the
    process that ``announce``s, rank 0: other ranks' files when :meth:`gather` brings them over), plus skips reported
    by data that do not name their files (counted as events, this process only)."""

    def __init__(self, announce: bool = True):
        self.files: Dict[str, Dict[str, str]] = {"train": {}, "val": {}}  # split -> {path: reason}
        self.unnamed = 0
        self.announce = announce

    def state_dict(self) -> Dict[str, Dict[str, str]]:
        return {split: dict(files) for split, files in self.files.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.files = {split: dict(state.get(split) or {}) for split in ("train", "val")}

    def note(self, split: str, batch: Any, reported: Any = 0) -> None:
        """The skips of one batch: its third element, else what the task reported."""
        skipped = batch[2] if isinstance(batch, (tuple, list)) and len(batch) == 3 else reported
        files = getattr(skipped, "files", None)
        if files is None:  # the data count their skips but do not name them
            self.unnamed += int(skipped or 0)
            return
        for path, reason in files:
            self._add(split, path, reason)

    def noting(self, split: str, loader: Any) -> "_NotingLoader":
        """``loader``, noting the skips of every batch it yields."""
        return _NotingLoader(loader, lambda batch: self.note(split, batch))

    def gather(self, dist: DistInfo) -> int:
        """Merge every rank's files (rank 0 names the new ones); the run's skip count."""
        if dist.enabled:
            import torch.distributed as tdist
            gathered = [None] * dist.world_size
            tdist.all_gather_object(gathered, self.files)
            for other in gathered:
                for split, files in (other or {}).items():
                    for path, reason in files.items():
                        self._add(split, path, reason)
        return sum(len(files) for files in self.files.values()) + self.unnamed

    def row(self) -> Dict[str, int]:
        """``train/skipped_images`` and ``val/skipped_images``: distinct unreadable files so far."""
        return {f"{split}/skipped_images": len(files) for split, files in self.files.items()}

    def _add(self, split: str, path: str, reason: str) -> None:
        if path not in self.files[split]:
            self.files[split][path] = reason
            if self.announce:
                log.warning("skipped unreadable %s image %s (%s)", split, path, reason)


class _NotingLoader:
    """A loader that hands every batch to ``note`` before yielding it."""

    def __init__(self, loader: Any, note: Callable[[Any], None]):
        self.loader, self.note = loader, note

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.note(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def write_routing_artifacts(routing: RoutingMeter, out_dir: Path, loggers: Loggers, epoch: int, step: int,
                            last_epoch: bool) -> None:
    """routing.json (per-layer head loads and entropy, every epoch; learned shared-head masks), the head-load heatmap
    routing_head_load.png and, when a layer learns its shared heads, routing_shared_heads.png (uploaded to wandb when
    on). The figures are drawn every epoch for wandb, else once at the last epoch (about 0.2 s each)."""
    if not routing.layers:
        return
    routing.dump(out_dir / "routing.json", epoch)
    if not last_epoch and loggers.wandb is None:
        return
    from moh_vision.analysis import routing_plots
    if routing_plots.has_learned_shared_heads(routing.averages()):
        epochs = json.loads((out_dir / "routing.json").read_text())
        path = routing_plots.plot_shared_heads(epochs, out_dir / "routing_shared_heads.png")
        loggers.log_image("routing/shared_heads", path, step=step, caption=f"epoch {epoch}")
    path = routing_plots.plot_head_load(routing.averages(), out_dir / "routing_head_load.png",
                                        title=f"head load, epoch {epoch}")
    loggers.log_image("routing/head_load", path, step=step, caption=f"epoch {epoch}")


# -- Where a run's time goes -------------------------------------------------------------------------------------------
# Where a run's time goes: data wait and step time, achieved TFLOP/s and utilisation, peak memory (each figure's
# definition and how to read it: ``docs/training.md``).
#
# ``StepClock`` reads the host clock around ``next(loader)`` (the *data wait*) and once per optimizer step (the *step
# time*: everything between two steps, data wait, logging and checkpoints included), with no synchronisation beyond the
# loop's own. On CUDA a step never waits for the device (``step_on_device``): one step's host time is when it was
# queued, the clock synchronises at the end of each logging window, so a window's sum is exact, and the data wait bounds
# the device's idle time from above. Under DDP every figure is the slowest rank's (one small MAX all-reduce per window
# and per epoch). :meth:`RunCosts.rates` gives the same keys for a logging window (``train/...``), an epoch row
# (``epoch/...``) and ``summary.json``: ``tflops`` counts 2 FLOPs per multiply-add
# (:mod:`moh_vision.analysis.device_peaks`) and is absent without a FLOP count, ``utilisation`` is absent without a
# known peak (every CPU), and a data wait of :data:`INPUT_BOUND_SHARE` of the step or more reads as input-bound. Peak
# memory: the CUDA allocator's peak, reset every training epoch, or the main process's resident-set peak since it
# started (``ru_maxrss``).
INPUT_BOUND_SHARE = 0.1  # data wait at or above this share of the step time: the loader holds the run back
# What the machine's speed and load decide, not the training (left out where runs are compared for equality).
MEASURED = ("step_ms", "data_wait_ms", "data_wait_share", "images_per_sec", "tflops", "utilisation", "peak_memory_mb")
_END = object()


def _rate(per_sec: float) -> str:
    """Images a second as the console says it: whole above 100 (a GPU's 1830), three digits below (a CPU's 1.23)."""
    return f"{per_sec:.0f}" if per_sec >= 100 else f"{per_sec:.3g}"


def slowest(values: Sequence[float], dist: DistInfo) -> List[float]:
    """Each of ``values`` at its largest over ranks: one all-reduce of one small tensor (none in one process)."""
    if not dist.enabled:
        return [float(v) for v in values]
    return all_reduce_max(torch.tensor(values, dtype=torch.float64, device=dist.device), dist).tolist()


@dataclass
class StepTimes:
    """Seconds of optimizer steps, the part spent waiting for batches, the steps and their images (all ranks')."""
    seconds: float = 0.0
    data_wait: float = 0.0
    steps: int = 0
    samples: int = 0

    def add(self, seconds: float, data_wait: float, samples: int) -> None:
        self.seconds += seconds
        self.data_wait += data_wait
        self.steps += 1
        self.samples += samples

    @classmethod
    def of(cls, values: Sequence[float]) -> "StepTimes":
        """From ``[seconds, data_wait, steps, samples]`` (an all-reduced tensor's values)."""
        seconds, data_wait, steps, samples = values
        return cls(seconds, data_wait, int(steps), int(samples))

    def slowest(self, dist: DistInfo) -> "StepTimes":
        return StepTimes.of(slowest(astuple(self), dist))


class StepClock:
    """Host wall time of each optimizer step, and the part of it blocked on the loader."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = time.perf_counter()
        self.waited = 0.0

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``loader``'s batches, timing each ``next``; the first step's clock starts here, so the loader's start (worker
        processes, their first batches) counts as data wait."""
        start = self.last = time.perf_counter()
        self.waited = 0.0
        iterator = iter(loader)
        while True:
            batch = next(iterator, _END)
            self.waited += time.perf_counter() - start
            if batch is _END:
                return
            yield batch
            start = time.perf_counter()

    def restart(self) -> None:
        """The next lap starts now: time spent between steps on other work (the task's FID) is no step's."""
        self.last, self.waited = time.perf_counter(), 0.0

    def lap(self, sync: bool = False) -> Tuple[float, float]:
        """``(seconds, data wait)`` since the previous lap; ``sync``: wait for the device first (a window's end)."""
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds, waited = now - self.last, min(self.waited, now - self.last)
        self.last, self.waited = now, 0.0
        return seconds, waited


# -- Peak memory -------------------------------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA allocator peak (the CPU's resident-set peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """MiB at the peak: CUDA allocator since the last reset, or this process's resident set since it started."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource  # POSIX only, as the CPU figure is
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2 ** 20 if sys.platform == "darwin" else rss / 2 ** 10  # bytes on macOS, KiB on Linux


def peak_memory_source(device: torch.device) -> str:
    return "CUDA allocator peak, reset every epoch (torch.cuda.max_memory_allocated)" if device.type == "cuda" else \
        "main process resident-set peak since it started (ru_maxrss)"


# -- Rates and their text ----------------------------------------------------------------------------------------------
class RunCosts:
    """What a run's step times turn into: rates per window, epoch and run, and their console text.

    ``flops``: one forward's FLOP report (``FitParts.flops``; empty when not counted); ``amp``: ``trainer.amp`` (which
    precision's peak applies); ``world_size``: processes, one device each (utilisation is against all their peaks)."""

    def __init__(self, flops: Mapping[str, Any], device: torch.device, amp: str, world_size: int):
        self.device, self.world_size = device, world_size
        self.gflops_per_image = training_gflops_per_image(flops)
        self.device_name = device_name(device)
        self.precision = run_precision(amp)
        self.peak_tflops = peak_tflops(self.device_name, self.precision) if device.type == "cuda" else None

    def rates(self, times: StepTimes, prefix: str) -> Dict[str, float]:
        """The module docstring's keys with ``prefix`` (``tflops``, ``utilisation`` where known); none for no steps."""
        if not times.steps or times.seconds <= 0:
            return {}
        images_per_sec = times.samples / times.seconds
        row = {"step_ms": 1e3 * times.seconds / times.steps, "data_wait_ms": 1e3 * times.data_wait / times.steps,
               "data_wait_share": times.data_wait / times.seconds, "images_per_sec": images_per_sec}
        if self.gflops_per_image is not None:
            row["tflops"] = self.gflops_per_image * images_per_sec / 1e3
            if self.peak_tflops:
                row["utilisation"] = row["tflops"] / (self.peak_tflops * self.world_size)
        return {prefix + key: value for key, value in row.items()}

    def epoch_row(self, times: StepTimes, dist: DistInfo) -> Dict[str, float]:
        """An epoch's rates and its peak memory (``epoch/...``), the slowest rank's: one all-reduce."""
        *summed, peak = slowest([*astuple(times), peak_memory_mb(self.device)], dist)
        row = self.rates(StepTimes.of(summed), "epoch/")
        row["epoch/peak_memory_mb"] = peak
        return row

    def summary(self, times: StepTimes, peak_mb: Optional[float]) -> Dict[str, Any]:
        """summary.json's costs: rates of ``times``, training FLOPs per image, the device's peak, peak memory."""
        out: Dict[str, Any] = {**self.rates(times, ""), "device": self.device_name, "precision": self.precision}
        if self.gflops_per_image is not None:
            out["train_gflops_per_image"] = self.gflops_per_image
        if self.peak_tflops:
            out["device_peak_tflops"] = self.peak_tflops  # of one device; utilisation is against all of them
        if peak_mb is not None:
            out["peak_memory_mb"] = peak_mb
            out["peak_memory_source"] = peak_memory_source(self.device)
        return out

    def describe(self) -> str:
        """The run's FLOPs per training image and the peak its utilisation is measured against, in words."""
        work = ("FLOPs not counted: no TFLOP/s" if self.gflops_per_image is None else
                f"{self.gflops_per_image:.4g} GFLOPs per training image (3 x the active forward, 2 per multiply-add)")
        peak = (f"{self.device_name}: {self.peak_tflops:g} TFLOP/s dense {self.precision} peak" if self.peak_tflops
                else f"{self.device_name}: no {self.precision} peak known, utilisation not reported")
        return f"{work}; {peak}"

    def text(self, values: Mapping[str, Any], prefix: str) -> str:
        """One line of rates (keys ``<prefix>step_ms``, ...) for the console; what is absent is said."""
        def get(key: str) -> Any:
            return values.get(prefix + key)

        if get("step_ms") is None:
            return "no timed steps"
        share = get("data_wait_share")
        verdict = "input-bound" if share >= INPUT_BOUND_SHARE else "not input-bound"
        parts = [f"step {get('step_ms'):.1f} ms", f"data wait {get('data_wait_ms'):.1f} ms ({share:.1%}: {verdict})",
                 f"{_rate(get('images_per_sec'))} images/s"]
        if get("tflops") is not None:
            utilisation = get("utilisation")
            parts.append(f"{get('tflops'):.3g} TFLOP/s" + (f" ({utilisation:.1%} of peak)" if utilisation is not None
                                                           else " (no device peak: utilisation not reported)"))
        else:
            parts.append("TFLOP/s not reported (FLOPs not counted)")
        if get("peak_memory_mb") is not None:
            source = "CUDA allocator" if self.device.type == "cuda" else "process RSS since start"
            parts.append(f"peak memory {get('peak_memory_mb'):.0f} MiB ({source})")
        return ", ".join(parts)
