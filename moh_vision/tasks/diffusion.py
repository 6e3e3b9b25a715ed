"""Class-conditional diffusion (DiT / MoH-DiT): batch -> loss dict, validation loss, sample grids and metrics."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from moh_vision.attention import record_routing
from moh_vision.config import SampleConfig, VaeConfig
from moh_vision.diffusion import create_diffusion, guided_model_fn
from moh_vision.diffusion.samplers import check_sampler, sample_with
from moh_vision.errors import ConfigError
from moh_vision.models import build_model, model_family
from moh_vision.models.build import with_model_kwargs
from moh_vision.tasks.protocols import EpochContext, capability
from .classification import split_batch

log = logging.getLogger(__name__)

Tensor = torch.Tensor

# The sampling and VAE options and their defaults: the schema's (moh_vision/config.py), for the Python API too.
DEFAULT_SAMPLE = dataclasses.asdict(SampleConfig())
DEFAULT_VAE = dataclasses.asdict(VaeConfig())


class DiffusionTask:
    """DiT's training objective (epsilon MSE + variational bound with learned sigma, uniform t) plus the routed layers'
    aux loss; validation reports the same loss at fixed t and noise.

    A ``Task`` (``moh_vision.tasks.protocols``): ``model`` is the model config (``name``, ``checkpoint_path``,
    ``init_from``, ``kwargs``), ``attention`` the attention config. ``sample`` controls the grids (rows = classes)
    written every ``every_epochs`` epochs and at the end, and the sample metrics (``sample/class_acc``,
    ``sample/fd_digits``) on ``eval_per_class`` samples per class when the data declare ``digit_metrics``. ``sampler``
    (``ddpm``, ``ddim``, ``dpm++``) and ``steps`` choose how (``moh_vision.diffusion.samplers``); ``fid_every_steps`` /
    ``fid_at_checkpoints`` add ADM's FID during training (``step_hook``, ``moh_vision.tasks.diffusion_fid``)."""
    name = "diffusion"
    primary_metric, primary_mode = "val/loss", "min"
    # set from the data and the task's options, never by model.kwargs
    model_arguments = ("input_size", "in_channels", "num_classes", "learn_sigma", "class_dropout_prob")

    def __init__(self, model: Mapping[str, Any], attention: Mapping[str, Any], aux_loss_weight: Optional[float] = None,
                 diffusion_steps: int = 1000, noise_schedule: str = "linear", learn_sigma: bool = True,
                 class_dropout_prob: float = 0.1, sample: Optional[Mapping[str, Any]] = None,
                 vae: Optional[Mapping[str, Any]] = None, kernels: Optional[Mapping[str, Any]] = None):
        self.model_cfg, self.attention_cfg = dict(model), dict(attention)
        self.kernels = dict(kernels) if kernels else None
        weight = self.attention_cfg["aux_loss_weight"] if aux_loss_weight is None else aux_loss_weight
        self.aux_loss_weight = float(weight)
        self.learn_sigma, self.class_dropout_prob = bool(learn_sigma), float(class_dropout_prob)
        self.diffusion_args = dict(noise_schedule=noise_schedule, learn_sigma=learn_sigma,
                                   diffusion_steps=diffusion_steps)
        self.diffusion = create_diffusion("", **self.diffusion_args)
        unknown = set(sample or {}) - set(DEFAULT_SAMPLE)
        if unknown:
            raise ConfigError(f"task.sample got unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULT_SAMPLE)}")
        self.sample_cfg = {**DEFAULT_SAMPLE, **dict(sample or {})}
        check_sampler(self.sample_cfg["sampler"], self.sample_cfg["steps"], int(diffusion_steps))
        self.vae_cfg = {**DEFAULT_VAE, **dict(vae or {})}
        self._classifier = None

    # --- setup ----------------------------------------------------------------------------------
    def build_model(self, data) -> nn.Module:
        name = self.model_cfg["name"]
        if model_family(name) != "dit":
            raise ConfigError(f"task=diffusion needs a DiT model (dit_*, moh_dit_*); got model={name}")
        self.data = data
        self.null_class = data.num_classes
        self._resolve_vae(data)
        derived = dict(zip(self.model_arguments, (data.img_size, data.in_chans, data.num_classes, self.learn_sigma,
                                                  self.class_dropout_prob)))
        return build_model(name, attention=self.attention_cfg, kernels=self.kernels,
                           checkpoint_path=self.model_cfg["checkpoint_path"], init_from=self.model_cfg["init_from"],
                           **with_model_kwargs(derived, self.model_cfg["kwargs"], self.name))

    def _resolve_vae(self, data) -> None:
        """Latent data need their VAE to decode samples: ``task.vae.path``, else the one the latents were extracted with
        (recorded in their index) when it exists on this machine."""
        scale_factor = capability(data, "scale_factor")
        if scale_factor is None:  # pixel data
            return
        if not self.vae_cfg["path"]:
            recorded = capability(data, "vae_path")
            if not recorded or not Path(recorded).is_dir():
                raise ConfigError(f"latent data need task.vae.path=<local AutoencoderKL dir> to decode samples "
                                  f"(the latents were extracted with {recorded or 'an unrecorded VAE'})")
            self.vae_cfg["path"] = recorded
        self.vae_cfg["scale_factor"] = float(scale_factor)

    @staticmethod
    def input_shape(data) -> Tuple[int, ...]:
        return (data.in_chans, data.img_size, data.img_size)

    @property
    def flops_kwargs(self) -> Dict[str, Tensor]:
        """Extra forward inputs for FLOP counting: one timestep and one class label."""
        return {"t": torch.zeros(1, dtype=torch.long), "y": torch.zeros(1, dtype=torch.long)}

    # --- training ----------------------------------------------------------------------------
    def training_step(self, model: nn.Module, batch, device: torch.device) -> Dict[str, Any]:
        x, y, skipped = split_batch(batch)
        if x.shape[0] == 0:
            return {"loss": None, "num_samples": 0, "skipped": skipped}
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), device=device)
        with record_routing(model) as routing:
            terms = self.diffusion.training_losses(model, x, t, model_kwargs={"y": y})
        aux = routing.aux_loss(coef=self.aux_loss_weight)
        out = {"loss": terms["loss"].mean() + aux, "aux": aux.detach(), "num_samples": x.shape[0], "skipped": skipped,
               "routing": routing.stats(), "log/mse": terms["mse"].mean().detach() if "mse" in terms else None}
        if "vb" in terms:
            out["log/vb"] = terms["vb"].mean().detach()
        return {k: v for k, v in out.items() if v is not None}

    # --- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, device: torch.device, amp=None) -> Dict[str, float]:
        """Diffusion loss on the validation images at timesteps and noise fixed by a seed (comparable across runs)."""
        model.eval()
        g = torch.Generator(device="cpu").manual_seed(1234)
        keys = ("loss", "mse", "vb")
        totals = torch.zeros(len(keys), dtype=torch.float64, device=device)  # read once, after the last batch
        count, skipped_total = 0, 0
        for batch in loader:
            x, y, skipped = split_batch(batch)
            skipped_total += skipped
            if x.shape[0] == 0:
                continue
            t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), generator=g).to(device)
            noise = torch.randn(x.shape, generator=g).to(device)
            with amp():
                terms = self.diffusion.training_losses(model, x.to(device), t, model_kwargs={"y": y.to(device)},
                                                       noise=noise)
            totals += torch.stack([terms[key].float().sum().double() if key in terms else totals.new_zeros(())
                                   for key in keys])
            count += x.shape[0]
        return {**dict(zip(keys, totals.tolist())), "count": float(count), "skipped": float(skipped_total)}

    @staticmethod
    def finalize(sums: Dict[str, float], prefix: str = "val") -> Dict[str, float]:
        n = max(sums["count"], 1.0)
        out = {f"{prefix}/{k}": sums[k] / n for k in ("loss", "mse", "vb") if sums.get(k)}
        out[f"{prefix}/count"] = sums["count"]
        if sums.get("skipped"):
            out[f"{prefix}/skipped_images"] = sums["skipped"]
        return out

    # --- sampling ----------------------------------------------------------------------------
    def sample(self, model: nn.Module, labels: Tensor, device: torch.device, seed: int = 0,
               progress: bool = False, generator: Optional[torch.Generator] = None) -> Tensor:
        """Class-conditional samples for ``labels`` (in data space, before any VAE decoding); every random draw comes
        from ``generator`` (on ``device``), else from one seeded with ``seed``."""
        cfg = self.sample_cfg
        fn = guided_model_fn(model, float(cfg["cfg_scale"]), self.null_class, cfg["guidance_channels"])
        clip = cfg["clip_denoised"]
        if clip is None:  # clip to [-1, 1] in pixel space, never for latents
            clip = not self.vae_cfg["path"]
        c, s = self.data.in_chans, self.data.img_size
        outs = []
        g = generator if generator is not None else torch.Generator(device=device).manual_seed(seed)
        for chunk in labels.split(int(cfg["batch_size"])):
            chunk = chunk.to(device)
            noise = torch.randn((len(chunk), c, s, s), generator=g, device=device)
            outs.append(sample_with(cfg["sampler"], cfg["steps"], self.diffusion_args, fn, noise,
                                    model_kwargs={"y": chunk}, clip_denoised=bool(clip), progress=progress,
                                    generator=g))
        return torch.cat(outs)

    def on_epoch_end(self, ctx: EpochContext) -> Dict[str, float]:
        """Write a labelled grid every ``sample.every_epochs`` epochs and at the end; metrics at the end."""
        cfg = self.sample_cfg
        every = int(cfg["every_epochs"] or 0)
        if not ctx.is_main or not (ctx.last_epoch or every and (ctx.epoch + 1) % every == 0):
            return {}
        model, device = ctx.model_for_eval.eval(), ctx.device
        per_class, classes = int(cfg["per_class"]), min(int(cfg["grid_classes"]), self.data.num_classes)
        if per_class > 0 and classes > 0:
            from moh_vision.analysis.grids import save_class_grid
            labels = torch.arange(classes).repeat_interleave(per_class)
            images = self.decode(self.sample(model, labels, device, seed=int(cfg["seed"])))
            path = ctx.out_dir / "samples" / f"epoch_{ctx.epoch:04d}.png"
            save_class_grid(images, labels, path, per_row=per_class)
            ctx.log_image("samples/grid", path, caption=f"epoch {ctx.epoch}")
        metrics: Dict[str, float] = {}
        if ctx.last_epoch and int(cfg["eval_per_class"]) > 0 and self.is_digits:
            metrics = self.digits_metrics(model, device, ctx.out_dir)
            log.info("sample metrics: %s", ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return metrics

    def step_hook(self):
        """FID during training (``task.sample.fid_every_steps``, ``fid_at_checkpoints``; :mod:`.diffusion_fid`): its
        inputs checked now, before the first step; None when it is off."""
        cfg = self.sample_cfg
        if not (int(cfg["fid_every_steps"] or 0) or cfg["fid_at_checkpoints"]):
            return None
        from .diffusion_fid import TrainingFid
        return TrainingFid(self)

    @property
    def is_digits(self) -> bool:
        """The data declare ``digit_metrics``: samples can be scored by the digits classifier."""
        return bool(capability(self.data, "digit_metrics"))

    def digits_metrics(self, model: nn.Module, device: torch.device, out_dir: Path) -> Dict[str, float]:
        """Class accuracy and classifier-feature Frechet distance of ``eval_per_class`` samples per class."""
        from moh_vision.analysis.metrics import digits_sample_metrics, load_or_train_classifier, real_digits
        classifier = load_or_train_classifier(Path(out_dir) / "digits_classifier.pt", self.data.img_size)
        labels = torch.arange(self.data.num_classes).repeat_interleave(int(self.sample_cfg["eval_per_class"]))
        samples = self.sample(model, labels, device, seed=int(self.sample_cfg["seed"]) + 1)
        reference, _ = real_digits(self.data.val)
        return digits_sample_metrics(classifier, samples, labels, reference)

    def decode(self, x: Tensor) -> Tensor:
        """Data space -> images in [-1, 1]: pixels as they are, latents VAE-decoded ``decode_batch_size`` at a time."""
        if not self.vae_cfg["path"]:
            return x
        from moh_vision.data.latents import load_vae
        vae = load_vae(self.vae_cfg["path"], device=x.device)
        scale = float(self.vae_cfg["scale_factor"])
        with torch.no_grad():
            return torch.cat([vae.decode(chunk / scale).sample.clamp(-1, 1)
                              for chunk in x.split(int(self.sample_cfg["decode_batch_size"]))])
