"""Which timm names are ours, and the family of each: read from the classes' ``family`` tags.

Every model class carries ``family`` (``"transnext"``, ``"dit"``, ``"vit"``) and its module records the
names it registers with timm (:func:`register_family`); nothing reads a family from a name. This module
imports nothing else of :mod:`moh_vision.models`, so any module there may ask it.
"""
from __future__ import annotations

import difflib
from typing import Dict, Iterable, List, Union

import timm
from torch import nn

from moh_vision.errors import ConfigError

_MODEL_CLASSES: Dict[str, type] = {}


def register_family(model_cls: type, names: Iterable[str]) -> None:
    """Record that timm names ``names`` build ``model_cls`` (whose ``family`` tag they share)."""
    if not isinstance(getattr(model_cls, "family", None), str):
        raise TypeError(f"{model_cls.__name__} needs a class attribute family = '<name>'")
    for name in names:
        _MODEL_CLASSES[name] = model_cls


def list_models() -> List[str]:
    """Every model name this package registers with timm, sorted."""
    return sorted(_MODEL_CLASSES)


def check_model_name(name: str) -> None:
    """A :class:`ConfigError` naming the closest of our models when timm does not know ``name``."""
    if name not in timm.list_models():
        ours = list_models()
        close = difflib.get_close_matches(name, ours, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"moh-vision models: {', '.join(ours)}"
        raise ConfigError(f"unknown model '{name}'; {hint}")


def model_class(name: str) -> type:
    """The class a registered name builds."""
    if name not in _MODEL_CLASSES:
        check_model_name(name)
        raise ConfigError(f"'{name}' is a timm model, not one of moh-vision's ({', '.join(list_models())})")
    return _MODEL_CLASSES[name]


def model_family(model_or_name: Union[str, nn.Module]) -> str:
    """``"transnext"``, ``"dit"`` or ``"vit"``: the family tag of a registered name or of a built model
    (DDP / ``torch.compile`` wrappers and timm's ``features_only`` wrappers are looked through)."""
    if isinstance(model_or_name, str):
        return model_class(model_or_name).family
    model = getattr(model_or_name, "module", model_or_name)  # DistributedDataParallel
    model = getattr(model, "_orig_mod", model)  # torch.compile
    if not hasattr(type(model), "family"):
        model = getattr(model, "model", model)  # timm's feature wrappers keep the model as .model
    family = getattr(type(model), "family", None)
    if family is None:
        raise ConfigError(f"{type(model).__name__} is not a moh-vision model (no family tag)")
    return family
