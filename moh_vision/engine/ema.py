"""Exponential moving average of model weights (DiT keeps one with decay 0.9999)."""
from __future__ import annotations

import copy
from typing import Dict

import torch
from torch import nn


class EMA:
    """``ema = decay * ema + (1 - decay) * model`` for floating parameters; buffers are copied."""

    def __init__(self, model: nn.Module, decay: float = 0.9999):
        self.decay = float(decay)
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_params = [p for p in self.module.parameters()]
        params = [p.detach() for p in model.parameters()]
        floating = [(e, p) for e, p in zip(ema_params, params) if e.dtype.is_floating_point]
        if floating:
            torch._foreach_lerp_([e for e, _ in floating], [p for _, p in floating], 1.0 - self.decay)
        for e, b in zip(self.module.buffers(), model.buffers()):
            e.copy_(b)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
