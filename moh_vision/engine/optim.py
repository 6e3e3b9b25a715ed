"""AdamW with the TransNeXt/DeiT no-weight-decay groups, and per-step learning-rate schedules."""
from __future__ import annotations

import math
from typing import Iterable, List, Sequence

import torch
from torch import nn

from moh_vision.errors import ConfigError


def no_decay_names(model: nn.Module) -> set:
    """Names the model asks to exclude (``no_weight_decay``) plus keyword matches (``no_weight_decay_keywords``)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    keywords = set(getattr(model, "no_weight_decay_keywords", lambda: set())())
    names = set()
    for name, _ in model.named_parameters():
        if name in skip or any(k in name for k in keywords):
            names.add(name)
    return names


def param_groups(model: nn.Module, weight_decay: float, extra_keywords: Sequence[str] = ()) -> List[dict]:
    """Two groups: decayed weights, and 1-D params / biases / the model's no-decay list with wd 0."""
    skip = no_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or name in skip or any(k in name for k in extra_keywords):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.05,
                    betas: Iterable[float] = (0.9, 0.999), eps: float = 1e-8,
                    no_weight_decay_keywords: Sequence[str] = (), **kernel: bool) -> torch.optim.Optimizer:
    """AdamW; ``kernel``: its implementation (``fused=True`` or ``foreach=True``: device_settings.optimizer_kernel)."""
    if name != "adamw":
        raise ConfigError(f"optim.name={name} is unknown; available: adamw")
    groups = param_groups(model, weight_decay, no_weight_decay_keywords)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **kernel)


class Schedule:
    """Learning rate as a pure function of the optimizer step (so resuming needs only the step)."""

    def __init__(self, name: str, base_lr: float, total_steps: int, warmup_steps: int = 0,
                 warmup_lr: float = 1e-6, min_lr: float = 0.0):
        if name not in ("cosine", "constant"):
            raise ConfigError(f"sched.name={name} is unknown; available: cosine, constant")
        self.name, self.base_lr, self.total_steps = name, float(base_lr), max(1, int(total_steps))
        self.warmup_steps, self.warmup_lr, self.min_lr = int(warmup_steps), float(warmup_lr), float(min_lr)

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * step / self.warmup_steps
        if self.name == "constant":
            return self.base_lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
