"""Gaussian diffusion (DDPM / improved DDPM as used by ADM and DiT): forward process, losses, samplers.

Notation: ``x0`` clean data, ``x_t`` its noised version at step ``t`` (0-based, so ``t = 0`` is one step of noise),
``alphas_cumprod[t]`` = prod_{s <= t} (1 - beta_s). The model is called as ``model(x_t, t, **model_kwargs)`` and
predicts epsilon (or x0) in its first ``C`` output channels; with a learned variance it returns ``2C`` channels, the
last ``C`` being ``v`` in [-1, 1], interpolating the log variance from the posterior variance (-1) to beta_t (+1).

A respaced process (fewer steps, see :mod:`.schedule`) carries a ``timestep_map``; every model call goes through it, so
the model always sees the timesteps of the process it was trained on.

The schedules are defined on the host (float64 attributes) and read on the device of the data: the first call on a
device copies them there once (:meth:`GaussianDiffusion.schedules_on`), so a training or sampling step makes no
host-to-device copy and no device read (a blocking copy from pageable memory makes the host wait for the stream)."""
import math
from typing import Callable, Dict, Iterator, Optional, Sequence, Union

import torch

from ..errors import ConfigError
from .losses import discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .schedule import get_named_beta_schedule, respace_betas, space_timesteps

MEAN_TYPES = ("eps", "x0")
VAR_TYPES = ("learned_range", "fixed_small", "fixed_large")
LOSS_TYPES = ("mse", "rescaled_mse", "kl", "rescaled_kl")
SAMPLERS = ("ddpm", "ddim")
# The per-step schedules, float64 [T] attributes of a GaussianDiffusion; read on a device through schedules_on.
SCHEDULES = ("betas", "log_betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod",
             "sqrt_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
             "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
             "fixed_large_variance", "log_fixed_large_variance")


