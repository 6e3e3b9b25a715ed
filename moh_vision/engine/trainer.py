"""The one training loop, for every task.

``Trainer(cfg, ...).fit(task, data)``: the task (``protocols.Task``) turns a batch into a loss dict, evaluates, and does
its end-of-epoch work given an ``EpochContext``; the data (``protocols.Data``) hand over the two splits. The trainer
owns the loop and the run's progress: accumulation, AMP, clipping, EMA updates, non-finite steps, epochs, validation,
the best checkpoint, checkpoints that resume mid-epoch, preemption, logging and summary.json. What it builds before the
first step is in ``fit_setup``; its running records (meters, throughput, unreadable images) are in ``bookkeeping``;
where its time goes (data wait, step time, TFLOP/s, utilisation, peak memory) in ``costs``."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from moh_vision import checkpoints as ckpt_io
from moh_vision.attention import optimizer_step_hooks
from moh_vision.errors import ConfigError, RunError
from moh_vision.ops import Kernels, resolved
from moh_vision.ops.dispatch import RUNS
from moh_vision.tasks.protocols import Data, EpochContext, StepContext, Task

from .bookkeeping import (EpochMeters, RunCosts, SkippedFiles, StepClock, StepWindow, Throughput, reset_peak_memory,
                          write_routing_artifacts)
from moh_vision.checkpoints import CheckpointHistory, numbered_name
from .distributed import DistInfo, Preempted, StopSignals, broadcast_object, reduce_sums, slurm_torchrun_warning
from .fit_setup import (FitParts, build_parts, device_settings, first_readable_batch, flops_text, optimizer_kernel_of,
                        seed_everything, show_progress, uses_cuda_graphs)
from .loggers import Loggers, write_json
from .profiling import StepProfiler, parse_steps
from .rank_sampling import sample_images
from moh_vision.checkpoints import config_changes, record_config
from .step_on_device import PendingSteps, SettledStep, gradient_norm, loss_for_backward, step_unless, takes_found_inf

__all__ = ["NonFiniteLoss", "Preempted", "Trainer"]

log = logging.getLogger(__name__)


class NonFiniteLoss(RunError):
    """Too many non-finite steps in a row."""


def _missing(value: Any) -> bool:
    """No result: absent, None, or a non-finite number (summary.json stores those as "nan" strings)."""
    if value is None:
        return True
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    return isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf")


def _previous_summary(out_dir: Path) -> Optional[Dict[str, Any]]:
    """The summary.json already in the run directory (a rerun of this run), or None."""
    try:
        previous = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return previous if isinstance(previous, dict) else None


def load_resume(resume: Optional[str], out_dir: Path) -> Optional[Tuple[Dict[str, Any], Path]]:
    """The checkpoint ``trainer.resume`` names (auto: ``out_dir``'s last.pt, or its previous twin) loaded, and the file
    it came from; None for a fresh run."""
    path = ckpt_io.resolve_resume(resume, out_dir)
    return None if path is None else ckpt_io.load_with_fallback(path)


def own_memory(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer's state tensors memory of their own: loaded from a mapped checkpoint onto the CPU, they would
    keep mapping that file (and its disk space once it is replaced) for the rest of the run."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                state[key] = value.clone()


class Trainer:
    """The loop, and the run's progress (saved in checkpoints).

    Args:
        cfg: the trainer config (``moh_vision.config.TrainerConfig``: attribute access).
        out_dir: the run directory (checkpoints/, summary.json, metrics.csv, config.yaml, routing files).
        dist: this process's rank, world size and device.
        loggers: where rows and images go.
        optim: the optimizer config (its fields are ``build_optimizer``'s keywords).
        sched: the schedule config (``build_schedule``'s: timm's schedulers, lengths in epochs).
        config: the whole run config as a plain dict (saved into checkpoints and config.yaml).
        seed: the run's seed (each rank adds its rank).
        resumed: the checkpoint ``trainer.resume`` names, already loaded, and the file it came from
            (``load_resume``): the caller read it (for the wandb run id) and the file is not read again.
    """

    def __init__(self, cfg: Any, out_dir: Path, dist: DistInfo, loggers: Loggers, optim: Any, sched: Any,
                 config: Dict[str, Any], seed: int = 0, resumed: Optional[Tuple[Dict[str, Any], Path]] = None):
        self.cfg, self.out_dir, self.dist, self.loggers = cfg, Path(out_dir), dist, loggers
        self.resumed = resumed
        self.optim_cfg, self.sched_cfg, self.config, self.seed = optim, sched, config, int(seed)
        self.device = dist.device
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.history = CheckpointHistory(self.ckpt_dir, cfg.ckpt_history_every_steps, cfg.ckpt_history_every_epochs,
                                         cfg.ckpt_keep)
        # progress, saved in checkpoints
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best: Dict[str, Any] = {}
        self.counters = {"nonfinite_skipped": 0, "nonfinite_in_a_row": 0, "skipped_images": 0}
        self.meters = EpochMeters()
        self.window = StepWindow()  # the steps since the last log row
        self.pending = PendingSteps()  # steps taken and not yet read (step_on_device)
        self.throughput = Throughput(cfg.throughput_warmup_steps)
        self.skipped = SkippedFiles(announce=dist.is_main)
        self.steps_at_start = 0
        self.last_good_checkpoint: Optional[str] = None
        self.writer = ckpt_io.BackgroundWriter(threaded=bool(cfg.ckpt_async))  # the main rank's checkpoint writes
        # this process's fit
        self.parts: Optional[FitParts] = None  # built by fit()
        self.costs: Optional[RunCosts] = None  # built by fit()
        self.signals = StopSignals(dist)
        self.settings: Dict[str, Any] = {}  # the device settings in effect (device_settings), for summary.json
        self.profiler = StepProfiler(parse_steps(cfg.profile), self.out_dir, dist.device, dist.rank)
        self.lr = 0.0
        self.start_row: Dict[str, Any] = {}  # trainer.val_at_start's validation, as start/<metric>
        self.last_row: Optional[Dict[str, Any]] = None  # the last epoch row (summary.json's results)
        self.routing_warnings: List[str] = []
        self.step_hooks: List[Callable[[], None]] = []  # the layers' after_optimizer_step, found once per fit
        self.params: List[nn.Parameter] = []  # the model's parameters, listed once per fit
        self.filler: Any = None  # the last batch with images (what an all-unreadable batch's zero step runs)
        self.step_work: Optional[Callable[[StepContext], Dict[str, float]]] = None  # the task's step_hook(), per fit
        self.step_metrics: List[Dict[str, Any]] = []  # what step_work returned, with its step (saved in checkpoints)

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self, task: Task, data: Data) -> Dict[str, Any]:
        """Train (or resume training) ``task``'s model on ``data`` under the device settings (TF32, cuDNN
        benchmarking); returns what summary.json holds."""
        with device_settings(self.cfg.tf32, self.cfg.deterministic, self.device) as self.settings:
            return self._fit(task, data)

    def _fit(self, task: Task, data: Data) -> Dict[str, Any]:
        RUNS.reset()  # which kernels ran, and fell back, in this run (summary.json)
        seed_everything(self.seed + self.dist.rank, self.cfg.deterministic, self.device)
        hook = getattr(task, "step_hook", None)  # optional (protocols.OPTIONAL_TASK_MEMBERS); checks its inputs now
        self.step_work = hook() if hook is not None else None
        parts = self.parts = build_parts(self.cfg, self.optim_cfg, self.sched_cfg, self.dist, self.seed, task, data)
        self.step_hooks = optimizer_step_hooks(parts.model)  # found once: no walk of the model in a step
        self.params = list(parts.model.parameters())
        self.costs = RunCosts(parts.flops, self.device, self.cfg.amp, self.dist.world_size)
        if self.dist.is_main:  # what writes killed half-way left (this process holds the run directory; wandb's own
            # files are its service's)
            for leftover in ckpt_io.remove_partial_writes(self.out_dir, recursive=True, skip=("wandb",)):
                what = "a checkpoint write" if leftover.parent == self.ckpt_dir else "a write"
                log.warning("removed %s, left by %s that was killed", leftover, what)
        self._resume()
        if self.dist.is_main:  # only now: a run that fails to set up must not overwrite a good run's config
            record_config(self.out_dir, self.config, self.step)
            log.info("%s | %s | %.2fM params | %s", parts.model_name, data.describe(), parts.params / 1e6,
                     flops_text(parts.flops))
            log.info("costs: %s", self.costs.describe())
            launch_problem = slurm_torchrun_warning()
            if launch_problem:
                log.warning("%s", launch_problem)
        start = time.time()
        with self.signals, self.profiler:
            parts.loaders.start_workers()
            self._validate_before_training()
            try:
                self._run()
            except BaseException:
                self._wait_for_writes(failing=True)
                raise
            self._wait_for_writes()
        summary = self._summary(time.time() - start)
        if self.dist.is_main:
            write_json(self.out_dir / "summary.json", summary)
            log.info("where the time went: %s", self.costs.text(summary, ""))
        return summary

    def _run(self) -> None:
        batches_per_epoch = self.parts.loaders.steps_per_epoch * self.parts.loaders.accum
        if self.batch_in_epoch and self.step >= self.parts.total_steps:
            self._end_epoch()  # the run stopped between its last step's checkpoint and its last epoch's end
        while self.epoch < self.cfg.epochs and self.step < self.parts.total_steps:
            if self.batch_in_epoch >= batches_per_epoch:
                self._end_epoch()  # the run stopped between the last step and validation
                continue
            self._train_epoch()
            if self.batch_in_epoch >= batches_per_epoch or self.step >= self.parts.total_steps:
                self._end_epoch()

    def _train_epoch(self) -> None:
        """The rest of this epoch (from ``batch_in_epoch``), or up to the last step of the run."""
        parts, loaders = self.parts, self.parts.loaders
        parts.train_model.train()
        loaders.start_epoch(self.epoch, self.batch_in_epoch)
        reset_peak_memory(self.device)
        bar = None
        if self.dist.is_main and show_progress(self.cfg.progress):
            from tqdm.auto import tqdm
            bar = tqdm(total=loaders.steps_per_epoch, initial=self.batch_in_epoch // loaders.accum,
                       desc=f"epoch {self.epoch}", dynamic_ncols=True, leave=False)
        self.window = StepWindow()
        micro, micros, loss_ok = 0, [], None  # micros, loss_ok: this optimizer step's loss dicts and finiteness
        clock = StepClock(self.device)
        graphs = uses_cuda_graphs(self.cfg.compile, self.cfg.compile_mode, self.device)
        self.profiler.at_step(self.step)
        batches_per_epoch = loaders.steps_per_epoch * loaders.accum
        for batch in clock.batches(self.profiler.batches(loaders.train)):
            if self.batch_in_epoch >= batches_per_epoch:  # micro-batches short of a whole step: the next epoch's
                break  # first step must not inherit their gradients
            if graphs:  # a new step: the previous one's graph outputs are used up (loss, metrics, routing copied)
                torch.compiler.cudagraph_mark_step_begin()
            last_micro = (micro + 1) % loaders.accum == 0
            sync = contextlib.nullcontext() if last_micro or not self.dist.enabled else parts.train_model.no_sync()
            with sync:
                with parts.amp():
                    out = parts.task.training_step(parts.train_model, batch, self.device)
                if out["loss"] is None:  # an all-unreadable batch: a zero loss through the same model keeps DDP
                    out = self._zero_step(out)  # ranks in step (the same gradient all-reduce on every rank)
                else:
                    self.filler = batch
                loss = out["loss"]
                finite = torch.isfinite(loss.detach())
                loss_ok = finite if loss_ok is None else loss_ok & finite
                scaled = loss_for_backward(loss, finite, loaders.accum)
                (parts.scaler.scale(scaled) if parts.scaler is not None else scaled).backward()
            micro += 1
            self.batch_in_epoch += 1
            self.skipped.note("train", batch, out["skipped"])
            micros.append({**out, "loss": loss})
            if not last_micro:
                continue
            grad_norm, skipped = self._optimizer_step(loss_ok)
            self.pending.add(self.step - 1, micros, grad_norm, skipped)
            micros, loss_ok = [], None
            samples = int(out["num_samples"]) * loaders.accum * self.dist.world_size
            seconds, waited = clock.lap(sync=self.step % self.cfg.log_every == 0)  # a window ends: exact sums
            self.throughput.count(seconds, samples, waited)
            for times in (self.window.times, self.meters.times):
                times.add(seconds, waited, samples)
            if bar is not None:
                bar.update(1)
            if self.step % self.cfg.log_every == 0:
                self._settle()
                if self.window.steps:
                    self._log_window(self.window, bar)
                    self.window = StepWindow()
            numbered = self.history.due_after_step(self.step)
            if self._after_step(numbered):  # before the checkpoint, which then holds what it found
                clock.restart()  # the task's work (FID) is not the next step's time
            if numbered or (self.cfg.ckpt_every_steps and self.step % self.cfg.ckpt_every_steps == 0):
                self.save(numbered=numbered)
            if self.signals.agreed():
                self.save()
                self._wait_for_writes()  # the checkpoint is on disk before a launcher's handler may end the process
                self.signals.hand_over()
                raise Preempted(self.signals.received or "signal")
            self.profiler.at_step(self.step)
            if self.step >= parts.total_steps:
                break
        self._settle()  # the epoch's last steps, before its row
        if bar is not None:
            bar.close()

    def _zero_step(self, empty: Dict[str, Any]) -> Dict[str, Any]:
        """The training step of a batch whose images were all unreadable: the last batch that had images (or the first
        readable item of the training set) through the training model, its loss times zero. Every rank then runs the
        same forward, backward and gradient all-reduce; this rank adds nothing to the step."""
        parts = self.parts
        if self.filler is None:
            self.filler = first_readable_batch(parts.loaders.items, parts.loaders.train.collate_fn, self.epoch)
        out = parts.task.training_step(parts.train_model, self.filler, self.device)
        return {"loss": out["loss"] * 0.0, "num_samples": 0, "skipped": empty["skipped"]}

    def _optimizer_step(self, loss_ok: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Clip, step, schedule, EMA; skipped where the loss (``loss_ok``: every micro-batch's was finite) or the
        gradients are not finite. Returns, on the device and unread, the gradient norm before clipping (AMP: unscaled)
        and whether the step counts as skipped."""
        parts = self.parts
        self.lr = parts.schedule.apply(parts.optimizer, self.step)
        params = [p for p in self.params if p.grad is not None]
        if parts.scaler is not None:
            parts.scaler.unscale_(parts.optimizer)
        norm = gradient_norm(params, self.cfg.clip_grad)
        if parts.scaler is not None:
            parts.scaler.step(parts.optimizer)  # skips by itself on non-finite gradients (fp16 overflow, NaN loss)
            parts.scaler.update()
            skipped = ~loss_ok  # an overflow the scaler skipped is not counted, as a NaN loss is
        else:
            skipped = ~torch.isfinite(norm)  # a non-finite loss on any rank made every rank's gradients NaN
            if takes_found_inf(parts.optimizer):
                step_unless(parts.optimizer, skipped)
            elif not bool(skipped):  # this optimizer cannot skip on a device flag: one host read a step
                parts.optimizer.step()
        if parts.ema is not None:  # every step, as timm's and DiT's loops do (a skipped step left the weights alone)
            parts.ema.update(parts.model)
        for hook in self.step_hooks:  # step-counted schedules (learned shared heads): skipped steps count, as for lr
            hook()
        parts.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm, skipped

    def _settle(self) -> None:
        """Read the steps taken since the last settle (one copy from the device) and count them: a skipped one as
        non-finite, the others into the epoch meters and the log window."""
        for step in self.pending.settle(self.dist):
            if step.skipped:
                self._nonfinite(step)
                continue
            self.counters["nonfinite_in_a_row"] = 0
            for out in step.outs:
                if out["num_samples"]:
                    self.meters.add(out)
            self.window.add(step.outs[-1], step.grad_norm)

    def _nonfinite(self, step: SettledStep) -> None:
        """Count a skipped step; stop after ``trainer.max_nonfinite_in_a_row`` in a row."""
        bad_loss = next((float(out["loss"]) for out in step.outs if not math.isfinite(float(out["loss"]))), None)
        where, value = ("loss", bad_loss) if bad_loss is not None else ("gradient norm", step.grad_norm)
        self.counters["nonfinite_skipped"] += 1
        self.counters["nonfinite_in_a_row"] += 1
        log.warning("non-finite %s (%s) at step %d: step skipped (%d in a row)", where, value, step.index,
                    self.counters["nonfinite_in_a_row"])
        self.loggers.log_step({"train/nonfinite_skipped": self.counters["nonfinite_skipped"]}, step=step.index)
        if self.counters["nonfinite_in_a_row"] >= self.cfg.max_nonfinite_in_a_row:
            raise NonFiniteLoss(
                f"stopping: {self.counters['nonfinite_in_a_row']} non-finite steps in a row, last at step {step.index} "
                f"({where} = {value}); last good checkpoint: {self.last_good_checkpoint or 'none yet'}")

    def _log_window(self, window: StepWindow, bar) -> None:
        rates = self.costs.rates(window.times.slowest(self.dist), "train/")
        row = {**window.row(), **rates, "train/lr": self.lr, "epoch": self.epoch}
        if bar is not None:
            bar.set_postfix(loss=f"{row['train/loss']:.4f}", lr=f"{self.lr:.2e}",
                            img_s=f"{row['train/images_per_sec']:.0f}", wait=f"{row['train/data_wait_share']:.0%}",
                            **({"tflops": f"{rates['train/tflops']:.3g}"} if "train/tflops" in rates else {}))
        if self.dist.is_main:
            self.loggers.log_step(row, step=self.step)

    # ---- validation and the end of an epoch --------------------------------------------------
    def evaluate_model(self, model: nn.Module, prefix: str = "val") -> Dict[str, float]:
        """The task's metrics of ``model`` on the validation set (all ranks), as ``<prefix>/<metric>``."""
        parts = self.parts
        sums = parts.task.evaluate(model, self.skipped.noting("val", parts.loaders.val), self.device, amp=parts.amp)
        return parts.task.finalize(reduce_sums(sums, self.dist, self.device), prefix=prefix)

    def _validate_before_training(self) -> None:
        """``val_at_start``: validate the initial weights once, at step 0 of a fresh run (epoch -1; ``start/val/...`` in
        the summary). ``auto``: when the model starts from other weights (``model.init_from``,
        ``model.checkpoint_path``), whose accuracy is the baseline a continue-tuning run is judged against."""
        when = self.cfg.val_at_start
        if when == "auto":
            model_cfg = self.parts.task.model_cfg
            when = bool(model_cfg["init_from"] or model_cfg["checkpoint_path"])
        if not when or self.step > 0 or self.batch_in_epoch > 0:
            return
        row: Dict[str, Any] = {"epoch": -1, **self.evaluate_model(self.parts.model, "val")}
        self.start_row = {f"start/{k}": v for k, v in row.items() if k != "epoch"}
        if self.dist.is_main:
            self.loggers.log_epoch(row, step=0)
            log.info("before training: %s", ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))

    def _end_epoch(self) -> None:
        """The epoch row (training averages, routing, validation, the task's end-of-epoch metrics, skipped images),
        routing files, ``last.pt`` and, when the primary metric improved, ``best.pt``."""
        parts = self.parts
        self._settle()
        row: Dict[str, Any] = {"epoch": self.epoch, **self.meters.row(self.dist)}
        costs = self.costs.epoch_row(self.meters.times, self.dist)
        row.update(costs)
        self.throughput.note_peak_memory(costs["epoch/peak_memory_mb"])
        self.routing_warnings = self.meters.routing.health_warnings()
        for warning in self.routing_warnings:
            log.warning("epoch %d routing: %s", self.epoch, warning)
        last_epoch = self.epoch + 1 >= self.cfg.epochs or self.step >= parts.total_steps
        if (self.epoch + 1) % self.cfg.val_every_epochs == 0 or last_epoch:
            row.update(self.evaluate_model(parts.model, "val"))
            if parts.ema is not None:
                row.update(self.evaluate_model(parts.ema.module, "val_ema"))
            row.update(parts.task.on_epoch_end(self._epoch_context(last_epoch)))
        row.update(self._skipped_row())
        self.last_row = row
        if self.dist.is_main:
            self.loggers.log_epoch(row, step=self.step)
            write_routing_artifacts(self.meters.routing, self.out_dir, self.loggers, self.epoch, self.step, last_epoch)
            log.info("epoch %d: %s", self.epoch, ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)
                                                         and not k.startswith("routing/") and k not in costs))
            log.info("epoch %d time: %s", self.epoch, self.costs.text(costs, "epoch/"))
        improved = self._track_best(row)
        numbered = self.history.due_after_epoch(self.epoch + 1)
        self._after_step(numbered)  # the task's work at a numbered checkpoint, before it is written
        self.epoch += 1
        self.batch_in_epoch = 0
        self.meters = EpochMeters()
        self.save(numbered=numbered, best=improved)

    def _after_step(self, numbered: bool) -> bool:
        """The task's work between steps (``step_hook``; every rank): its metrics logged with the step and kept for
        summary.json. True when it returned any."""
        if self.step_work is None:
            return False
        parts = self.parts
        metrics = self.step_work(StepContext(
            step=self.step, epoch=self.epoch, numbered=numbered, is_main=self.dist.is_main,
            world_size=self.dist.world_size, device=self.device, out_dir=self.out_dir,
            model_for_eval=parts.ema.module if parts.ema is not None else parts.model,
            progress=self.dist.is_main and show_progress(self.cfg.progress),
            sample_images=functools.partial(sample_images, device=self.device, dist=self.dist),
            share=functools.partial(broadcast_object, info=self.dist)))
        if not metrics:
            return False
        parts.train_model.train()  # the work may have put the trained model in eval mode
        self.step_metrics = [row for row in self.step_metrics if row["step"] != self.step]
        self.step_metrics.append({"step": self.step, **metrics})
        if self.dist.is_main:
            self.loggers.log_epoch({**metrics, "epoch": self.epoch}, step=self.step)
        return True

    def _epoch_context(self, last_epoch: bool) -> EpochContext:
        parts = self.parts
        return EpochContext(epoch=self.epoch, step=self.step, last_epoch=last_epoch, is_main=self.dist.is_main,
                            device=self.device, out_dir=self.out_dir,
                            model_for_eval=parts.ema.module if parts.ema is not None else parts.model,
                            log_image=functools.partial(self.loggers.log_image, step=self.step))

    def _skipped_row(self) -> Dict[str, Any]:
        """Skipped-image columns (all ranks); none for data that never skip, unless something was skipped."""
        self.counters["skipped_images"] = self.skipped.gather(self.dist)
        if not self.parts.may_skip_images and not self.counters["skipped_images"]:
            return {}
        return self.skipped.row()

    def _track_best(self, row: Dict[str, Any]) -> bool:
        metric, mode = self.parts.task.primary_metric, self.parts.task.primary_mode
        if metric not in row:
            return False
        value = float(row[metric])
        best = self.best.get("value")
        better = best is None or (value > best if mode == "max" else value < best)
        if better:
            self.best = {"metric": metric, "value": value, "epoch": self.epoch, "step": self.step}
        return better

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, name: str = "last.pt", numbered: bool = False, best: bool = False) -> None:
        """Write ``checkpoints/<name>`` and, if ``numbered``, ``checkpoints/step_<step>.pt``, if ``best``,
        ``checkpoints/best.pt`` (main rank; every rank joins the RNG gather), every step so far counted. The state is
        serialised once: the other names are links of the file written. With ``trainer.ckpt_async`` the main rank takes
        a host copy of the state here and a thread writes it while training goes on; the next save, or the end of the
        fit, waits for it and raises its error."""
        self._settle()
        state = self._state()
        if not self.dist.is_main:
            return
        self.writer.wait()  # one write at a time; the previous one's error stops the run here
        path = self.ckpt_dir / name
        also = [self.ckpt_dir / numbered_name(self.step)] if numbered else []
        if best and name != "best.pt":
            also.append(self.ckpt_dir / "best.pt")
        if self.writer.threaded:
            state = ckpt_io.host_copy(state)  # consistent: taken before the next step changes the weights

        def write() -> None:
            ckpt_io.atomic_save(state, path, keep_previous=name == "last.pt", also=also)
            if name == "last.pt":
                self.last_good_checkpoint = str(path)
            if numbered:
                self.history.prune()

        self.writer.submit(write)

    def _wait_for_writes(self, failing: bool = False) -> None:
        """Wait for the checkpoint write under way. Its error is raised, unless the run is ``failing`` already (then
        it is logged: the first error is the one the run stops with)."""
        try:
            self.writer.wait()
        except Exception as err:  # noqa: BLE001
            if not failing:
                raise
            log.error("the checkpoint write under way failed too: %s", err)

    def _state(self) -> Dict[str, Any]:
        """The checkpoint. Under DDP, ``rng`` and ``meters`` (this epoch's sums so far) hold one entry per rank."""
        parts = self.parts
        rng, meters = capture_rng(), self.meters.state_dict()
        if self.dist.enabled:
            import torch.distributed as tdist
            gathered = [None] * self.dist.world_size
            tdist.all_gather_object(gathered, (rng, meters))
            rng, meters = [g[0] for g in gathered], [g[1] for g in gathered]
        state = {
            "format": ckpt_io.FORMAT_VERSION,
            "model": parts.model.state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "rng": rng, "world_size": self.dist.world_size,
            "best": dict(self.best), "counters": dict(self.counters),
            "skipped_files": self.skipped.state_dict(),
            "throughput": self.throughput.state_dict(),
            "meters": meters, "step_metrics": [dict(row) for row in self.step_metrics],
            "config": self.config, "model_name": parts.model_name,
            "wandb_run_id": self.loggers.run_id,
        }
        if parts.ema is not None:
            state["model_ema"] = parts.ema.state_dict()
            state["ema_updates"] = parts.ema.updates
        return state

    def _resume(self) -> None:
        """Load ``trainer.resume`` (auto: this run's last.pt, if any): weights, optimizer, progress, records and RNG, so
        the run goes on as if never stopped."""
        parts = self.parts
        resumed, self.resumed = self.resumed, None  # the loaded checkpoint is not kept beyond this
        if resumed is None:
            resumed = load_resume(self.cfg.resume, self.out_dir)
        if resumed is None:
            return
        state, used = resumed
        self._check_resumable(state, used)
        problem = ckpt_io.state_dict_mismatch(parts.model.state_dict(), state["model"])
        if problem or (state.get("model_name") and state["model_name"] != parts.model_name):
            raise ConfigError(f"cannot resume from {used}: it holds model '{state.get('model_name')}' and this run "
                              f"builds '{parts.model_name}' ({problem or 'different model'})")
        parts.model.load_state_dict(state["model"])
        parts.optimizer.load_state_dict(state["optimizer"])
        own_memory(parts.optimizer)
        if parts.scaler is not None and state.get("scaler"):
            parts.scaler.load_state_dict(state["scaler"])
        if parts.ema is not None and "model_ema" in state:
            parts.ema.load_state_dict(state["model_ema"])
            parts.ema.updates = int(state.get("ema_updates", 0))
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.best, self.counters = dict(state.get("best", {})), {**self.counters, **state.get("counters", {})}
        self.skipped.load_state_dict(state.get("skipped_files") or {})
        self.throughput.load_state_dict(state.get("throughput") or {})
        self.steps_at_start = self.step
        self.step_metrics = [dict(row) for row in state.get("step_metrics") or [] if row["step"] <= self.step]
        self.meters = EpochMeters(self._own(state.get("meters")))
        rng = state["rng"]
        if isinstance(rng, list):
            rng = rng[self.dist.rank] if len(rng) == self.dist.world_size else rng[0]
        restore_rng(rng)
        self.loggers.truncate_after(self.step)
        self.last_good_checkpoint = str(used)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", used, self.step, self.epoch, self.batch_in_epoch)
        if self.cfg.extend and self.dist.is_main:
            old_lr = max(group["lr"] for group in parts.optimizer.param_groups)
            new_lr = parts.schedule.apply(parts.optimizer, self.step)
            log.warning("extended run: %d steps in all (schedule recomputed for them); the learning rate goes "
                        "from %.3g to %.3g at step %d", parts.total_steps, old_lr, new_lr, self.step)

    def _check_resumable(self, state: Dict[str, Any], used: Path) -> None:
        """Refuse a checkpoint this run cannot continue exactly: one saved mid-epoch by another number of processes,
        or one trained with other options (unless ``trainer.extend``)."""
        saved_world = int(state.get("world_size") or 1)
        if state.get("batch_in_epoch") and saved_world != self.dist.world_size:
            raise ConfigError(f"cannot resume from {used}: it was saved mid-epoch (epoch {state['epoch']}, batch "
                              f"{state['batch_in_epoch']}) by {saved_world} processes and this run has "
                              f"{self.dist.world_size}; resume it with {saved_world} processes (the epoch's data "
                              f"order depends on them), or from an epoch-end checkpoint")
        changes = config_changes(state.get("config") or self.config, self.config)
        if changes and not self.cfg.extend:
            raise ConfigError(f"cannot resume from {used} with other options ({'; '.join(changes)}): add "
                              f"trainer.extend=true to continue it with them (the schedule is recomputed for "
                              f"the new length), or use another output directory")
        if changes and self.dist.is_main:
            log.warning("continuing %s with other options: %s", used, "; ".join(changes))

    def _own(self, per_rank: Any) -> Optional[Dict[str, Any]]:
        """This rank's entry of a per-rank list; a dict (one process, or an older checkpoint) is rank 0's alone."""
        if isinstance(per_rank, list):
            return per_rank[self.dist.rank] if self.dist.rank < len(per_rank) else None
        return per_rank if self.dist.is_main else None

    # ---- summary -----------------------------------------------------------------------------
    def _summary(self, wall: float) -> Dict[str, Any]:
        """summary.json: the run's results, throughput and health. A rerun of a finished run keeps the recorded
        summary, or evaluates the final weights again when it is gone or stale."""
        parts = self.parts
        previous = broadcast_object(_previous_summary(self.out_dir) if self.dist.is_main else None, self.dist)
        fresh = self.step > self.steps_at_start or self.last_row is not None
        if not fresh and self.step > 0:  # a rerun of a finished run (trainer.resume=auto): nothing trained
            if previous is not None and previous.get("steps") == self.step:
                if self.dist.is_main:
                    log.info("this run had finished at step %d: nothing to train, summary.json kept", self.step)
                return previous
            self.last_row = {"epoch": self.epoch - 1, **self.evaluate_model(parts.model, "val")}
            if parts.ema is not None:
                self.last_row.update(self.evaluate_model(parts.ema.module, "val_ema"))
            self.last_row.update(self._skipped_row())
        summary: Dict[str, Any] = {
            "model": parts.model_name, "params": parts.params, "steps": self.step, "epochs": self.epoch,
            "wall_time_s": wall, "train_time_s": self.throughput.train_time(),
            "images_per_sec": self.throughput.images_per_sec(),  # replaced by the slowest rank's below
            "compile_time_s": self.throughput.compile_time() if self.cfg.compile else 0.0,
            "throughput_warmup_steps": self.cfg.throughput_warmup_steps,
            "nonfinite_skipped": self.counters["nonfinite_skipped"],
            "skipped_images": self.counters["skipped_images"],
            "routing_warnings": list(self.routing_warnings),
            **self.settings, "optimizer_impl": optimizer_kernel_of(parts.optimizer),
            "grad_checkpointing": bool(self.cfg.grad_checkpointing), "ddp": dict(parts.ddp),
        }
        summary.update({k: v for k, v in parts.flops.items() if k != "params"})
        summary.update(self.costs.summary(self.throughput.steady().slowest(self.dist),
                                          self.throughput.record["peak_memory_mb"]))
        for key, value in (self.last_row or {}).items():
            if key.startswith(("val", "sample", "train/epoch", "train/skipped")) \
                    and not isinstance(value, (list, dict)):
                summary[key] = value
        summary.update({k: v for k, v in self.start_row.items() if not isinstance(v, (list, dict))})
        if self.step_metrics:  # the task's step work (FID during training): every evaluation, and the last one's
            summary["step_metrics"] = [dict(row) for row in self.step_metrics]
            summary.update({k: v for k, v in self.step_metrics[-1].items() if k != "step"})
            summary["step_metrics_step"] = self.step_metrics[-1]["step"]
        if self.best:
            summary[f"best/{self.best['metric']}"] = self.best["value"]
            summary["best/epoch"] = self.best["epoch"]
        attn = self.config["attention"]
        summary["attention"] = attn["name"] or "preset"  # preset: the model preset's own attention
        if attn.get("activation_ratio") is not None:
            summary["activation_ratio"] = attn["activation_ratio"]
        kernels = Kernels.of(self.config.get("kernels"))
        summary["kernels"] = kernels.as_dict()  # as configured, and what runs on this device
        summary["kernels_in_use"] = resolved(kernels, self.dist.device)
        summary["kernels_ran"] = RUNS.kernels_ran(self.dist.device)  # this process's eager calls
        summary["kernel_fallbacks"] = RUNS.fallbacks(self.dist.device)  # first calls that failed: the formula ran
        summary["checkpoint"] = str(self.ckpt_dir / "last.pt")
        if previous is not None and previous.get("steps") == self.step:
            # the same training state as the recorded run: never replace a recorded result with nothing / NaN
            for key, value in previous.items():
                if _missing(summary.get(key)) and not _missing(value):
                    summary[key] = value
        return summary


# -- RNG state ---------------------------------------------------------------------------------------------------------
# Random-number-generator states as plain data (saved in checkpoints so a resumed run continues bit-exactly).
def capture_rng() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": _numpy_state_to_plain(np.random.get_state()),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _numpy_state_to_plain(st) -> Dict[str, Any]:
    name, keys, pos, has_gauss, cached = st
    return {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_state_from_plain(d: Dict[str, Any]):
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached"])
