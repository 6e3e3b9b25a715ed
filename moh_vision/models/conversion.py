"""Released or training checkpoints -> a plain tensor state dict (``tools/convert_checkpoint.py``).

The output holds tensors only, so our models load it strictly with ``weights_only=True`` (and ``timm.create_model(name,
checkpoint_path=...)``). Reading and finding the weights (released raw state dicts such as ``DiT-XL-2-256x256.pt``, DiT
/ MoH-DiT training checkpoints with EMA weights by default, timm's, ours, ``.safetensors``), stripping ``module.`` /
``_orig_mod.`` and writing atomically are :mod:`moh_vision.checkpoints`'. Training checkpoints' pickled
``argparse.Namespace`` loads safely; other pickled objects need ``trust_pickle``."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Dict, Optional

import timm
import torch

from moh_vision.checkpoints import atomic_save, find_weights, load_file, plain_tensors, state_dict_mismatch
from moh_vision.errors import ConfigError, RunError
from .families import check_model_name

log = logging.getLogger(__name__)

TRAINING_ARGS_SHOWN = ("model", "image_size", "num_classes", "vae")


def expected_state(model_name: str, model_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, torch.Tensor]:
    """The state dict of ``timm.create_model(model_name, **model_kwargs)``, built on the meta device (no memory)."""
    check_model_name(model_name)
    try:
        with torch.device("meta"):
            return timm.create_model(model_name, **(model_kwargs or {})).state_dict()
    except TypeError as err:
        raise ConfigError(f"model '{model_name}' rejected its arguments: {err}") from None


def mismatch_hint(problem: str) -> str:
    if "pos_embed:" not in problem:
        return ""
    return ("; pos_embed differs, so the checkpoint is for another resolution: pass model.input_size=<latent side> "
            "(DiT: image_size / 8) or model.img_size=<side> (ViT)")


def convert_checkpoint(src: str, dst: str, model: Optional[str] = None, model_kwargs: Optional[Dict[str, Any]] = None,
                       ema: bool = True, trust_pickle: bool = False, force: bool = False) -> Dict[str, torch.Tensor]:
    """Write the weights of ``src`` (EMA first unless ``ema=False``) to ``dst`` as plain tensors; with ``model``, first
    check every key and shape fits that registered model (else :class:`RunError`, nothing written, unless ``force``)."""
    if model_kwargs and not model:
        raise ConfigError(f"model.<key> arguments ({', '.join(model_kwargs)}) need model=<name>")
    if trust_pickle:
        log.warning("trust_pickle: loading %s with weights_only=False; this executes any code pickled in it. Only do "
                    "this for files from a source you trust.", src)
    checkpoint = load_file(src, trust_pickle=trust_pickle)
    state, where = find_weights(checkpoint, "auto" if ema else "model", source=str(src))
    state = plain_tensors(state)
    print(f"{src}: {len(state)} tensors, {sum(t.numel() for t in state.values()) / 1e6:.2f}M values, "
          f"from checkpoint{where}")
    train_args = checkpoint.get("args") if isinstance(checkpoint, Mapping) else None
    train_args = vars(train_args) if hasattr(train_args, "__dict__") else train_args
    if isinstance(train_args, Mapping):
        print("  training args: " + ", ".join(f"{k}={v}" for k, v in train_args.items() if k in TRAINING_ARGS_SHOWN))
    if model:
        problem = state_dict_mismatch(expected_state(model, model_kwargs), state)
        if problem and not force:
            raise RunError(f"{src} does not fit {model}: {problem}{mismatch_hint(problem)}; nothing written "
                           f"(force=true writes anyway)")
        print(f"  does not fit {model} (written anyway, force=true): {problem}" if problem else
              f"  matches {model}: every key and shape")
    atomic_save(state, dst)
    print(f"wrote {dst}")
    return state