def uniform_timesteps(batch_size: int, num_timesteps: int, device=None, generator=None) -> torch.Tensor:
    """One timestep per sample, uniform over 0..num_timesteps-1 (DiT's training distribution)."""
    return torch.randint(0, num_timesteps, (batch_size,), device=device, generator=generator)


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # Diffusion arithmetic stays in float32 even when the model runs in half precision.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class GaussianDiffusion:
    """A discrete Gaussian diffusion process defined by its ``betas`` (per-step noise variances in (0, 1], float64).

    ``mean_type``: what the model's first C channels predict, ``"eps"`` or ``"x0"``. ``var_type``: ``"learned_range"``
    (2C outputs), ``"fixed_small"`` (posterior variance) or ``"fixed_large"`` (beta_t). ``loss_type``: ``"mse"`` (MSE on
    the mean target, plus the VB term when the variance is learned: DiT's hybrid loss), ``"rescaled_mse"`` (VB scaled by
    T/1000), ``"kl"`` (VB only) or ``"rescaled_kl"`` (VB times T). ``timestep_map``: the original timestep of each step,
    for respaced processes (None: identity). The schedules (:data:`SCHEDULES`) and the map stay on the host; each
    device gets its copy once, at its first use (:meth:`schedules_on`)."""

    def __init__(self, betas, mean_type: str = "eps", var_type: str = "learned_range", loss_type: str = "mse",
                 timestep_map: Optional[Sequence[int]] = None):
        _check_choice("mean_type", mean_type, MEAN_TYPES)
        _check_choice("var_type", var_type, VAR_TYPES)
        _check_choice("loss_type", loss_type, LOSS_TYPES)
        self.mean_type, self.var_type, self.loss_type = mean_type, var_type, loss_type

        betas = torch.as_tensor(betas, dtype=torch.float64).clone()
        if betas.ndim != 1 or len(betas) == 0 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ConfigError("betas must be a non-empty 1-D sequence of values in (0, 1]")
        self.betas = betas
        self.log_betas = torch.log(betas)
        self.num_timesteps = T = len(betas)
        self.timestep_map = (torch.arange(T) if timestep_map is None
                             else torch.as_tensor(timestep_map, dtype=torch.long).clone())
        if self.timestep_map.shape != (T,):
            raise ConfigError(f"timestep_map has {len(self.timestep_map)} entries for {T} steps")

        # Forward process q(x_t | x0).
        alphas = 1.0 - betas
        self.alphas_cumprod = ac = torch.cumprod(alphas, dim=0)
        self.alphas_cumprod_prev = ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
        self.sqrt_alphas_cumprod = ac.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - ac).sqrt()
        self.sqrt_recip_alphas_cumprod = (1.0 / ac).sqrt()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / ac - 1.0).sqrt()

        # Posterior q(x_{t-1} | x_t, x0) = N(coef1 * x0 + coef2 * x_t, posterior_variance).
        self.posterior_variance = betas * (1.0 - ac_prev) / (1.0 - ac)
        # The variance is exactly 0 at t = 0; its log borrows the t = 1 value so it stays finite.
        first = self.posterior_variance[1:2] if T > 1 else betas[:1]
        self.posterior_log_variance_clipped = torch.log(torch.cat([first, self.posterior_variance[1:]]))
        self.posterior_mean_coef1 = betas * ac_prev.sqrt() / (1.0 - ac)
        self.posterior_mean_coef2 = (1.0 - ac_prev) * alphas.sqrt() / (1.0 - ac)

        # fixed_large uses beta_t, except at t = 0 where the posterior variance gives a better decoder NLL.
        self.fixed_large_variance = torch.cat([first, betas[1:]])
        self.log_fixed_large_variance = torch.log(self.fixed_large_variance)
        self._placed: Dict[torch.device, Dict[str, torch.Tensor]] = {}

    @property
    def learn_sigma(self) -> bool:
        return self.var_type == "learned_range"

    # -- Helpers -------------------------------------------------------------------------------------------------------
    def schedules_on(self, device: Union[str, torch.device]) -> Dict[str, torch.Tensor]:
        """The :data:`SCHEDULES` (float64) and the ``timestep_map`` on ``device``, by name: copied there at the first
        call for that device (one copy of the schedules stacked, one of the map) and kept; later calls copy nothing."""
        device = torch.device(device)
        placed = self._placed.get(device)
        if placed is None:
            table = torch.stack([getattr(self, name) for name in SCHEDULES]).to(device)
            placed = dict(zip(SCHEDULES, table.unbind(0)), timestep_map=self.timestep_map.to(device))
            self._placed[device] = self._placed[table.device] = placed  # "cuda" and "cuda:0" alike
        return placed

    def _extract(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Schedule ``name`` (of :data:`SCHEDULES`) at ``t`` as a [B, 1, ..., 1] tensor on like's device, gathered in
        float64 and then cast."""
        values = self.schedules_on(like.device)[name][t.to(like.device)].to(_work_dtype(like))
        return values.view(-1, *([1] * (like.ndim - 1)))

    def _call_model(self, model, x, t, model_kwargs):
        original_t = self.schedules_on(t.device)["timestep_map"][t]
        return model(x, original_t, **(model_kwargs or {}))

    def _split_output(self, output: torch.Tensor, x: torch.Tensor):
        """Model output -> (mean prediction, variance values or None), in the working dtype."""
        output = output.to(_work_dtype(x))
        B, C = x.shape[:2]
        if self.learn_sigma:
            if output.shape != (B, 2 * C, *x.shape[2:]):
                raise ValueError(f"learned-sigma model output has shape {tuple(output.shape)}; expected "
                                 f"{(B, 2 * C, *x.shape[2:])} (mean and variance channels)")
            return output[:, :C], output[:, C:]
        if output.shape != x.shape:
            raise ValueError(f"model output has shape {tuple(output.shape)}; expected {tuple(x.shape)}")
        return output, None

    def _predict_xstart_from_eps(self, x_t, t, eps):
        return self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t \
            - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t) * eps

    def _predict_eps_from_xstart(self, x_t, t, x0):
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t - x0) \
            / self._extract("sqrt_recipm1_alphas_cumprod", t, x_t)

    # -- Forward process and posterior ---------------------------------------------------------------------------------
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Draw x_t ~ q(x_t | x0) = N(sqrt(ab_t) x0, (1 - ab_t) I), using ``noise`` if given."""
        if noise is None:
            noise = torch.randn_like(x0)
        return self._extract("sqrt_alphas_cumprod", t, x0) * x0 \
            + self._extract("sqrt_one_minus_alphas_cumprod", t, x0) * noise

    def q_posterior_mean_variance(self, x0, x_t, t):
        """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x0)."""
        mean = self._extract("posterior_mean_coef1", t, x_t) * x0 \
            + self._extract("posterior_mean_coef2", t, x_t) * x_t
        variance = self._extract("posterior_variance", t, x_t)
        log_variance = self._extract("posterior_log_variance_clipped", t, x_t)
        return mean, variance, log_variance

    # -- Reverse process p(x_{t-1} | x_t) ------------------------------------------------------------------------------
    def _p_from_output(self, pred, var_values, x, t, clip_denoised=False, denoised_fn=None) -> Dict[str, torch.Tensor]:
        if var_values is not None:
            min_log = self._extract("posterior_log_variance_clipped", t, x)
            max_log = self._extract("log_betas", t, x)
            frac = (var_values + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
        else:
            fixed = "posterior_log_variance_clipped" if self.var_type == "fixed_small" else "log_fixed_large_variance"
            log_variance = self._extract(fixed, t, x).expand_as(x)

        x0 = pred if self.mean_type == "x0" else self._predict_xstart_from_eps(x, t, pred)
        if denoised_fn is not None:
            x0 = denoised_fn(x0)
        if clip_denoised:
            x0 = x0.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(x0, x, t)
        return {"mean": mean, "variance": torch.exp(log_variance), "log_variance": log_variance, "pred_xstart": x0}

    def p_mean_variance(self, model, x, t, clip_denoised: bool = False, denoised_fn: Optional[Callable] = None,
                        model_kwargs: Optional[dict] = None) -> Dict[str, torch.Tensor]:
        """Run the model and return p(x_{t-1} | x_t): ``mean``, ``variance``, ``log_variance``, ``pred_xstart``;
        ``clip_denoised`` clamps the x0 prediction to [-1, 1] (pixel-space data; leave it off for latents)."""
        pred, var_values = self._split_output(self._call_model(model, x, t, model_kwargs), x)
        return self._p_from_output(pred, var_values, x, t, clip_denoised, denoised_fn)

    # -- Training ------------------------------------------------------------------------------------------------------
    def sample_timesteps(self, batch_size: int, device=None, generator=None) -> torch.Tensor:
        return uniform_timesteps(batch_size, self.num_timesteps, device=device, generator=generator)

    def _vb_bits(self, x0, x_t, t, pred, var_values) -> torch.Tensor:
        """One term of the variational bound per sample, in bits per dimension: KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} |
        x_t)) for t > 0, the decoder NLL -log p(x0 | x_1) at t = 0."""
        p = self._p_from_output(pred, var_values, x_t, t)
        true_mean, _, true_log_variance = self.q_posterior_mean_variance(x0, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, p["mean"], p["log_variance"])) / math.log(2.0)
        nll = -mean_flat(discretized_gaussian_log_likelihood(x0, p["mean"], 0.5 * p["log_variance"])) / math.log(2.0)
        return torch.where(t.to(x0.device) == 0, nll, kl)

    def training_losses(self, model, x0: torch.Tensor, t: torch.Tensor, model_kwargs: Optional[dict] = None,
                        noise: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """Per-sample losses ([B] tensors) for one timestep per sample: ``loss``, ``mse`` with the MSE losses, ``vb``
        whenever the variance is learned (or the loss is a KL). In the hybrid loss the VB term sees a detached mean
        prediction, so it trains only the variance channels."""
        if noise is None:
            noise = torch.randn_like(x0)
        x_t = self.q_sample(x0, t, noise)
        pred, var_values = self._split_output(self._call_model(model, x_t, t, model_kwargs), x_t)

        if self.loss_type in ("kl", "rescaled_kl"):
            vb = self._vb_bits(x0, x_t, t, pred, var_values)
            scale = self.num_timesteps if self.loss_type == "rescaled_kl" else 1.0
            return {"loss": vb * scale, "vb": vb}

        target = noise if self.mean_type == "eps" else x0
        terms = {"mse": mean_flat((target.to(pred.dtype) - pred) ** 2)}
        terms["loss"] = terms["mse"]
        if var_values is not None:
            vb = self._vb_bits(x0, x_t, t, pred.detach(), var_values)
            if self.loss_type == "rescaled_mse":
                vb = vb * (self.num_timesteps / 1000.0)
            terms["vb"] = vb
            terms["loss"] = terms["mse"] + vb
        return terms

    # -- Sampling ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _randn_like(x, generator):
        return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)

    def p_sample(self, model, x, t, clip_denoised=False, denoised_fn=None, model_kwargs=None, generator=None):
        """One ancestral (DDPM) step x_t -> x_{t-1}; no noise is added at t = 0."""
        out = self.p_mean_variance(model, x, t, clip_denoised, denoised_fn, model_kwargs)
        nonzero = (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        sample = out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * self._randn_like(x, generator)
        return {"sample": sample.to(x.dtype), "pred_xstart": out["pred_xstart"]}

    def ddim_sample(self, model, x, t, clip_denoised=False, denoised_fn=None, model_kwargs=None, eta=0.0,
                    generator=None):
        """One DDIM step (Song et al. eq. 12); ``eta = 0`` is deterministic, ``eta = 1`` matches DDPM's variance."""
        out = self.p_mean_variance(model, x, t, clip_denoised, denoised_fn, model_kwargs)
        # Re-derive eps from the (possibly clipped) x0 so both stay consistent.
        eps = self._predict_eps_from_xstart(x, t, out["pred_xstart"])
        ab = self._extract("alphas_cumprod", t, x)
        ab_prev = self._extract("alphas_cumprod_prev", t, x)
        sigma = eta * torch.sqrt((1 - ab_prev) / (1 - ab)) * torch.sqrt(1 - ab / ab_prev)
        mean = out["pred_xstart"] * ab_prev.sqrt() + torch.sqrt(1 - ab_prev - sigma ** 2) * eps
        sample = mean
        if eta > 0:
            nonzero = (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
            sample = mean + nonzero * sigma * self._randn_like(x, generator)
        return {"sample": sample.to(x.dtype), "pred_xstart": out["pred_xstart"]}

    def sample_loop_progressive(self, model, shape, sampler: str = "ddpm", noise=None, clip_denoised=False,
                                denoised_fn=None, model_kwargs=None, device=None, progress=False, eta=0.0,
                                generator=None) -> Iterator[Dict[str, torch.Tensor]]:
        """Yield ``{"sample", "pred_xstart"}`` after every step, from t = T-1 down to 0."""
        _check_choice("sampler", sampler, SAMPLERS)
        if noise is not None:
            x = noise
        else:
            device = device if device is not None else _infer_device(model)
            x = torch.randn(tuple(shape), generator=generator, device=device)
        steps = range(self.num_timesteps - 1, -1, -1)
        if progress:
            from tqdm.auto import tqdm
            steps = tqdm(steps, desc=f"{sampler} sampling")
        for i in steps:
            t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
            with torch.no_grad():
                if sampler == "ddpm":
                    out = self.p_sample(model, x, t, clip_denoised, denoised_fn, model_kwargs, generator)
                else:
                    out = self.ddim_sample(model, x, t, clip_denoised, denoised_fn, model_kwargs, eta, generator)
            yield out
            x = out["sample"]

    def p_sample_loop(self, model, shape, noise=None, clip_denoised=False, denoised_fn=None, model_kwargs=None,
                      device=None, progress=False, generator=None) -> torch.Tensor:
        """Ancestral (DDPM) sampling through every step of this (possibly respaced) process."""
        return self.sample(model, shape, model_kwargs, "ddpm", noise=noise, clip_denoised=clip_denoised,
                           denoised_fn=denoised_fn, device=device, progress=progress, generator=generator)

    def ddim_sample_loop(self, model, shape, noise=None, clip_denoised=False, denoised_fn=None, model_kwargs=None,
                         device=None, progress=False, eta=0.0, generator=None) -> torch.Tensor:
        """DDIM sampling through every step of this (possibly respaced) process."""
        return self.sample(model, shape, model_kwargs, "ddim", noise=noise, clip_denoised=clip_denoised,
                           denoised_fn=denoised_fn, device=device, progress=progress, eta=eta, generator=generator)

    def sample(self, model_fn, shape, model_kwargs: Optional[dict] = None, sampler: str = "ddpm", noise=None,
               clip_denoised: bool = False, denoised_fn=None, eta: float = 0.0, progress: bool = False, device=None,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """The final x_0 of ``sampler`` ("ddpm" or "ddim"); ``noise`` fixes x_T, ``generator`` every random draw."""
        final = None
        for final in self.sample_loop_progressive(model_fn, shape, sampler, noise=noise, clip_denoised=clip_denoised,
                                                  denoised_fn=denoised_fn, model_kwargs=model_kwargs, device=device,
                                                  progress=progress, eta=eta, generator=generator):
            pass
        return final["sample"]


def _infer_device(model) -> torch.device:
    """Device of the first parameter of the model (or of what a wrapper / bound method wraps); else CPU."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "__self__", None)):
        parameters = getattr(candidate, "parameters", None)
        if callable(parameters):
            first = next(iter(parameters()), None)
            if first is not None:
                return first.device
    return torch.device("cpu")


# -- Factory (DiT's defaults) ------------------------------------------------------------------------------------------
def create_diffusion(timestep_respacing: Union[str, int, Sequence[int], None] = "", noise_schedule: str = "linear",
                     learn_sigma: bool = True, diffusion_steps: int = 1000, sigma_small: bool = False,
                     predict_xstart: bool = False, use_kl: bool = False,
                     rescale_learned_sigmas: bool = False) -> GaussianDiffusion:
    """A diffusion over ``diffusion_steps`` steps, respaced to ``timestep_respacing`` ("" keeps all: train with it;
    sample with e.g. ``"250"`` or ``"ddim50"``). Defaults are DiT's: linear betas, epsilon prediction, learned-range
    sigma, hybrid loss (MSE on eps + VB); ``learn_sigma=False`` gives a fixed variance (large, or small with
    ``sigma_small``) and a plain MSE."""
    betas = get_named_beta_schedule(noise_schedule, diffusion_steps)
    if timestep_respacing is None or timestep_respacing == "":
        timestep_respacing = [diffusion_steps]
    betas, timestep_map = respace_betas(betas, space_timesteps(diffusion_steps, timestep_respacing))
    loss_type = "rescaled_kl" if use_kl else "rescaled_mse" if rescale_learned_sigmas else "mse"
    var_type = "learned_range" if learn_sigma else ("fixed_small" if sigma_small else "fixed_large")
    return GaussianDiffusion(betas, mean_type="x0" if predict_xstart else "eps", var_type=var_type,
                             loss_type=loss_type, timestep_map=timestep_map)
