"""One training step of a recipe's model on a device, checked: does it run, which kernels ran, and (CUDA) does it make
the host wait for the device? ``tools/gpu_checks.sh`` part ``steps`` runs it on a lent GPU.

``python -m moh_vision.apps.step_check <record.json> <batch> <experiment> [<experiment> ...]`` composes each
``experiment=<name>`` config as ``train.py`` would (``+``-joined words are further overrides:
``moh_transnext_small_80+data.img_size=64``), builds its task and model, its optimizer, AMP, gradient scaler,
clipping and EMA as the trainer does, and takes two optimizer steps on a random batch of ``batch`` images (or latents):
a warm-up (Triton's compiles, the optimizer's state, the diffusion schedules placed on the device) and the checked step,
under ``torch.cuda.set_sync_debug_mode("error")`` on CUDA (the batch's copy to the device made before it). The record,
one entry per experiment: ``passed``, the error's first line and the stack where a step failed (a synchronising call
raises there), ``kernels_ran``, ``kernel_fallbacks`` and ``kernels_in_use`` (:mod:`moh_vision.ops.dispatch`), the
device and torch's version. On the CPU there is no sync debug mode: the steps just run (``tests/test_kernel_fallback.py``
runs it so). The data are never read: the recipe's image size, channels and classes are the config's (latents: 32 x 32
x 4, ImageNet-256's, 1000 classes); the recipe's mixup and cutmix are applied to the batch as the loader's would be."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

import torch

from moh_vision.config import build_task, compose
from moh_vision.ops import Kernels, resolved
from moh_vision.ops.dispatch import RUNS, first_line
from moh_vision.engine.fit_setup import EMA, amp_context, optimizer_kernel
from moh_vision.engine.optim import build_optimizer
from moh_vision.engine.step_on_device import gradient_norm, step_unless, takes_found_inf

LATENTS = {"img_size": 32, "in_chans": 4, "num_classes": 1000}  # ImageNet-256 through the SD VAE


def data_like(data_cfg: Dict[str, Any], task: str) -> SimpleNamespace:
    """What a task's ``build_model`` and ``training_step`` read of the data, from the data config alone."""
    from moh_vision.data.transforms import build_mixup
    if data_cfg["name"] == "latents":
        return SimpleNamespace(**LATENTS, mixup=None, label_smoothing=0.0)
    classes = int(data_cfg.get("num_classes") or 1000)
    smoothing = float(data_cfg.get("label_smoothing") or 0.0)
    mixup = None
    if task == "classification" and (data_cfg.get("mixup") or data_cfg.get("cutmix")):
        mixup = build_mixup(classes, data_cfg["mixup"], data_cfg["cutmix"], data_cfg["mixup_switch_prob"], smoothing,
                            data_cfg["mixup_prob"])
    return SimpleNamespace(img_size=int(data_cfg["img_size"]), in_chans=int(data_cfg["in_chans"]), num_classes=classes,
                           mixup=mixup, label_smoothing=smoothing)


class RecipeStep:
    """A recipe's model, optimizer and step, as the trainer builds and takes them (no loader, DDP or schedule)."""

    def __init__(self, overrides: Sequence[str], device: torch.device):
        from omegaconf import OmegaConf
        cfg = compose("train", list(overrides))
        config = OmegaConf.to_container(cfg, resolve=True)
        self.device, self.trainer = device, cfg.trainer
        self.task = build_task(config["task"], model=config["model"], attention=config["attention"],
                               kernels=config["kernels"])
        self.data = data_like(config["data"], cfg.task.name)
        self.kernels = Kernels.of(config["kernels"])
        self.model = self.task.build_model(self.data).to(device).train()
        if cfg.trainer.grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        self.optimizer = build_optimizer(self.model, **config["optim"], kernel=optimizer_kernel(device))
        self.amp = amp_context(cfg.trainer.amp, device)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.trainer.amp == "fp16" else None
        self.ema = EMA(self.model, cfg.trainer.ema.decay, cfg.trainer.ema.warmup) if cfg.trainer.ema.enabled else None
        self.params = list(self.model.parameters())
        self.describe = {"model": config["model"]["name"], "task": cfg.task.name, "amp": cfg.trainer.amp,
                         "grad_checkpointing": bool(cfg.trainer.grad_checkpointing), "ema": self.ema is not None}

    def batch(self, size: int, seed: int = 0):
        """A random batch on the host, as a loader hands it over."""
        g = torch.Generator().manual_seed(seed)
        data = self.data
        x = torch.randn(size, data.in_chans, data.img_size, data.img_size, generator=g)
        return x, torch.randint(0, data.num_classes, (size,), generator=g)

    def step(self, batch) -> torch.Tensor:
        """Forward, backward, unscale, clip, optimizer step (skipped on the device where not finite), EMA: the
        trainer's optimizer step. Returns the loss, unread."""
        with self.amp():
            out = self.task.training_step(self.model, batch, self.device)
        loss = out["loss"]
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        params = [p for p in self.params if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = gradient_norm(params, float(self.trainer.clip_grad))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif takes_found_inf(self.optimizer):
            step_unless(self.optimizer, ~torch.isfinite(norm))
        else:
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def check_step(overrides: Sequence[str], device: torch.device, batch: int = 2, sync_debug: bool = True) -> Dict:
    """A warm-up step and a checked step of the recipe that ``overrides`` compose (see the module docstring)."""
    RUNS.reset()
    record: Dict[str, Any] = {"overrides": list(overrides), "device": str(device), "batch": batch,
                              "torch": torch.__version__, "passed": False, "stage": "build"}
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    checked = sync_debug and device.type == "cuda"
    record["sync_debug_mode"] = "error" if checked else None
    kernels = Kernels()
    try:
        recipe = RecipeStep(overrides, device)
        record.update(recipe.describe)
        kernels = recipe.kernels
        record["stage"] = "warm-up step"
        recipe.step([t.to(device) for t in recipe.batch(batch, seed=0)])
        on_device = [t.to(device) for t in recipe.batch(batch, seed=1)]  # the batch's copy: before the check
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record["stage"] = "checked step"
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = recipe.step(on_device)
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode(0)
        record.update(passed=True, stage="done", loss=float(loss))
    except Exception as error:  # noqa: BLE001 - the record says what failed and where
        record.update(error=first_line(error), stack=traceback.format_exc(limit=-12))
    record.update(kernels_ran=RUNS.kernels_ran(device), kernel_fallbacks=RUNS.fallbacks(device))
    record["kernels_in_use"] = resolved(kernels, device)
    return record


def main(argv: List[str]) -> int:
    out, batch, *experiments = argv
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for experiment in experiments:
        name, *more = experiment.split("+")
        records.append({"experiment": name, **check_step([f"experiment={name}", *more], device, int(batch))})
        print(f"{name}: {'passed' if records[-1]['passed'] else 'FAILED: ' + records[-1]['error']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(records, indent=1))
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
