"""What the tasks call to get a model: a registered name, the attention config group and its weights
(``checkpoint_path``: this model's own; ``init_from``: a dense checkpoint to continue-tune from); one-line errors."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import timm
from torch import nn

from moh_vision.checkpoints import read_weights, state_dict_mismatch
from moh_vision.errors import ConfigError
from .continue_tuning import init_from_dense, router_keys
from .families import check_model_name
from .fitting import fit_to_model

log = logging.getLogger(__name__)

# Keys of the attention config group that configure training, not the attention modules.
NON_MODULE_KEYS = ("name", "aux_loss_weight")


def attention_kwargs(attention: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Turn the ``attention`` config group into model kwargs: ``attention=<name>`` plus its non-null options (timm drops
    nulls too). ``name: null`` (the ``preset`` group) passes nothing, so a preset keeps its own per-layer heads."""
    if not attention:
        return {}
    kwargs = {k: v for k, v in dict(attention).items() if k not in NON_MODULE_KEYS and v is not None}
    if attention.get("name") is None:
        if kwargs:
            raise ConfigError(f"attention=preset keeps the model's own attention; remove the options {sorted(kwargs)}")
        return {}
    return {"attention": attention["name"], **kwargs}


def build_model(name: str, attention: Optional[Mapping[str, Any]] = None, checkpoint_path: Optional[str] = None,
                init_from: Optional[str] = None, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, attention=..., **options, **kwargs)`` with one-line errors for bad input.
    ``checkpoint_path`` loads this model's weights (:func:`load_weights`: fine-tuning onto other classes or resolution);
    ``init_from`` starts a routed model from a dense checkpoint of the same backbone (:mod:`.continue_tuning`, with the
    same adaptations to the data)."""
    if checkpoint_path and init_from:
        raise ConfigError("give model.checkpoint_path (this model's own weights) or model.init_from (a dense "
                          "checkpoint to continue-tune from), not both")
    check_model_name(name)
    from_attention = attention_kwargs(attention)
    twice = sorted(set(kwargs) & set(from_attention))
    if twice:
        raise ConfigError(f"model.kwargs.{twice[0]} is set by the attention group (attention.{twice[0]}, "
                          f"attention=<name>); give it there, not in model.kwargs")
    kwargs = {**kwargs, **from_attention}
    try:
        model = timm.create_model(name, **kwargs)
    except TypeError as err:  # an option the model does not take
        raise ConfigError(f"model '{name}' rejected its arguments: {err}") from err
    if checkpoint_path:
        load_weights(model, checkpoint_path)
    elif init_from:
        init_from_dense(model, init_from)
    return model


def check_model_kwargs(given: Mapping[str, Any], task_sets: Sequence[str], task: str) -> None:
    """``model.kwargs`` names no constructor argument that the task sets itself (from the data), nor one
    that has its own option (``attention=``, ``model.checkpoint_path``, ``model.init_from``)."""
    own = sorted(set(given) & {"attention", "checkpoint_path", "init_from"})
    if own:
        where = "attention=<name>" if own[0] == "attention" else f"model.{own[0]}"
        raise ConfigError(f"model.kwargs.{own[0]} has its own option: give {where}, not +model.kwargs.{own[0]}")
    twice = sorted(set(given) & set(task_sets))
    if twice:
        raise ConfigError(f"model.kwargs.{twice[0]} is set by task={task} itself "
                          f"({', '.join(task_sets)}); remove +model.kwargs.{twice[0]}")


def with_model_kwargs(derived: Mapping[str, Any], given: Optional[Mapping[str, Any]], task: str) -> Dict[str, Any]:
    """The constructor arguments a task derives from the data, plus ``model.kwargs`` (none given twice)."""
    check_model_kwargs(given or {}, tuple(derived), task)
    return {**derived, **(given or {})}


def load_weights(model: nn.Module, path: str) -> List[str]:
    """Load this model's weights from any checkpoint format we read (EMA weights first), made to fit data of other
    classes, channels or resolution (:func:`~moh_vision.models.fitting.fit_to_model`), every other tensor strictly.
    Returns (and logs) the adaptations made."""
    if not Path(path).is_file():
        raise ConfigError(f"checkpoint_path={path} does not exist")
    state, notes = fit_to_model(model, read_weights(path))
    problem = state_dict_mismatch(model.state_dict(), state)
    if problem:
        missing = set(model.state_dict()) - set(state)
        hint = (" (the model's attention adds parameters the checkpoint lacks: to start a routed model from a "
                "dense checkpoint use model.init_from)" if missing and missing <= set(router_keys(model)) else "")
        raise ConfigError(f"checkpoint {path} does not fit this model: {problem}{hint}")
    model.load_state_dict(state, strict=True)
    for note in notes:
        log.info("checkpoint_path %s: %s", path, note)
    return notes
