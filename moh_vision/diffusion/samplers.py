"""The one place a sampler is chosen: ``sampler=ddpm | ddim | dpm++ | dpm++sde`` with its ``steps``.

``ddpm`` and ``ddim`` walk a respaced process (``steps``: ``"250"``, ``"ddim50"``, ... as
:func:`~moh_vision.diffusion.schedule.space_timesteps` reads it); ``dpm++`` takes ``steps`` solver steps (an integer,
25 being diffusers' DiT setting) over the training process (:mod:`.dpm_solver`), ``dpm++sde`` as many of its stochastic
form (diffusers' ``sde-dpmsolver++``). ``tools/sample.py``, the training
run's grids and digits metrics and the FID during training all sample through :func:`sample_with`."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from ..errors import ConfigError
from .dpm_solver import dpm_solver_sample
from .gaussian_diffusion import create_diffusion

SAMPLERS = ("ddpm", "ddim", "dpm++", "dpm++sde")
SOLVERS = ("dpm++", "dpm++sde")  # steps: solver steps, not a respacing


def solver_steps(steps: Any, sampler: str = "dpm++") -> int:
    """``steps`` of ``sampler=dpm++`` (or ``dpm++sde``): a positive integer (not a respacing such as ``ddim50``)."""
    text = str(steps).strip()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"sampler={sampler} takes steps=<number of solver steps> (e.g. 25), not steps={steps}")
    return int(text)


def check_sampler(sampler: str, steps: Any, diffusion_steps: int = 1000) -> None:
    """A one-line error for a sampler that is not known or steps it cannot take, before any sample is drawn."""
    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler={sampler}: use {', '.join(SAMPLERS)}")
    if sampler in SOLVERS:
        from .dpm_solver import dpm_solver_timesteps
        dpm_solver_timesteps(diffusion_steps, solver_steps(steps, sampler))
    else:
        from .schedule import space_timesteps
        space_timesteps(diffusion_steps, str(steps))


def sample_with(sampler: str, steps: Any, diffusion_args: Mapping[str, Any], model_fn: Callable, noise: torch.Tensor,
                model_kwargs: Optional[dict] = None, clip_denoised: bool = False, progress: bool = False,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """x_0 from ``noise`` by ``sampler`` in ``steps``, for a diffusion made by ``create_diffusion(**diffusion_args)``
    (the training process's options: schedule, steps, learned sigma). ``generator`` gives the noise of every step of
    DDPM and ``dpm++sde``; DDIM (eta 0) and DPM-Solver++ draw nothing."""
    if sampler in SOLVERS:
        return dpm_solver_sample(create_diffusion("", **diffusion_args), model_fn, noise, solver_steps(steps, sampler),
                                 model_kwargs=model_kwargs, clip_denoised=clip_denoised, progress=progress,
                                 stochastic=sampler == "dpm++sde", generator=generator)
    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler={sampler}: use {', '.join(SAMPLERS)}")
    diffusion = create_diffusion(str(steps), **diffusion_args)
    return diffusion.sample(model_fn, noise.shape, model_kwargs=model_kwargs, sampler=sampler, noise=noise,
                            clip_denoised=clip_denoised, progress=progress, device=noise.device, generator=generator)
