"""Making a checkpoint fit a model built for other data (other classes, channels or resolution): what
``model.checkpoint_path`` and ``model.init_from`` share. Three adaptations, each reported in one line, as
``timm.models.load_pretrained`` does for ``pretrained=True``:

* the family's own (``model.adapt_checkpoint``): a plain ViT resamples its position embedding to the model's grid and
  its patch embedding to the model's patch size; DiT keeps its own fixed sin-cos position embedding;
* the first convolution (the cfg's ``first_conv``) takes the model's input channels (timm's ``adapt_input_conv``: RGB
  -> grey sums the channels);
* the classifier (the cfg's ``classifier``: a head, or DiT's class-embedding table) keeps the model's fresh
  initialisation when the checkpoint has another number of classes.

Anything else that differs (width, depth, heads) is left for the caller to refuse."""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
from timm.models import adapt_input_conv
from torch import nn

Tensor = torch.Tensor


def _names(value) -> Tuple[str, ...]:
    if not value:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def fit_to_model(model: nn.Module, state: Mapping[str, Tensor]) -> Tuple[Dict[str, Tensor], List[str]]:
    """``state`` adapted to ``model`` (see the module) and one note per adaptation made."""
    notes: List[str] = []
    adapt = getattr(model, "adapt_checkpoint", None)
    out = dict(adapt(dict(state)) if adapt is not None else state)
    for key in sorted(set(state) & set(out)):
        if tuple(state[key].shape) != tuple(out[key].shape):
            notes.append(f"{key} resampled {tuple(state[key].shape)} -> {tuple(out[key].shape)}")
    own = model.state_dict()
    cfg = getattr(model, "pretrained_cfg", None) or {}
    for conv in _names(cfg.get("first_conv")):
        key = f"{conv}.weight"
        if key in out and key in own and out[key].ndim == 4 and out[key].shape[1] != own[key].shape[1] \
                and out[key].shape[0] == own[key].shape[0] and out[key].shape[2:] == own[key].shape[2:]:
            before = out[key].shape[1]
            out[key] = adapt_input_conv(own[key].shape[1], out[key])
            notes.append(f"{conv} adapted from {before} to {own[key].shape[1]} input channels")
    for head in _names(cfg.get("classifier")):
        dropped = [k for k in (f"{head}.weight", f"{head}.bias") if k in out and k not in own]
        if dropped:  # built without a classifier (num_classes=0): timm drops the checkpoint's
            for k in dropped:
                del out[k]
            notes.append(f"{head} dropped: the model is built without one (num_classes=0)")
        keys = [k for k in (f"{head}.weight", f"{head}.bias") if k in out and k in own]
        if keys and any(out[k].shape != own[k].shape for k in keys):
            before, after = out[keys[0]].shape[0], own[keys[0]].shape[0]
            for k in keys:
                out[k] = own[k].detach().clone()
            notes.append(f"{head} re-initialised: the checkpoint has {before} outputs (classes), the model {after}")
    return out, notes
