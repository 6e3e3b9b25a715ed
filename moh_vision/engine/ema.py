"""Exponential moving average of model weights (DiT keeps one with decay 0.9999)."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn


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
