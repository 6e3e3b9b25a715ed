"""Where a run's time goes: data wait and step time, achieved TFLOP/s and utilisation, peak memory (each figure's
definition and how to read it: ``docs/training.md``).

``StepClock`` reads the host clock around ``next(loader)`` (the *data wait*) and once per optimizer step (the *step
time*: everything between two steps, data wait, logging and checkpoints included), with no synchronisation beyond the
loop's own. On CUDA a step never waits for the device (``step_on_device``): one step's host time is when it was queued,
the clock synchronises at the end of each logging window, so a window's sum is exact, and the data wait bounds the
device's idle time from above. Under DDP every figure is the slowest rank's (one small MAX all-reduce per window and per
epoch). :meth:`RunCosts.rates` gives the same keys for a logging window (``train/...``), an epoch row (``epoch/...``)
and ``summary.json``: ``tflops`` counts 2 FLOPs per multiply-add (:mod:`moh_vision.analysis.device_peaks`) and is absent
without a FLOP count, ``utilisation`` is absent without a known peak (every CPU), and a data wait of
:data:`INPUT_BOUND_SHARE` of the step or more reads as input-bound. Peak memory: the CUDA allocator's peak, reset every
training epoch, or the main process's resident-set peak since it started (``ru_maxrss``)."""
from __future__ import annotations

import sys
import time
from dataclasses import astuple, dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from moh_vision.analysis.device_peaks import device_name, peak_tflops, run_precision, training_gflops_per_image
from .distributed import DistInfo, all_reduce_max

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
