"""Noise schedules and timestep respacing.

Schedules are float64 torch tensors on the host: the cumulative products over 1000 steps lose accuracy in float32, and
the closed forms built from them (posterior coefficients, log variances) amplify it. A ``GaussianDiffusion`` copies them
(and the respacing's timestep map) to a device once, at their first use there."""
import math
from typing import Iterable, List, Sequence, Tuple, Union

import torch

from ..errors import ConfigError

NOISE_SCHEDULES = ("linear", "squaredcos_cap_v2")


def get_named_beta_schedule(name: str, num_timesteps: int) -> torch.Tensor:
    """Betas for ``num_timesteps`` steps of a named schedule, as a float64 tensor. ``linear`` is Ho et al.'s 1e-4..0.02
    over 1000 steps, rescaled by ``1000 / num_timesteps`` so that the total amount of noise stays the same for any
    number of steps. ``squaredcos_cap_v2`` is Nichol & Dhariwal's cosine schedule."""
    if num_timesteps < 1:
        raise ConfigError(f"diffusion_steps={num_timesteps} must be at least 1")
    if name == "linear":
        scale = 1000 / num_timesteps
        return _linspace(scale * 1e-4, scale * 0.02, num_timesteps)
    if name == "squaredcos_cap_v2":
        return betas_for_alpha_bar(num_timesteps, lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2)
    raise ConfigError(f"unknown noise_schedule {name!r}; known: {', '.join(NOISE_SCHEDULES)}")


def _linspace(start: float, end: float, n: int) -> torch.Tensor:
    # start + i * step with an exact last value: bit-identical to numpy.linspace (torch.linspace rounds differently), so
    # schedules and losses match the reference implementation to the last bit.
    values = torch.arange(n, dtype=torch.float64) * ((end - start) / max(n - 1, 1)) + start
    if n > 1:
        values[-1] = end
    return values


def betas_for_alpha_bar(num_timesteps: int, alpha_bar, max_beta: float = 0.999) -> torch.Tensor:
    """Discretise a continuous alpha_bar(s), s in [0, 1], into betas; capped to avoid a singular last step."""
    betas = [min(1 - alpha_bar((i + 1) / num_timesteps) / alpha_bar(i / num_timesteps), max_beta)
             for i in range(num_timesteps)]
    return torch.tensor(betas, dtype=torch.float64)


def space_timesteps(num_timesteps: int, section_counts: Union[str, int, Sequence[int]]) -> List[int]:
    """The sorted original timesteps kept when a ``num_timesteps`` process is sampled with fewer steps.

    ``section_counts``: ``"250"`` or ``250`` spreads 250 steps evenly over the whole process (first and last kept);
    ``"10,15,20"`` or ``[10, 15, 20]`` cuts the process into equal sections, each strided to its own count; ``"ddim50"``
    is the DDIM paper's integer stride ``range(0, T, k)`` giving exactly 50 steps."""
    if isinstance(section_counts, str):
        spec = section_counts.strip()
        if spec.startswith("ddim"):
            want = _parse_count(spec[len("ddim"):], section_counts)
            # Strides 1..T-1 only (as DiT / guided-diffusion): a single step ("ddim1") is not a sampler.
            for stride in range(1, num_timesteps):
                if len(range(0, num_timesteps, stride)) == want:
                    return list(range(0, num_timesteps, stride))
            raise ConfigError(f"timestep_respacing={section_counts!r}: no integer stride in 1..{num_timesteps - 1} "
                              f"gives exactly {want} of {num_timesteps} steps")
        counts = [_parse_count(part, section_counts) for part in spec.split(",")]
    elif isinstance(section_counts, int):
        counts = [section_counts]
    else:
        counts = [int(c) for c in section_counts]

    base, extra = divmod(num_timesteps, len(counts))
    kept, start = [], 0
    for i, count in enumerate(counts):
        size = base + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ConfigError(f"timestep_respacing={section_counts!r}: cannot take {count} steps from a section "
                              f"of {size} (of {num_timesteps} in all)")
        stride = (size - 1) / (count - 1) if count > 1 else 1
        # A running float position rounded at each step, as in DiT's respacing (round(j * stride) differs for some
        # counts: 21, 23, 31, ... of 1000)
        position = 0.0
        for _ in range(count):
            kept.append(start + round(position))
            position += stride
        start += size
    return sorted(set(kept))


def _parse_count(text: str, spec) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"timestep_respacing={spec!r} is not 'N', 'N1,N2,...' or 'ddimN'") from None


def respace_betas(betas: torch.Tensor, kept: Iterable[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Betas of a shorter process whose alphas_cumprod equal the original ones at the ``kept`` steps. Returns
    ``(new_betas, timestep_map)``: ``timestep_map[i]`` is the original timestep that respaced step ``i`` stands for,
    which is what a model trained on the full process must be shown."""
    alphas_cumprod = torch.cumprod(1.0 - betas.to(torch.float64), dim=0)
    timestep_map = torch.tensor(sorted(set(int(k) for k in kept)), dtype=torch.long)
    if len(timestep_map) == 0 or timestep_map[0] < 0 or timestep_map[-1] >= len(betas):
        raise ConfigError(f"kept timesteps must be a non-empty subset of 0..{len(betas) - 1}")
    kept_cumprod = alphas_cumprod[timestep_map]
    previous = torch.cat([kept_cumprod.new_ones(1), kept_cumprod[:-1]])
    return 1.0 - kept_cumprod / previous, timestep_map
