"""Classifier-free guidance (Ho & Salimans) for a class-conditional model ``model(x, t, y)``."""
from typing import Callable, Optional

import torch

from ..errors import ConfigError


def guided_model_fn(model: Callable, cfg_scale: float, null_class: int,
                    guidance_channels: Optional[int] = None) -> Callable:
    """Wrap ``model(x, t, y)`` into a guided ``fn(x, t, y)`` with the same output layout.

    It runs the batch twice in one forward, with the labels ``y`` and with ``null_class`` (the "drop label" embedding),
    and returns ``eps_uncond + cfg_scale * (eps_cond - eps_uncond)`` on the first ``guidance_channels`` eps channels
    (default all; ``3`` reproduces DiT's sample.py, which guides 3 of the 4 latent channels), the other channels from
    the conditional half. ``cfg_scale == 1`` is the plain conditional model."""
    if guidance_channels is not None and guidance_channels < 1:
        raise ConfigError(f"guidance_channels={guidance_channels} must be a positive channel count or None")

    def guided(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if cfg_scale == 1:
            return model(x, t, y)
        channels = x.shape[1] if guidance_channels is None else guidance_channels
        if channels > x.shape[1]:
            raise ConfigError(f"guidance_channels={guidance_channels} exceeds the {x.shape[1]} input channels")
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null_class)]))
        cond, uncond = out.chunk(2, dim=0)
        mixed = uncond[:, :channels] + cfg_scale * (cond[:, :channels] - uncond[:, :channels])
        return torch.cat([mixed, cond[:, channels:]], dim=1)

    guided.model = model  # lets samplers find the device of the wrapped model
    return guided
