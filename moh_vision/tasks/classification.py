"""Image classification: batch -> loss dict, and top-1/top-5 evaluation."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moh_vision.attention import record_routing
from moh_vision.errors import ConfigError
from moh_vision.models import build_model
from moh_vision.models.build import with_model_kwargs
from moh_vision.tasks.protocols import EpochContext, capability

Tensor = torch.Tensor


def split_batch(batch) -> Tuple[Tensor, Tensor, int]:
    """(images, labels, bad images skipped by the loader) from a 2- or 3-element batch."""
    if len(batch) == 3:
        x, y, skipped = batch
        return x, y, int(skipped)
    x, y = batch
    return x, y, 0


class ClassificationTask:
    """Cross-entropy (soft targets under mixup/cutmix, label smoothing otherwise) plus the routed layers' auxiliary loss
    times ``aux_loss_weight`` (default: the attention config's). A ``Task`` (``moh_vision.tasks.protocols``): ``model``,
    ``attention`` and ``kernels`` are those configs (kernels None: every op ``auto``)."""
    name = "classification"
    primary_metric, primary_mode = "val/acc1", "max"
    flops_kwargs = None  # the images are the model's only input
    model_arguments = ("num_classes", "in_chans", "img_size")  # set from the data, never by model.kwargs

    def __init__(self, model: Mapping[str, Any], attention: Mapping[str, Any],
                 aux_loss_weight: Optional[float] = None, kernels: Optional[Mapping[str, Any]] = None):
        self.model_cfg = dict(model)
        self.attention_cfg = dict(attention)
        self.kernels = dict(kernels) if kernels else None
        weight = self.attention_cfg["aux_loss_weight"] if aux_loss_weight is None else aux_loss_weight
        self.aux_loss_weight = float(weight)
        self.mixup, self.label_smoothing = None, 0.0

    # --- setup ----------------------------------------------------------------------------------
    def build_model(self, data) -> nn.Module:
        intended = capability(data, "task")
        if intended not in (None, self.name):
            raise ConfigError(f"{type(data).__name__} is data for task={intended}, not {self.name}: add task={intended} "
                              f"(for latents: experiment=latent_diffusion data.root=<dir>)")
        cfg = self.model_cfg
        self.mixup, self.label_smoothing = data.mixup, float(data.label_smoothing)
        derived = dict(zip(self.model_arguments, (data.num_classes, data.in_chans, data.img_size)))
        return build_model(cfg["name"], attention=self.attention_cfg, kernels=self.kernels,
                           checkpoint_path=cfg["checkpoint_path"], init_from=cfg["init_from"],
                           **with_model_kwargs(derived, cfg["kwargs"], self.name))

    @staticmethod
    def input_shape(data) -> Tuple[int, ...]:
        return (data.in_chans, data.img_size, data.img_size)

    # --- training ----------------------------------------------------------------------------
    def training_step(self, model: nn.Module, batch, device: torch.device) -> Dict[str, Tensor]:
        x, y, skipped = split_batch(batch)
        if x.shape[0] == 0:  # every image of this batch was unreadable and skipped by the loader
            return {"loss": None, "num_samples": 0, "skipped": skipped}
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        target = None
        if self.mixup is not None:
            x, target = self.mixup(x, y)
        with record_routing(model) as routing:  # the routed layers' aux loss and statistics of this forward
            logits = model(x)
        if target is not None:
            ce = torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            ce = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
        aux = routing.aux_loss(coef=self.aux_loss_weight)
        return {"loss": ce + aux, "ce": ce.detach(), "aux": aux.detach(), "num_samples": x.shape[0],
                "skipped": skipped, "routing": routing.stats()}

    # --- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, device: torch.device, amp=None) -> Dict[str, float]:
        """Sums over this rank's share of the val set: loss, top-1 and top-5 hits, count, skipped. The sums stay on the
        device until the last batch (one read for the whole set, not three a batch)."""
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, top-1 hits, top-5 hits
        count, skipped_total = 0, 0
        for batch in loader:
            x, y, skipped = split_batch(batch)
            skipped_total += skipped
            if x.shape[0] == 0:
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with amp():
                logits = model(x).float()
            k = min(5, logits.shape[-1])
            hit = logits.topk(k, dim=-1).indices == y[:, None]
            totals += torch.stack([F.cross_entropy(logits, y, reduction="sum"), hit[:, 0].sum(),
                                   hit.any(dim=-1).sum()]).double()
            count += y.shape[0]
        loss, acc1, acc5 = totals.tolist()
        return {"loss": loss, "acc1": acc1, "acc5": acc5, "count": float(count), "skipped": float(skipped_total)}

    @staticmethod
    def finalize(sums: Dict[str, float], prefix: str = "val") -> Dict[str, float]:
        n = max(sums["count"], 1.0)
        out = {f"{prefix}/loss": sums["loss"] / n, f"{prefix}/acc1": 100.0 * sums["acc1"] / n,
               f"{prefix}/acc5": 100.0 * sums["acc5"] / n, f"{prefix}/count": sums["count"]}
        if sums.get("skipped"):
            out[f"{prefix}/skipped_images"] = sums["skipped"]
        return out

    def on_epoch_end(self, ctx: EpochContext) -> Dict[str, float]:
        """Nothing to do after validation: the trainer's metrics are all there is."""
        return {}

