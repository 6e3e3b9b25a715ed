"""Released weights: ``eval.py`` / ``tools/sample.py model=<preset> pretrained=<weights>``.

``pretrained`` names the weights: a local file in any format :func:`moh_vision.checkpoints.read_weights` reads (the
official releases included), a Hugging Face hub id (``owner/repo`` or ``hf-hub:owner/repo``, through the hub cache:
:mod:`moh_vision.models.hub`), or ``true`` for where the preset's registered cfg says its weights live. They load
strictly: a tensor that does not fit is a one-line error, never a re-initialised classifier.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Tuple

import torch
from torch import nn

from moh_vision.checkpoints import read_weights, state_dict_mismatch
from moh_vision.errors import ConfigError

HUB_ID = re.compile(r"^(hf-hub:)?[\w.-]+/[\w.-]+$")
PRESET_WEIGHTS = ("true", "default")


def released_weights_path(name: str, pretrained: str) -> Path:
    """The local file that ``pretrained`` names for model ``name`` (fetched into the hub cache for a hub id)."""
    from timm.models import get_pretrained_cfg

    from moh_vision.models.hub import WEIGHT_SUFFIXES, released_weights_file

    value = str(pretrained).strip()
    registered = get_pretrained_cfg(name)
    registered = registered.to_dict() if registered is not None else {}
    if value.lower() in PRESET_WEIGHTS:
        path = released_weights_file(name, registered)
        if path is None:
            raise ConfigError(f"pretrained={value}: {name} has no registered released weights; give pretrained=<file>")
        return path
    local = Path(value).expanduser()
    if local.is_file():
        return local
    if HUB_ID.match(value) and not value.endswith(WEIGHT_SUFFIXES):
        repo = value.removeprefix("hf-hub:")
        filename = registered.get("hf_hub_filename") if registered.get("hf_hub_id") == repo else None
        return released_weights_file(name, {"hf_hub_id": repo, "hf_hub_filename": filename})
    raise ConfigError(f"pretrained={value} does not exist; give a local weights file, a Hugging Face hub id "
                      f"(owner/repo) or true (the weights {name}'s cfg names)")


def read_released(name: str, pretrained: str) -> Tuple[Path, Dict[str, torch.Tensor]]:
    """(file, weights) that ``pretrained`` names for model ``name``."""
    path = released_weights_path(name, pretrained)
    return path, read_weights(path)


def load_strictly(model: nn.Module, state: Dict[str, torch.Tensor], what: str, hint: str = "") -> None:
    """Every tensor of ``state`` into ``model``, or a one-line error saying what does not fit."""
    problem = state_dict_mismatch(model.state_dict(), state)
    if problem:
        raise ConfigError(f"{what} does not fit the model as built: {problem}{hint}")
    model.load_state_dict(state, strict=True)
