"""The one training loop, for every task.

``Trainer(cfg, ...).fit(task, data)``: the task turns a batch into a loss dict and evaluates; the
trainer owns everything else: devices and DDP, samplers that resume mid-epoch, AdamW and the
schedule, accumulation, AMP, clipping, EMA, checkpoints, logging, routing statistics,
preemption and non-finite steps.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from moh_vision.analysis.routing_stats import RoutingMeter
from moh_vision.attention import after_optimizer_step
from moh_vision.errors import ConfigError, RunError
from moh_vision.models import unwrap_model
from moh_vision import checkpoints as ckpt_io
from .rng_state import capture_rng, restore_rng
from .distributed import DistInfo, all_reduce_sum, broadcast_object, reduce_sums
from .ema import EMA
from .loggers import Loggers, write_json
from .optim import Schedule, build_optimizer
from moh_vision.data.sampler import EpochSampler, SeededItems

log = logging.getLogger(__name__)

# SLURM sends SIGTERM on preemption and, with --signal, SIGUSR1/SIGUSR2 before a time limit
# (the submitit launcher uses SIGUSR2 and requeues the job from its own handler).
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


class Preempted(Exception):
    """Raised after a preemption signal once the step finished and the checkpoint is saved."""


class NonFiniteLoss(RunError):
    """Too many non-finite steps in a row."""


def _missing(value: Any) -> bool:
    """No result: absent, None, or a non-finite number (summary.json stores those as "nan" strings)."""
    if value is None:
        return True
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    return isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf")


class _NotingSkips:
    """A loader that hands every batch to ``note`` before yielding it (names unreadable val images)."""

    def __init__(self, loader, note: Callable[[Any], None]):
        self.loader, self.note = loader, note

    def __iter__(self):
        for batch in self.loader:
            self.note(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def flops_text(flops: Dict[str, float]) -> str:
    if "gflops" not in flops:
        return "FLOPs not counted"
    active = f", {flops['active_gflops']:.4g} active" if "active_gflops" in flops else ""
    return f"{flops['gflops']:.4g} GFLOPs{active} per image"


class Trainer:
    def __init__(self, cfg: Dict[str, Any], out_dir: Path, dist: DistInfo, loggers: Loggers,
                 optim: Dict[str, Any], sched: Dict[str, Any], config: Optional[Dict[str, Any]] = None,
                 seed: int = 0):
        self.cfg, self.out_dir, self.dist, self.loggers = dict(cfg), Path(out_dir), dist, loggers
        self.optim_cfg, self.sched_cfg, self.config, self.seed = dict(optim), dict(sched), config or {}, int(seed)
        self.device = dist.device
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best: Dict[str, Any] = {}
        self.counters = {"nonfinite_skipped": 0, "nonfinite_in_a_row": 0, "skipped_images": 0}
        # unreadable images: split -> {path: reason}, distinct files over the whole run (saved in checkpoints)
        self.skipped_files: Dict[str, Dict[str, str]] = {"train": {}, "val": {}}
        self._unnamed_skips = 0  # skips reported by data that does not name its files (counted as events)
        # training time and images, whole run (saved in checkpoints): the first throughput_warmup_steps
        # optimizer steps of every process (torch.compile, allocator and cudnn warm-up) are kept apart
        self.throughput = {"time": 0.0, "samples": 0, "steps": 0, "warmup_time": 0.0, "warmup_samples": 0,
                           "warmup_steps": 0}
        self._steps_this_process = 0
        self.steps_at_start = 0
        self._stop_signal: Optional[str] = None
        self.last_good_checkpoint: Optional[str] = None

    # ------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------
    def _seed_everything(self) -> None:
        import random

        import numpy as np
        s = self.seed + self.dist.rank
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)
        if self.cfg.get("deterministic"):
            torch.use_deterministic_algorithms(True, warn_only=True)
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
                torch.backends.cudnn.benchmark = False

    def amp_context(self) -> Callable[[], contextlib.AbstractContextManager]:
        amp = self.cfg.get("amp") or "none"
        if amp in ("none", False, "fp32"):
            return contextlib.nullcontext
        if amp not in ("bf16", "fp16"):
            raise ConfigError(f"trainer.amp={amp} is unknown; use none, bf16 or fp16")
        dtype = torch.bfloat16 if amp == "bf16" else torch.float16
        return lambda: torch.autocast(self.device.type, dtype=dtype)

    def _loaders(self, data, task) -> None:
        accum = int(self.cfg.get("grad_accum", 1))
        global_batch = int(self.cfg["batch_size"])
        if global_batch % (self.dist.world_size * accum):
            raise ConfigError(f"trainer.batch_size={global_batch} must be divisible by world size "
                              f"{self.dist.world_size} x grad_accum {accum}")
        self.per_rank_batch = global_batch // (self.dist.world_size * accum)
        self.train_items = SeededItems(data.train, seed=self.seed)
        self.train_sampler = EpochSampler(len(data.train), shuffle=True, seed=self.seed, rank=self.dist.rank,
                                          world_size=self.dist.world_size, repeats=data.repeated_aug, drop_last=True)
        if len(self.train_sampler) < self.per_rank_batch:
            raise ConfigError(f"trainer.batch_size={global_batch} is larger than the training set "
                              f"({len(data.train)} items) allows per rank")
        workers = int(self.cfg.get("num_workers", 0))
        # Own generators: making a loader iterator draws a base seed, which must not come from the global
        # RNG, or a run resumed mid-epoch would diverge from an uninterrupted one.
        common = dict(num_workers=workers, collate_fn=data.collate_fn, pin_memory=self.device.type == "cuda",
                      persistent_workers=False, multiprocessing_context="fork" if workers > 0 else None)
        self.train_loader = DataLoader(self.train_items, batch_size=self.per_rank_batch, sampler=self.train_sampler,
                                       drop_last=True, generator=torch.Generator(), **common)
        val_indices = list(range(self.dist.rank, len(data.val), self.dist.world_size))
        self.val_loader = DataLoader(data.val, batch_size=int(self.cfg.get("val_batch_size") or self.per_rank_batch),
                                     sampler=val_indices, shuffle=False, generator=torch.Generator(), **common)
        self.accum = accum
        self.steps_per_epoch = len(self.train_sampler) // self.per_rank_batch // accum
        if self.steps_per_epoch < 1:
            raise ConfigError("an epoch has no optimizer step; lower trainer.batch_size or trainer.grad_accum")

    def _total_steps(self) -> int:
        epochs = int(self.cfg["epochs"])
        total = epochs * self.steps_per_epoch
        if self.cfg.get("max_steps"):
            total = min(total, int(self.cfg["max_steps"]))
        return total

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    def _state(self) -> Dict[str, Any]:
        rng = capture_rng()
        if self.dist.enabled:
            import torch.distributed as tdist
            gathered = [None] * self.dist.world_size
            tdist.all_gather_object(gathered, rng)
            rng = gathered
        state = {
            "format": ckpt_io.FORMAT_VERSION,
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "rng": rng, "world_size": self.dist.world_size,
            "best": dict(self.best), "counters": dict(self.counters),
            "skipped_files": {split: dict(files) for split, files in self.skipped_files.items()},
            "throughput": dict(self.throughput),
            "meters": self.meters_state(),
            "config": self.config, "model_name": self.model_name,
            "wandb_run_id": self.loggers.run_id,
        }
        if self.ema is not None:
            state["model_ema"] = self.ema.state_dict()
            state["ema_updates"] = self.ema.updates
        return state

    def save(self, name: str = "last.pt") -> None:
        state = self._state()  # every rank joins the RNG gather
        if self.dist.is_main:
            path = self.ckpt_dir / name
            ckpt_io.atomic_save(state, path, keep_previous=name == "last.pt")
            if name == "last.pt":
                self.last_good_checkpoint = str(path)

    def _resume(self) -> None:
        path = ckpt_io.resolve_resume(self.cfg.get("resume", "auto"), self.out_dir)
        if path is None:
            return
        state, used = ckpt_io.load_with_fallback(path)
        problem = ckpt_io.state_dict_mismatch(unwrap_model(self.model).state_dict(), state["model"])
        if problem or (state.get("model_name") and state["model_name"] != self.model_name):
            raise ConfigError(f"cannot resume from {used}: it holds model '{state.get('model_name')}' and this run "
                              f"builds '{self.model_name}' ({problem or 'different model'})")
        unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and "model_ema" in state:
            self.ema.load_state_dict(state["model_ema"])
            self.ema.updates = int(state.get("ema_updates", 0))
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.best, self.counters = dict(state.get("best", {})), {**self.counters, **state.get("counters", {})}
        saved = state.get("skipped_files") or {}
        self.skipped_files = {split: dict(saved.get(split) or {}) for split in ("train", "val")}
        self.throughput.update(state.get("throughput") or {})
        self.steps_at_start = self.step
        self.load_meters(state.get("meters", {}))
        rng = state["rng"]
        if isinstance(rng, list):
            rng = rng[self.dist.rank] if len(rng) == self.dist.world_size else rng[0]
        restore_rng(rng)
        self.loggers.truncate_after(self.step)
        self.last_good_checkpoint = str(used)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", used, self.step, self.epoch, self.batch_in_epoch)

    # ------------------------------------------------------------------------------------------
    # meters (saved in checkpoints so epoch averages survive a mid-epoch resume)
    # ------------------------------------------------------------------------------------------
    def reset_meters(self) -> None:
        self.sums: Dict[str, float] = {"loss": 0.0, "count": 0.0}
        self.routing = RoutingMeter()

    def meters_state(self) -> Dict[str, Any]:
        return {"sums": dict(self.sums), "routing": self.routing.state_dict()}

    def load_meters(self, state: Dict[str, Any]) -> None:
        self.reset_meters()
        self.sums.update(state.get("sums", {}))
        self.routing.load_state_dict(state.get("routing", {}))

    # ------------------------------------------------------------------------------------------
    # signals
    # ------------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> Dict[int, Any]:
        previous = {}

        def handler(signum, _frame):
            self._stop_signal = signal.Signals(signum).name
            log.warning("received %s: finishing this step, saving, then exiting", self._stop_signal)

        for name in PREEMPT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    previous[sig] = signal.signal(sig, handler)
                except ValueError:  # not in the main thread
                    pass
        return previous

    def _hand_over_signal(self) -> None:
        """After saving, let a handler that was there before us (submitit's checkpoint-and-requeue)
        deal with the signal as it would have without us."""
        sig = getattr(signal, self._stop_signal or "", None)
        previous = self._previous_handlers.get(sig)
        if sig is None or not callable(previous) or previous in (signal.SIG_DFL, signal.SIG_IGN):
            return
        for s, handler in self._previous_handlers.items():
            signal.signal(s, handler)
        log.warning("checkpoint saved; handing %s to the launcher's handler", self._stop_signal)
        previous(sig, None)

    def _stop_requested(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_signal else 0.0], device=self.device)
        return bool(all_reduce_sum(flag, self.dist).item() > 0)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def fit(self, task, data) -> Dict[str, Any]:
        self._seed_everything()
        self.task = task
        self.model_name = task.model_cfg["name"]
        model = task.build_model(data).to(self.device)
        self.params = sum(p.numel() for p in model.parameters())
        self.flops = self._count_flops(model, task, data)
        self._loaders(data, task)
        self.optimizer = build_optimizer(model, **self.optim_cfg)
        sched = dict(self.sched_cfg)
        warmup_steps = int(round(float(sched.pop("warmup_epochs", 0)) * self.steps_per_epoch))
        warmup_steps += int(sched.pop("warmup_steps", 0))
        self.schedule = Schedule(sched.pop("name", "cosine"), self.optim_cfg["lr"], self._total_steps(),
                                 warmup_steps=warmup_steps, **sched)
        self.amp = self.amp_context()
        if self.cfg.get("val_at_start", "auto") not in ("auto", True, False):
            raise ConfigError(f"trainer.val_at_start={self.cfg.get('val_at_start')!r}; allowed: auto, true, false")
        self.scaler = torch.amp.GradScaler(self.device.type) if self.cfg.get("amp") == "fp16" else None
        ema_cfg = self.cfg.get("ema") or {}
        self.ema = EMA(model, float(ema_cfg.get("decay", 0.9999)), bool(ema_cfg.get("warmup", False))) \
            if ema_cfg.get("enabled") else None
        self.model = model
        self.reset_meters()
        self._resume()
        if self.dist.is_main:  # only now: a run that fails to set up must not overwrite a good run's config
            from omegaconf import OmegaConf
            OmegaConf.save(OmegaConf.create(self.config), self.out_dir / "config.yaml")
        self.train_model = self._wrap(model)
        if self.dist.is_main:
            log.info("%s | %s | %.2fM params | %s", self.model_name, data.describe(), self.params / 1e6,
                     flops_text(self.flops))
        self._previous_handlers = previous_handlers = self._install_signal_handlers()
        start = time.time()
        self.train_time, self.train_samples = 0.0, 0
        self.start_row: Dict[str, Any] = {}
        try:
            self._validate_before_training(task)
            self._run(task)
        except Preempted:
            raise
        finally:
            for sig, prev in previous_handlers.items():
                signal.signal(sig, prev)
        summary = self._summary(time.time() - start)
        if self.dist.is_main:
            write_json(self.out_dir / "summary.json", summary)
        return summary

    def _wrap(self, model: nn.Module) -> nn.Module:
        wrapped = model
        if self.cfg.get("compile"):
            wrapped = torch.compile(wrapped)
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DDP(wrapped, device_ids=ids)
        return wrapped

    def _run(self, task) -> None:
        total_steps = self._total_steps()
        epochs = int(self.cfg["epochs"])
        while self.epoch < epochs and self.step < total_steps:
            if self.batch_in_epoch >= self.steps_per_epoch * self.accum:
                self._end_epoch(task)  # the run stopped between the last step and validation
                continue
            self._train_epoch(task, total_steps)
            if self.batch_in_epoch >= self.steps_per_epoch * self.accum or self.step >= total_steps:
                self._end_epoch(task)

    def _train_epoch(self, task, total_steps: int) -> None:
        self.train_model.train()
        self.train_items.epoch = self.epoch
        self.train_sampler.set_epoch(self.epoch, start=self.batch_in_epoch * self.per_rank_batch)
        log_every = int(self.cfg.get("log_every", 10))
        ckpt_every = int(self.cfg.get("ckpt_every_steps", 0) or 0)
        bar = self._progress(total=self.steps_per_epoch, initial=self.batch_in_epoch // self.accum)
        window = {"loss": 0.0, "n": 0, "samples": 0, "t": time.time()}
        micro = 0
        tick = time.time()
        for batch in self.train_loader:
            last_micro = (micro + 1) % self.accum == 0
            sync = contextlib.nullcontext() if last_micro or not self.dist.enabled else self.train_model.no_sync()
            with sync:
                with self.amp():
                    out = task.training_step(self.train_model, batch, self.device)
                loss = out["loss"]
                if loss is None:  # an all-unreadable batch: a zero loss keeps DDP ranks in step
                    loss = sum(p.reshape(-1)[0] * 0.0 for p in self.model.parameters())
                finite = self._all_finite(loss)
                if finite:
                    scaled = loss / self.accum
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            micro += 1
            self.batch_in_epoch += 1
            self._note_skipped("train", batch, out.get("skipped", 0))
            if finite and out["num_samples"]:
                self._accumulate(out)
            else:
                self._nonfinite(loss)
            if not last_micro:
                continue
            stepped = self._optimizer_step(finite)
            self._count_throughput(time.time() - tick, int(out["num_samples"]) * self.accum * self.dist.world_size)
            tick = time.time()
            if stepped:
                window["loss"] += float(loss.detach())
                window["n"] += 1
            window["samples"] += int(out["num_samples"]) * self.accum * self.dist.world_size
            if bar is not None:
                bar.update(1)
            if self.step % log_every == 0 and window["n"]:
                self._log_window(window, bar)
            if ckpt_every and self.step % ckpt_every == 0:
                self.save()
            if self._stop_requested():
                self.save()
                self._hand_over_signal()
                raise Preempted(self._stop_signal or "signal")
            if self.step >= total_steps:
                break
        if bar is not None:
            bar.close()

    def _count_throughput(self, seconds: float, samples: int) -> None:
        """One optimizer step's time and images; the first ``trainer.throughput_warmup_steps`` steps of
        this process (compilation with ``trainer.compile``, warm-up) are kept out of ``images_per_sec``."""
        self.train_time += seconds
        self.train_samples += samples
        warm = self._steps_this_process < int(self.cfg.get("throughput_warmup_steps", 1) or 0)
        prefix = "warmup_" if warm else ""
        self.throughput[prefix + "time"] += seconds
        self.throughput[prefix + "samples"] += samples
        self.throughput[prefix + "steps"] += 1
        self._steps_this_process += 1

    # ------------------------------------------------------------------------------------------
    # unreadable images: distinct files, named in train.log, counted in metrics.csv and summary.json
    # ------------------------------------------------------------------------------------------
    def _note_skipped(self, split: str, batch, reported: Any = 0) -> None:
        skipped = batch[2] if isinstance(batch, (tuple, list)) and len(batch) == 3 else reported
        files = getattr(skipped, "files", None)
        if files is None:  # the data counts its skips but does not name them
            self._unnamed_skips += int(skipped or 0)
            return
        seen = self.skipped_files[split]
        for path, reason in files:
            if path not in seen:
                seen[path] = reason
                log.warning("skipped unreadable %s image %s (%s)", split, path, reason)

    def _note_val_batch(self, batch) -> None:
        self._note_skipped("val", batch)

    def _skipped_row(self) -> Dict[str, Any]:
        """``train/skipped_images`` and ``val/skipped_images``: distinct unreadable files so far (all ranks)."""
        if self.dist.enabled:
            import torch.distributed as tdist
            gathered = [None] * self.dist.world_size
            tdist.all_gather_object(gathered, self.skipped_files)
            for other in gathered:
                for split, files in (other or {}).items():
                    for path, reason in files.items():
                        if path not in self.skipped_files[split]:
                            self.skipped_files[split][path] = reason
                            if self.dist.is_main:
                                log.warning("skipped unreadable %s image %s (%s)", split, path, reason)
        counts = {split: len(files) for split, files in self.skipped_files.items()}
        self.counters["skipped_images"] = sum(counts.values()) + self._unnamed_skips
        dataset = getattr(self.val_loader, "dataset", None)
        if getattr(dataset, "on_bad_image", None) is None and not self.counters["skipped_images"]:
            return {}  # data that never skips (digits, latents): no columns
        return {f"{split}/skipped_images": n for split, n in counts.items()}

    def _all_finite(self, loss: torch.Tensor) -> bool:
        bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], device=self.device)
        return bool(all_reduce_sum(bad, self.dist).item() == 0)

    def _nonfinite(self, loss: torch.Tensor, where: str = "loss") -> None:
        self.counters["nonfinite_skipped"] += 1
        self.counters["nonfinite_in_a_row"] += 1
        limit = int(self.cfg.get("max_nonfinite_in_a_row", 10))
        log.warning("non-finite %s (%s) at step %d: step skipped (%d in a row)", where, float(loss.detach()),
                    self.step, self.counters["nonfinite_in_a_row"])
        self.loggers.log_step({"train/nonfinite_skipped": self.counters["nonfinite_skipped"]}, step=self.step)
        if self.counters["nonfinite_in_a_row"] >= limit:
            raise NonFiniteLoss(
                f"stopping: {self.counters['nonfinite_in_a_row']} non-finite steps in a row, last at step {self.step} "
                f"({where} = {float(loss.detach())}); last good checkpoint: {self.last_good_checkpoint or 'none yet'}")

    def _optimizer_step(self, finite: bool) -> bool:
        """Clip, step (unless the loss or the gradients were non-finite), schedule, EMA. True if stepped."""
        lr = self.schedule.apply(self.optimizer, self.step)
        self.lr = lr
        params = [p for p in self.model.parameters() if p.grad is not None]
        stepped = False
        if finite:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            clip = float(self.cfg.get("clip_grad") or 0.0)
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # skips by itself on inf grads (fp16 overflow)
                self.scaler.update()
                stepped = True
            elif torch.isfinite(norm):
                self.optimizer.step()
                stepped = True
            else:
                self._nonfinite(norm, where="gradient norm")
        if stepped:
            self.counters["nonfinite_in_a_row"] = 0
            after_optimizer_step(unwrap_model(self.model))  # step-counted schedules (learned shared heads)
            if self.ema is not None:
                self.ema.update(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return stepped

    def _accumulate(self, out: Dict[str, Any]) -> None:
        n = float(out["num_samples"])
        for key in ("loss", "ce", "aux"):
            if key in out:
                self.sums[key] = self.sums.get(key, 0.0) + float(out[key].detach()) * n
        for key, value in out.items():
            if key.startswith("log/"):
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * n
        self.sums["count"] += n
        self.routing.update(out.get("routing") or {})

    def _log_window(self, window: Dict[str, float], bar) -> None:
        elapsed = max(time.time() - window["t"], 1e-9)
        row = {"train/loss": window["loss"] / window["n"], "train/lr": self.lr,
               "train/images_per_sec": window["samples"] / elapsed, "epoch": self.epoch}
        if bar is not None:
            bar.set_postfix(loss=f"{row['train/loss']:.4f}", lr=f"{self.lr:.2e}",
                            img_s=f"{row['train/images_per_sec']:.0f}")
        if self.dist.is_main:
            self.loggers.log_step(row, step=self.step)
        window.update(loss=0.0, n=0, samples=0, t=time.time())

    def _progress(self, total: int, initial: int):
        if not self.dist.is_main or not self.cfg.get("progress", True):
            return None
        from tqdm.auto import tqdm
        return tqdm(total=total, initial=initial, desc=f"epoch {self.epoch}", dynamic_ncols=True, leave=False)

    # ------------------------------------------------------------------------------------------
    # epoch end: validation, routing statistics, best checkpoint
    # ------------------------------------------------------------------------------------------
    def evaluate_model(self, model: nn.Module, prefix: str = "val") -> Dict[str, float]:
        sums = self.task.evaluate(model, _NotingSkips(self.val_loader, self._note_val_batch), self.device, amp=self.amp)
        sums = reduce_sums(sums, self.dist, self.device)
        return self.task.finalize(sums, prefix=prefix)

    def _validate_before_training(self, task) -> None:
        """``val_at_start``: validate the initial weights once, at step 0 of a fresh run, logged as
        epoch -1 and kept in the summary as ``start/val/...``. ``auto`` (default) does it when the
        model starts from other weights (``model.init_from``, ``model.checkpoint_path``), where the
        starting accuracy is the baseline a continue-tuning run is judged against."""
        when = self.cfg.get("val_at_start", "auto")
        if when == "auto":
            when = bool(task.model_cfg.get("init_from") or task.model_cfg.get("checkpoint_path"))
        if not when or self.step > 0 or self.batch_in_epoch > 0:
            return
        row: Dict[str, Any] = {"epoch": -1}
        row.update(self.evaluate_model(self.model, "val"))
        self.start_row = {f"start/{k}": v for k, v in row.items() if k != "epoch"}
        if self.dist.is_main:
            self.loggers.log_epoch(row, step=0)
            log.info("before training: %s", ", ".join(f"{k}={v:.4g}" for k, v in row.items()
                                                        if isinstance(v, float)))

    def _end_epoch(self, task) -> None:
        sums = reduce_sums(self.sums, self.dist, self.device)
        n = max(sums.get("count", 0.0), 1.0)
        row: Dict[str, Any] = {"epoch": self.epoch}
        for key in ("loss", "ce", "aux"):
            if key in sums:
                row[f"train/epoch_{key}"] = sums[key] / n
        for key, value in sums.items():
            if key.startswith("log/"):
                row[f"train/{key[4:]}"] = value / n
        row.update(self.routing.summary(prefix="routing"))
        self.routing_warnings = self.routing.health_warnings()
        for warning in self.routing_warnings:
            log.warning("epoch %d routing: %s", self.epoch, warning)
        val_every = int(self.cfg.get("val_every_epochs", 1) or 1)
        last_epoch = self.epoch + 1 >= int(self.cfg["epochs"]) or self.step >= self._total_steps()
        if (self.epoch + 1) % val_every == 0 or last_epoch:
            row.update(self.evaluate_model(self.model, "val"))
            if self.ema is not None:
                row.update(self.evaluate_model(self.ema.module, "val_ema"))
            row.update(task.on_epoch_end(self, last_epoch) if hasattr(task, "on_epoch_end") else {})
        row.update(self._skipped_row())
        self.last_row = row
        if self.dist.is_main:
            self.loggers.log_epoch(row, step=self.step)
            self._routing_artifacts(last_epoch)
            log.info("epoch %d: %s", self.epoch, ", ".join(f"{k}={v:.4g}" for k, v in row.items()
                                                         if isinstance(v, float) and not k.startswith("routing/")))
        improved = self._track_best(row)
        self.epoch += 1
        self.batch_in_epoch = 0
        self.reset_meters()
        self.save()
        if improved:
            self.save("best.pt")

    def _routing_artifacts(self, last_epoch: bool) -> None:
        """routing.json (per-layer head loads and entropy, every epoch; learned shared-head masks), the
        head-load heatmap routing_head_load.png, and when a layer learns its shared heads,
        routing_shared_heads.png: written into the run directory with every logger, uploaded to wandb
        only when it is on. The figures are drawn every epoch when wandb shows them over time, else once,
        at the last epoch (drawing costs about 0.2 s each: 6 s of a 30-epoch digits run)."""
        if not self.routing.layers:
            return
        self.routing.dump(self.out_dir / "routing.json", self.epoch)
        if not last_epoch and self.loggers.wandb is None:
            return
        from moh_vision.analysis import routing_plots
        if routing_plots.has_learned_shared_heads(self.routing.averages()):
            import json
            epochs = json.loads((self.out_dir / "routing.json").read_text())
            path = routing_plots.plot_shared_heads(epochs, self.out_dir / "routing_shared_heads.png")
            self.loggers.log_image("routing/shared_heads", path, step=self.step, caption=f"epoch {self.epoch}")
        from moh_vision.analysis.routing_plots import plot_head_load
        path = plot_head_load(self.routing.averages(), self.out_dir / "routing_head_load.png",
                              title=f"head load, epoch {self.epoch}")
        self.loggers.log_image("routing/head_load", path, step=self.step, caption=f"epoch {self.epoch}")

    def _track_best(self, row: Dict[str, Any]) -> bool:
        metric, mode = self.task.primary_metric, self.task.primary_mode
        if metric not in row:
            return False
        value = float(row[metric])
        best = self.best.get("value")
        better = best is None or (value > best if mode == "max" else value < best)
        if better:
            self.best = {"metric": metric, "value": value, "epoch": self.epoch, "step": self.step}
        return better

    # ------------------------------------------------------------------------------------------
    # summary
    # ------------------------------------------------------------------------------------------
    def _count_flops(self, model: nn.Module, task, data) -> Dict[str, float]:
        if not self.cfg.get("count_flops", True) or not self.dist.is_main:
            return {}
        from moh_vision.analysis.flop_count import count_flops
        try:
            return count_flops(model, task.input_shape(data), model_kwargs=getattr(task, "flops_kwargs", None))
        except Exception as err:  # FLOPs are a report, never a reason to stop training
            log.warning("FLOP counting failed (%s: %s)", type(err).__name__, err)
            return {}

    def _summary(self, wall: float) -> Dict[str, Any]:
        previous = broadcast_object(self._previous_summary() if self.dist.is_main else None, self.dist)
        fresh = self.step > self.steps_at_start or hasattr(self, "last_row")
        if not fresh and self.step > 0:  # a rerun of a finished run (trainer.resume=auto): nothing trained
            if previous is not None and previous.get("steps") == self.step:
                if self.dist.is_main:
                    log.info("this run had finished at step %d: nothing to train, summary.json kept", self.step)
                return previous
            # finished, but its summary is gone or stale: evaluate the final weights again
            self.last_row = {"epoch": self.epoch - 1, **self.evaluate_model(self.model, "val")}
            if self.ema is not None:
                self.last_row.update(self.evaluate_model(self.ema.module, "val_ema"))
            self.last_row.update(self._skipped_row())
        tp = self.throughput
        if tp["steps"]:
            images_per_sec = tp["samples"] / max(tp["time"], 1e-9)
        elif tp["warmup_steps"]:  # a run too short for any step after the warm-up: count those
            images_per_sec = tp["warmup_samples"] / max(tp["warmup_time"], 1e-9)
        else:
            images_per_sec = float("nan")
        compile_time = 0.0
        if self.cfg.get("compile") and tp["warmup_steps"]:
            steady = tp["time"] / tp["steps"] if tp["steps"] else 0.0  # a step's time once compiled
            compile_time = max(0.0, tp["warmup_time"] - tp["warmup_steps"] * steady)
        summary: Dict[str, Any] = {
            "model": self.model_name, "params": self.params, "steps": self.step, "epochs": self.epoch,
            "wall_time_s": wall, "train_time_s": tp["time"] + tp["warmup_time"],
            "images_per_sec": images_per_sec, "compile_time_s": compile_time,
            "throughput_warmup_steps": int(self.cfg.get("throughput_warmup_steps", 1) or 0),
            "nonfinite_skipped": self.counters["nonfinite_skipped"],
            "skipped_images": self.counters["skipped_images"],
            "routing_warnings": list(getattr(self, "routing_warnings", [])),
        }
        summary.update({k: v for k, v in self.flops.items() if k != "params"})
        for key, value in getattr(self, "last_row", {}).items():
            if key.startswith(("val", "sample", "train/epoch", "train/skipped")) \
                    and not isinstance(value, (list, dict)):
                summary[key] = value
        summary.update({k: v for k, v in getattr(self, "start_row", {}).items()
                        if not isinstance(v, (list, dict))})
        if self.best:
            summary[f"best/{self.best['metric']}"] = self.best["value"]
            summary["best/epoch"] = self.best["epoch"]
        attn = self.config.get("attention") or {}
        summary["attention"] = attn.get("name") or "preset"
        if attn.get("activation_ratio") is not None:
            summary["activation_ratio"] = attn["activation_ratio"]
        summary["checkpoint"] = str(self.ckpt_dir / "last.pt")
        if previous is not None and previous.get("steps") == self.step:
            # the same training state as the recorded run: never replace a recorded result with nothing / NaN
            for key, value in previous.items():
                if _missing(summary.get(key)) and not _missing(value):
                    summary[key] = value
        return summary

    def _previous_summary(self) -> Optional[Dict[str, Any]]:
        """The summary.json already in the run directory (a rerun of this run), or None."""
        import json
        path = self.out_dir / "summary.json"
        try:
            previous = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return previous if isinstance(previous, dict) else None
