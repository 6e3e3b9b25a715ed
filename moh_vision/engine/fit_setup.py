"""What ``Trainer.fit`` builds before its first step, as plain functions of the config.

``build_parts`` returns the model and everything that trains it (``FitParts``): loaders whose order resumes mid-epoch
(``Loaders``), the optimizer and schedule (timm's), AMP, the grad scaler, EMA, and the compiled / DDP-wrapped model."""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import random
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from moh_vision.data.sampler import EpochKeys, EpochSampler, HeldIndices, SeededItems, loader_options
from moh_vision.errors import ConfigError, RunError
from moh_vision.tasks.protocols import Data, Task

from .distributed import DistInfo
from .optim import Schedule, build_optimizer, build_schedule

log = logging.getLogger(__name__)

AmpContext = Callable[[], ContextManager]


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    """Python, NumPy and torch seeded with ``seed`` (the caller adds the rank); ``deterministic`` asks torch for
    deterministic kernels (warning where there is none)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":  # (cuDNN benchmarking is off too: device_settings)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def amp_context(amp: str, device: torch.device) -> AmpContext:
    """``trainer.amp``: a factory of autocast contexts (bf16, fp16) or of null contexts (none)."""
    if amp == "none":
        return contextlib.nullcontext
    if amp not in ("bf16", "fp16"):
        raise ConfigError(f"trainer.amp={amp} is unknown; use none, bf16 or fp16")
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


@dataclass(frozen=True)
class Loaders:
    """This rank's training and validation loaders, and the epoch arithmetic they fix. The training order is a pure
    function of (seed, epoch) (``EpochSampler``), each item's augmentation of (seed, epoch, index) (``SeededItems``,
    the epoch handed to the workers with each index: ``EpochKeys``): ``start_epoch`` restarts an epoch at any batch."""

    train: DataLoader
    val: DataLoader
    items: SeededItems
    sampler: EpochSampler
    val_indices: HeldIndices
    per_rank_batch: int
    accum: int
    steps_per_epoch: int  # optimizer steps

    def start_epoch(self, epoch: int, batch_in_epoch: int) -> None:
        self.items.epoch = epoch
        self.sampler.set_epoch(epoch, start=batch_in_epoch * self.per_rank_batch)

    def start_workers(self) -> None:
        """Fork the validation loader's workers now, before the first training step, with nothing to fetch: a fork
        makes this process copy every page it writes next (copy-on-write), which forked at the first validation stalled
        the next training step (2-3 x a median digits step, 4 workers); now it happens once, in the first steps."""
        if self.val.num_workers:
            self.val_indices.held = True
            try:
                iter(self.val)  # persistent: the loader keeps this iterator and its workers
            finally:
                self.val_indices.held = False


def build_loaders(cfg: Any, data: Data, dist: DistInfo, seed: int) -> Loaders:
    """Loaders for ``trainer.batch_size`` (global: split over ranks and ``grad_accum``)."""
    accum, global_batch = cfg.grad_accum, cfg.batch_size
    if global_batch % (dist.world_size * accum):
        raise ConfigError(f"trainer.batch_size={global_batch} must be divisible by world size "
                          f"{dist.world_size} x grad_accum {accum}")
    per_rank_batch = global_batch // (dist.world_size * accum)
    if getattr(data, "streaming", False):
        return _stream_loaders(cfg, data, dist, seed, per_rank_batch, accum)
    items = SeededItems(data.train, seed=seed)
    sampler = EpochSampler(len(data.train), shuffle=True, seed=seed, rank=dist.rank, world_size=dist.world_size,
                           repeats=data.repeated_aug, drop_last=True)
    if len(sampler) < per_rank_batch:
        raise ConfigError(f"trainer.batch_size={global_batch} is larger than the training set "
                          f"({len(data.train)} items) allows per rank")
    pin = dist.device.type == "cuda"
    train = DataLoader(items, batch_size=per_rank_batch, sampler=EpochKeys(sampler), drop_last=True,
                       collate_fn=data.collate_fn, **loader_options(cfg.num_workers, pin))
    val_indices = HeldIndices(range(dist.rank, len(data.val), dist.world_size))
    val_batch = cfg.val_batch_size if cfg.val_batch_size is not None else per_rank_batch
    val = DataLoader(data.val, batch_size=val_batch, sampler=val_indices, collate_fn=data.collate_fn,
                     **loader_options(cfg.num_workers, pin))
    steps_per_epoch = len(sampler) // per_rank_batch // accum
    if steps_per_epoch < 1:
        raise ConfigError("an epoch has no optimizer step; lower trainer.batch_size or trainer.grad_accum")
    return Loaders(train=train, val=val, items=items, sampler=sampler, val_indices=val_indices,
                   per_rank_batch=per_rank_batch, accum=accum, steps_per_epoch=steps_per_epoch)


def _stream_loaders(cfg: Any, data: Data, dist: DistInfo, seed: int, per_rank_batch: int, accum: int) -> Loaders:
    """Loaders over a streamed training set (``data.streaming``: :class:`moh_vision.data.sources.ShardStream`, its
    own sampler, fed batches; workers started afresh each epoch, so they see the epoch set on it)."""
    stream = data.train
    stream.configure(per_rank_batch, seed, dist.rank, dist.world_size, data.repeated_aug)
    if stream.steps < 1:
        raise ConfigError(f"trainer.batch_size={cfg.batch_size} is larger than the training set ({len(stream)} "
                          f"items) allows per rank")
    pin = dist.device.type == "cuda"
    options = {**loader_options(cfg.num_workers, pin), "persistent_workers": False}
    train = DataLoader(stream, batch_size=None, collate_fn=data.collate_fn, **options)
    val_indices = HeldIndices(range(dist.rank, len(data.val), dist.world_size))
    val_batch = cfg.val_batch_size if cfg.val_batch_size is not None else per_rank_batch
    val = DataLoader(data.val, batch_size=val_batch, sampler=val_indices, collate_fn=data.collate_fn,
                     **loader_options(cfg.num_workers, pin))
    if stream.steps // accum < 1:
        raise ConfigError("an epoch has no optimizer step; lower trainer.batch_size or trainer.grad_accum")
    return Loaders(train=train, val=val, items=stream, sampler=stream, val_indices=val_indices,
                   per_rank_batch=per_rank_batch, accum=accum, steps_per_epoch=stream.steps // accum)


def first_readable_batch(items: SeededItems, collate: Callable, epoch: int, tries: int = 64) -> Any:
    """A one-item batch of the first readable item of the training set (with its ``epoch`` augmentation): what a rank
    whose first batch was all unreadable runs its zero step on (``Trainer._zero_step``)."""
    for index in range(min(tries, len(items))):
        batch = collate([items[(epoch, index)]])
        if batch[0].shape[0]:
            return batch
    raise RunError(f"none of the first {min(tries, len(items))} training items is readable (see the skipped-image "
                   f"warnings above)")


def show_progress(progress: Any) -> bool:
    """``trainer.progress``: true, false, or auto (a progress bar only on a terminal, none in a batch job's log)."""
    if progress == "auto":
        import sys
        return sys.stderr.isatty()
    return bool(progress)


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the torch.compile modes that replay CUDA graphs


def uses_cuda_graphs(compile_model: bool, compile_mode: str, device: torch.device) -> bool:
    """Whether the training model replays CUDA graphs (``torch.compile``'s reduce-overhead or max-autotune on CUDA):
    the trainer then marks each training step as a new one (``torch.compiler.cudagraph_mark_step_begin``), so that
    one step's graph outputs are never taken for buffers the next step may overwrite."""
    return bool(compile_model) and compile_mode in CUDA_GRAPH_MODES and device.type == "cuda"


def trained_buffers(model: nn.Module) -> bool:
    """Whether training changes any of the model's buffers (batch norms' running statistics): only then must DDP
    broadcast rank 0's buffers before every forward; TransNeXt's position tables and DiT's position embedding are
    constants, the same on every rank since DDP's construction."""
    from torch.nn.modules.batchnorm import _NormBase
    return any(isinstance(m, _NormBase) and m.track_running_stats for m in model.modules())


def ddp_options(ddp: Any, model: nn.Module) -> Dict[str, Any]:
    """``trainer.ddp`` resolved for ``model``: what DDP is built with (summary.json's ``ddp``)."""
    broadcast = trained_buffers(model) if ddp.broadcast_buffers == "auto" else bool(ddp.broadcast_buffers)
    return {"broadcast_buffers": broadcast, "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
            "comm_hook": ddp.comm_hook, "bucket_cap_mb": ddp.bucket_cap_mb}


def wrap_model(model: nn.Module, compile_model: bool, dist: DistInfo, compile_mode: str = "default",
               ddp: Optional[Dict[str, Any]] = None) -> nn.Module:
    """The model that trains: ``torch.compile``d (with ``compile_mode``) when asked, inside DDP under torchrun (with
    the :func:`ddp_options`). DDP broadcasts rank 0's weights and buffers to every rank when it is built."""
    if compile_model:
        from moh_vision.attention.recorder import compile_model as compiled
        wrapped = compiled(model, compile_mode)
    else:
        wrapped = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP
        options = {k: v for k, v in (ddp or {}).items() if v is not None}  # none given: torch's defaults
        hook = options.pop("comm_hook", "none")
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        if "broadcast_buffers" in options and "forward_sync_buffers" in inspect.signature(DDP).parameters:
            # torch >= 2.14's name for the per-forward broadcast; buffers are then still synced once, at init
            options["forward_sync_buffers"] = options.pop("broadcast_buffers")
        wrapped = DDP(wrapped, device_ids=ids, **options)
        if hook != "none":  # torch's own: gradients cast to bf16 / fp16 for the all-reduce, back to fp32 after
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            wrapped.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    return wrapped


def count_model_flops(model: nn.Module, task: Task, data: Data) -> Dict[str, float]:
    """The FLOP report of one forward (``moh_vision.analysis.flop_count``), or {} if counting fails."""
    from moh_vision.analysis.flop_count import count_flops
    try:
        return count_flops(model, task.input_shape(data), model_kwargs=task.flops_kwargs)
    except Exception as err:  # FLOPs are a report, never a reason to stop training
        log.warning("FLOP counting failed (%s: %s)", type(err).__name__, err)
        return {}


def flops_text(flops: Dict[str, float]) -> str:
    if "gflops" not in flops:
        return "FLOPs not counted"
    active = f", {flops['active_gflops']:.4g} active" if "active_gflops" in flops else ""
    return f"{flops['gflops']:.4g} GFLOPs{active} per image"


@dataclass(frozen=True)
class FitParts:
    """The task, its model and what trains it, for one ``Trainer.fit``. ``model`` is the bare model (checkpoints, EMA,
    evaluation); ``train_model`` the one the training step calls (compiled and/or in DDP). ``flops`` is empty off the
    main rank or when ``trainer.count_flops`` is off."""

    task: Task
    model_name: str
    model: nn.Module
    train_model: nn.Module
    params: int
    flops: Dict[str, float]
    loaders: Loaders
    total_steps: int
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    amp: AmpContext
    scaler: Optional[torch.amp.GradScaler]
    ema: Optional[EMA]
    ddp: Dict[str, Any]  # the DDP options in effect (empty in one process)
    may_skip_images: bool  # the validation set can skip unreadable images (skip counts get columns)


def build_parts(cfg: Any, optim: Any, sched: Any, dist: DistInfo, seed: int, task: Task, data: Data) -> FitParts:
    """Everything ``fit`` trains with, from the trainer, optimizer and schedule configs."""
    if cfg.val_at_start not in ("auto", True, False):
        raise ConfigError(f"trainer.val_at_start={cfg.val_at_start!r}; allowed: auto, true, false")
    model = task.build_model(data).to(dist.device)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    flops = count_model_flops(model, task, data) if cfg.count_flops and dist.is_main else {}
    loaders = build_loaders(cfg, data, dist, seed)
    total_steps = cfg.epochs * loaders.steps_per_epoch
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    optimizer = build_optimizer(model, **vars(optim), kernel=optimizer_kernel(dist.device))
    schedule = build_schedule(sched, optimizer, total_steps, loaders.steps_per_epoch)
    ddp = ddp_options(cfg.ddp, model) if dist.enabled else {}
    train_model = wrap_model(model, cfg.compile, dist, cfg.compile_mode, ddp)
    # after DDP's broadcast: every rank's EMA starts from rank 0's weights (as DiT's train.py re-syncs it), not from
    # the weights this rank initialised with its own seed
    ema = EMA(model, cfg.ema.decay, cfg.ema.warmup) if cfg.ema.enabled else None
    return FitParts(
        task=task, model_name=task.model_cfg["name"], model=model, train_model=train_model,
        params=sum(p.numel() for p in model.parameters()), flops=flops, loaders=loaders, total_steps=total_steps,
        optimizer=optimizer, schedule=schedule, amp=amp_context(cfg.amp, dist.device),
        scaler=torch.amp.GradScaler(dist.device.type) if cfg.amp == "fp16" else None, ema=ema, ddp=ddp,
        # data that never skip (digits, latents) get no skipped-image columns unless something was skipped
        may_skip_images=getattr(data.val, "on_bad_image", None) is not None,
    )


# -- The EMA of the weights --------------------------------------------------------------------------------------------
# Exponential moving average of model weights (DiT keeps one with decay 0.9999).
class EMA:
    """``ema = d * ema + (1 - d) * model`` for floating parameters, buffers copied; ``warmup=True`` at update ``n`` uses
    ``d = min(decay, (1 + n) / (10 + n))``, so a short run is not dominated by its random initialisation."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = False):
        self.decay, self.warmup = float(decay), bool(warmup)
        self.updates = 0
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self._listed: Optional[Tuple[Any, Tuple[List[torch.Tensor], ...]]] = None

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_floats, floats, ema_buffers, buffers = self._pairs(model)
        if floats:
            torch._foreach_lerp_(ema_floats, floats, 1.0 - self.current_decay())
        for e, b in zip(ema_buffers, buffers):
            e.copy_(b)
        self.updates += 1

    def _pairs(self, model: nn.Module) -> Tuple[List[torch.Tensor], ...]:
        """The tensors an update reads and writes, listed at the first update from ``model`` (a training step walks
        neither model)."""
        if self._listed is None or self._listed[0]() is not model:
            floating = [(e, p.detach()) for e, p in zip(self.module.parameters(), model.parameters())
                        if e.dtype.is_floating_point]
            self._listed = (weakref.ref(model), ([e for e, _ in floating], [p for _, p in floating],
                                                 list(self.module.buffers()), list(model.buffers())))
        return self._listed[1]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)


# -- The GPU settings of a fit -----------------------------------------------------------------------------------------
# The anchors' GPU settings, as options with the anchors' defaults, and what a run used of them.
#
# - ``trainer.tf32`` (on, as DiT's train.py sets ``allow_tf32`` for matmuls and cuDNN): fp32 matmuls and convolutions
# run on TF32 tensor cores. CUDA only: on the CPU it would let oneDNN change what fp32 matmuls compute, for no TF32
# gain. - cuDNN benchmarking (on, as in timm's train.py) unless ``trainer.deterministic``: cuDNN times its kernels for
# each new shape and keeps the fastest (TransNeXt's depthwise convolutions otherwise take whatever its heuristic picks).
# - Fused AdamW where torch has a fused kernel for the device (CUDA, CPU; foreach elsewhere): one kernel for the whole
# update, and it takes the skip decision of a non-finite step on the device (``found_inf``), so the host never reads it.
# - ``trainer.grad_checkpointing``: the model's ``set_grad_checkpointing`` (set by ``fit_setup.build_parts``).
#
# Process-wide flags are restored after a fit; ``summary.json`` records what the run used (:func:`device_settings`).
FUSED_OPTIMIZER_DEVICES = ("cuda", "cpu")  # where torch's AdamW has a fused kernel that takes found_inf

_FLAGS = ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
          (torch.backends.cudnn, "benchmark"))


@contextlib.contextmanager
def device_settings(tf32: bool, deterministic: bool, device: torch.device) -> Iterator[Dict[str, bool]]:
    """While entered: TF32 (``tf32``) and cuDNN benchmarking (unless ``deterministic``) on a CUDA ``device``.
    Yields the settings in effect (``tf32``, ``cudnn_benchmark``: false on other devices)."""
    previous = [getattr(owner, name) for owner, name in _FLAGS]
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
        torch.backends.cudnn.benchmark = not deterministic
    try:
        yield {"tf32": on_cuda and bool(tf32), "cudnn_benchmark": on_cuda and not deterministic}
    finally:
        for (owner, name), value in zip(_FLAGS, previous):
            setattr(owner, name, value)


def optimizer_kernel(device: torch.device) -> Dict[str, bool]:
    """The optimizer's implementation keyword for ``device``: ``fused`` where torch has the kernel, else ``foreach``."""
    return {"fused": True} if device.type in FUSED_OPTIMIZER_DEVICES else {"foreach": True}


def optimizer_kernel_of(optimizer: torch.optim.Optimizer) -> str:
    """``fused``, ``foreach`` or ``for-loop``: how ``optimizer`` runs its update (summary.json's ``optimizer_impl``)."""
    defaults: Dict[str, Any] = optimizer.defaults
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
