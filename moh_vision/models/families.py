"""Which timm names are ours, and the family of each: read from the classes' ``family`` tags.

Every model class carries ``family`` (``"transnext"``, ``"dit"``, ``"vit"``) and its module records the names it
registers with timm (:func:`register_family`); nothing reads a family from a name. This module imports nothing else of
:mod:`moh_vision.models`, so any module there may ask it."""
from __future__ import annotations

import difflib
import re
from typing import Dict, Iterable, List, Mapping, Union

import timm
from timm.utils.model import unwrap_model  # the plain model inside DDP / torch.compile / ModelEma
from torch import nn

from moh_vision.errors import ConfigError

_MODEL_CLASSES: Dict[str, type] = {}
_TIMM_EQUIVALENTS: Dict[str, str] = {}  # a timm model (224px) -> our preset its checkpoints load into


def register_family(model_cls: type, names: Iterable[str]) -> None:
    """Record that timm names ``names`` build ``model_cls`` (whose ``family`` tag they share)."""
    if not isinstance(getattr(model_cls, "family", None), str):
        raise TypeError(f"{model_cls.__name__} needs a class attribute family = '<name>'")
    for name in names:
        _MODEL_CLASSES[name] = model_cls


def list_models() -> List[str]:
    """Every model name this package registers with timm, sorted."""
    return sorted(_MODEL_CLASSES)


def register_timm_equivalents(equivalents: Mapping[str, str]) -> None:
    """Record that the checkpoints of timm models (keys, their 224px names) load into our presets (values)."""
    _TIMM_EQUIVALENTS.update(equivalents)


def suggest_model(name: str) -> str:
    """A hint for a model name that is not one of ours ('' when there is none): the preset a timm model's
    checkpoints load into (any tag or resolution of it), else the closest of our names."""
    arch = name.split(".", 1)[0]
    sized = re.fullmatch(r"(.+_patch\d+)_(\d+)", arch)
    preset = _TIMM_EQUIVALENTS.get(f"{sized.group(1)}_224" if sized else arch)
    if preset:
        size = f" with img_size={sized.group(2)}" if sized and sized.group(2) != "224" else ""
        return (f"{name} is a timm model; its checkpoints load into model={preset}{size} "
                f"(model.init_from=<its file>: dense -> MoH; model.checkpoint_path=<its file>: fine-tune)")
    close = difflib.get_close_matches(arch, list_models(), n=5, cutoff=0.6)
    return f"did you mean {', '.join(close)}?" if close else ""


def check_model_name(name: str) -> None:
    """A :class:`ConfigError` naming the closest of our models when timm does not know ``name``."""
    if name not in timm.list_models():
        hint = suggest_model(name) or f"moh-vision models: {', '.join(list_models())}"
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
    model = unwrap_model(model_or_name)
    if not hasattr(type(model), "family"):
        model = getattr(model, "model", model)  # timm's feature wrappers keep the model as .model
    family = getattr(type(model), "family", None)
    if family is None:
        raise ConfigError(f"{type(model).__name__} is not a moh-vision model (no family tag)")
    return family
