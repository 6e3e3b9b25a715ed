"""The trainer's two collaborators, written down: a ``Task`` and a ``Data`` object.

The trainer (``moh_vision.engine.trainer``) never asks what concrete class it was given: it calls the members below and
nothing else (and the optional ``OPTIONAL_TASK_MEMBERS``). A task never sees the trainer: its end-of-epoch work gets an
``EpochContext``, its work between steps a ``StepContext``, frozen snapshots.

Data may declare optional capabilities (``DATA_CAPABILITIES``); read them with ``capability``, which supplies the
documented default for data that do not declare one."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset


@runtime_checkable
class Data(Protocol):
    """A data module: the two splits and what a model needs to know about them.

    ``train`` and ``val`` are map-style datasets of ``(image, label)`` pairs (or whatever ``collate_fn`` turns into the
    task's batches). The trainer builds the loaders itself (samplers that resume mid-epoch, one seeded generator per
    loader), so data hand over datasets, not loaders."""
    train: Dataset
    val: Dataset
    num_classes: int
    in_chans: int
    img_size: int
    collate_fn: Optional[Callable[[list], Any]]  # None: PyTorch's default collate
    mixup: Optional[Callable]  # batch mixup/cutmix for classification, or None
    repeated_aug: int  # each training item this many times per epoch (DeiT's repeated augmentation)
    label_smoothing: float

    def describe(self) -> str:
        """One line for train.log: what the data are and how many images each split holds."""


# Optional capabilities of a data object, and what data that do not declare one get.
DATA_CAPABILITIES: Dict[str, Any] = {
    # the one task these data are for (latents: "diffusion"); None: any task
    "task": None,
    # the embedded digits: diffusion samples can be scored by the digits classifier (sample/class_acc, fd)
    "digit_metrics": False,
    # VAE latents: the factor the latents were scaled by; None: pixel data
    "scale_factor": None,
    # VAE latents: the VAE they were extracted with, as recorded in their index; None: unknown
    "vae_path": None,
}


def capability(data: Any, name: str) -> Any:
    """``data``'s declared capability ``name`` (a key of ``DATA_CAPABILITIES``), else its default."""
    return getattr(data, name, DATA_CAPABILITIES[name])


@dataclass(frozen=True)
class EpochContext:
    """What a task's end-of-epoch work may use: where the run stands and where to write.

    Built by the trainer after validation; ``model_for_eval`` is the EMA model when the run keeps one, else the trained
    model without its DDP/compile wrapper. ``log_image(key, path, caption=...)`` logs an image file at this step."""
    epoch: int
    step: int
    last_epoch: bool
    is_main: bool
    device: torch.device
    out_dir: Path
    model_for_eval: nn.Module
    log_image: Callable[..., None]


@dataclass(frozen=True)
class StepContext:
    """What a task's work between optimizer steps may use (the function its optional ``step_hook()`` returns).

    Built by the trainer on every rank after each optimizer step and after each epoch's validation, before the
    checkpoints of that moment (``numbered``: ``checkpoints/step_<step>.pt`` is written now). ``model_for_eval`` as in
    ``EpochContext`` (the trainer puts the model back in training mode afterwards). ``sample_images(task, model, mode,
    num_samples, num_classes, seed, parts, progress=...)``: every rank samples its share as ``tools/sample.py`` does
    (DiT's per-rank seeding); rank 0 gets ``(uint8 NHWC images, labels)`` in output order, the others None.
    ``share(value)``: rank 0's value, on every rank. ``progress``: whether the run shows progress bars."""
    step: int
    epoch: int
    numbered: bool
    is_main: bool
    world_size: int
    device: torch.device
    out_dir: Path
    model_for_eval: nn.Module
    progress: bool
    sample_images: Callable[..., Any]
    share: Callable[[Any], Any]


@runtime_checkable
class Task(Protocol):
    """What turns batches into losses and a model into metrics.

    ``model_cfg`` is the run's model config (``name``, ``checkpoint_path``, ``init_from``, ``kwargs``); the trainer
    reads the name (checkpoints record it) and whether the model starts from other weights
    (``trainer.val_at_start=auto``). ``primary_metric`` (a key of the epoch row) decides ``best.pt``: higher is better
    when ``primary_mode`` is ``"max"``, lower when ``"min"``."""
    name: str
    primary_metric: str
    primary_mode: str
    model_cfg: Mapping[str, Any]

    def build_model(self, data: Data) -> nn.Module:
        """The model for these data (on the CPU; the trainer moves it)."""

    def input_shape(self, data: Data) -> Tuple[int, ...]:
        """One input's shape without the batch dimension (for FLOP counting)."""

    @property
    def flops_kwargs(self) -> Optional[Dict[str, torch.Tensor]]:
        """Extra forward inputs for FLOP counting, or None."""

    def training_step(self, model: nn.Module, batch: Any, device: torch.device) -> Dict[str, Any]:
        """Loss dict of one batch: ``loss`` (a tensor, or None when every image of the batch was unreadable),
        ``num_samples``, ``skipped``; optionally ``ce``/``aux`` tensors, ``log/<name>`` numbers (averaged over the epoch
        into ``train/<name>``) and ``routing`` statistics."""

    def evaluate(self, model: nn.Module, loader: Any, device: torch.device,
                 amp: Callable[[], ContextManager]) -> Dict[str, float]:
        """Sums over this rank's share of the validation set (summed over ranks by the trainer)."""

    def finalize(self, sums: Dict[str, float], prefix: str = "val") -> Dict[str, float]:
        """Metrics ``<prefix>/<name>`` from the sums of all ranks."""

    def on_epoch_end(self, ctx: EpochContext) -> Dict[str, float]:
        """Work after validation (sample grids, sample metrics): metrics to add to the epoch row."""


# Optional members of a task, which the trainer looks for and does without:
#   step_hook() -> Optional[Callable[[StepContext], Dict[str, float]]]: called once on every rank before the first step
#   (the place to check what the work needs, with a one-line error); the function it returns (None: no work between
#   steps) runs on every rank after each optimizer step and returns metrics ({} most steps), which the trainer logs
#   with the step to metrics.csv and wandb and keeps for summary.json (the diffusion task's FID during training).
OPTIONAL_TASK_MEMBERS = ("step_hook",)
