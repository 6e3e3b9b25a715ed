"""The trainer's running records, each saved in checkpoints so a resumed run reports as an uninterrupted one: epoch
meters (``EpochMeters``), throughput (``Throughput``) and unreadable images (``SkippedFiles``); and the routing files
written at the end of an epoch. Step times are ``costs.StepTimes``."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

from moh_vision.analysis.routing_stats import RoutingMeter
from .costs import StepTimes
from .distributed import DistInfo, reduce_sums
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
