"""DPM-Solver++ (Lu et al., 2022): a fast sampler of the diffusion ODE (or SDE), for epsilon-predicting DiTs.

The multistep second-order solver on the data prediction, with the settings diffusers' ``DPMSolverMultistepScheduler``
uses by default (what its DiT pipeline is run with at 25 steps): ``solver_order=2``, ``algorithm_type="dpmsolver++"``,
the ``midpoint`` second-order update, ``timestep_spacing="linspace"`` (``round(linspace(0, T - 1, N + 1))`` from the
top, its 0 dropped), a final step to noise level zero (``final_sigmas_type="zero"``), no thresholding. The first step
(no previous output yet) and the last (to sigma 0, where ``lower_order_final`` also asks for it) are first order, which
is DDIM's step; every other step uses the last two data predictions. For a second-order solver ``lower_order_final``
changes nothing else.

With alpha_t = sqrt(alphas_cumprod[t]), sigma_t = sqrt(1 - alphas_cumprod[t]), lambda_t = log(alpha_t / sigma_t) and
h = lambda_next - lambda_now, one step from x at t to t_next with data predictions D0 (now) and D_prev is::

    x_next = sigma_next / sigma_now * x - alpha_next * (exp(-h) - 1) * (D0 + 0.5 * (D0 - D_prev) * h / h_prev)

(the last term only in second-order steps; h_prev is the previous step's h). ``stochastic=True`` is diffusers'
``algorithm_type="sde-dpmsolver++"`` (the same midpoint multistep on the SDE, a fresh normal draw z each step)::

    x_next = sigma_next / sigma_now * exp(-h) * x
             + alpha_next * (1 - exp(-2h)) * (D0 + 0.5 * (D0 - D_prev) * h / h_prev)
             + sigma_next * sqrt(1 - exp(-2h)) * z

whose first-order step is DDPM's ancestral step in lambda. A learned-variance model returns 2C
channels; as diffusers' DiT pipeline does, the solver reads only the first C (epsilon). Guidance is the model function's
business (:func:`~moh_vision.diffusion.guidance.guided_model_fn`), as for the other samplers."""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import numpy as np
import torch

from ..errors import ConfigError


def dpm_solver_timesteps(num_timesteps: int, steps: int) -> List[int]:
    """The ``steps`` timesteps diffusers' ``linspace`` spacing visits, from the noisiest down (numpy's rounding)."""
    if not 1 <= int(steps) <= num_timesteps:
        raise ConfigError(f"sampler=dpm++ steps={steps}: use 1 to {num_timesteps} solver steps (25: diffusers' DiT)")
    grid = np.linspace(0, num_timesteps - 1, int(steps) + 1).round()[::-1][:-1]
    return [int(t) for t in grid]


def dpm_solver_sample(diffusion, model_fn: Callable, noise: torch.Tensor, steps: int = 25,
                      model_kwargs: Optional[dict] = None, clip_denoised: bool = False, progress: bool = False,
                      stochastic: bool = False, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """x_0 from ``noise`` (x_T) by ``steps`` DPM-Solver++ steps over ``diffusion``'s own timesteps (give the training
    process, unrespaced: every model call goes through its ``timestep_map``). ``clip_denoised`` clamps each data
    prediction to [-1, 1] (pixel space; diffusers' thresholding with ratio 1). Deterministic (no random draw) unless
    ``stochastic``: then each step but the last draws its noise from ``generator``.

    The schedule's coefficients are computed once on the host in float64, so a step is tensor arithmetic with Python
    numbers: no device read, no host-to-device copy."""
    timesteps = dpm_solver_timesteps(diffusion.num_timesteps, steps)
    alphas_cumprod = diffusion.alphas_cumprod.tolist()
    alpha = [math.sqrt(alphas_cumprod[t]) for t in timesteps] + [1.0]  # the final point: noise level zero
    sigma = [math.sqrt(1.0 - alphas_cumprod[t]) for t in timesteps] + [0.0]
    lam = [math.log(a / s) if s > 0 else math.inf for a, s in zip(alpha, sigma)]

    x = noise
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    previous: Optional[torch.Tensor] = None
    order = range(len(timesteps))
    if progress:
        from tqdm.auto import tqdm
        order = tqdm(order, desc=f"dpm++{'sde' if stochastic else ''} sampling ({len(timesteps)} steps)")
    for i in order:
        t = torch.full((x.shape[0],), timesteps[i], device=x.device, dtype=torch.long)
        with torch.no_grad():
            pred, _ = diffusion._split_output(diffusion._call_model(model_fn, x, t, model_kwargs), x)
        x_work = x.to(dtype)
        data = pred if diffusion.mean_type == "x0" else (x_work - sigma[i] * pred) / alpha[i]
        if clip_denoised:
            data = data.clamp(-1, 1)
        if sigma[i + 1] == 0.0:  # the last step: to sigma 0, first order, lands on the data prediction
            x_work = data
        else:
            h = lam[i + 1] - lam[i]
            direction = data
            if previous is not None:  # second order (midpoint), from the last two data predictions
                r = (lam[i] - lam[i - 1]) / h
                direction = data + 0.5 * (data - previous) / r
            if stochastic:
                kept = -math.expm1(-2.0 * h)  # 1 - exp(-2h)
                z = torch.randn(x.shape, generator=generator, device=x.device, dtype=dtype)
                x_work = ((sigma[i + 1] / sigma[i] * math.exp(-h)) * x_work + (alpha[i + 1] * kept) * direction
                          + (sigma[i + 1] * math.sqrt(kept)) * z)
            else:
                x_work = (sigma[i + 1] / sigma[i]) * x_work - (alpha[i + 1] * math.expm1(-h)) * direction
        previous = data
        x = x_work.to(noise.dtype)
    return x
