"""Build any registered model from a name plus the attention config group."""
from __future__ import annotations

import difflib
from typing import Any, Dict, Mapping, Optional

import timm
from torch import nn

from moh_vision.errors import ConfigError

# Keys of the attention config group that configure training, not the attention modules.
NON_MODULE_KEYS = ("name", "aux_loss_weight")

# Arguments timm.create_model passes to every entry point; our constructors don't take them.
TIMM_ONLY_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")
ROUTING_KEYS = ("shared_heads", "topk")


def preset_arguments(name: str, pretrained: bool, preset: Mapping[str, Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Constructor arguments of registered model ``name``: its preset, overridden by the user's kwargs.

    A MoH preset's official routing (per-layer ``shared_heads``/``topk``) applies unless the user
    picks another attention or their own ``activation_ratio``/``shared_heads``/``topk``: then the
    user's routing replaces it rather than clashing with it. ``pretrained=True`` is refused
    (nothing is ever downloaded) and timm's bookkeeping kwargs are dropped.
    """
    if pretrained:
        raise ConfigError(f"{name}: pretrained=True is not supported (nothing is downloaded); pass checkpoint_path= "
                          f"to load local weights (tools/convert_checkpoint.py converts released checkpoints)")
    kwargs = {k: v for k, v in kwargs.items() if k not in TIMM_ONLY_KWARGS}
    args = dict(preset)
    user_routes = kwargs.get("attention", args.get("attention")) != args.get("attention") or any(
        k in kwargs for k in ("activation_ratio", *ROUTING_KEYS))
    if user_routes:
        for key in ROUTING_KEYS:
            args.pop(key, None)
    args.update(kwargs)
    return args


def attention_kwargs(attention: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Turn the ``attention`` config group into model kwargs: ``attention=<name>`` plus its options.

    ``name: null`` (the ``preset`` group) passes nothing, so a preset keeps its own per-layer heads.
    ``null`` options are dropped (timm drops them too).
    """
    if not attention:
        return {}
    kwargs = {k: v for k, v in dict(attention).items() if k not in NON_MODULE_KEYS and v is not None}
    if attention.get("name") is None:
        if kwargs:
            raise ConfigError(f"attention=preset keeps the model's own attention; remove the options {sorted(kwargs)}")
        return {}
    return {"attention": attention["name"], **kwargs}


def check_model_name(name: str) -> None:
    known = timm.list_models()
    if name not in known:
        ours = [m for m in known if "transnext" in m or "dit" in m or m.startswith("plain_vit")]
        close = difflib.get_close_matches(name, ours, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"moh-vision models: {', '.join(sorted(ours))}"
        raise ConfigError(f"unknown model '{name}'; {hint}")


def build_model(name: str, attention: Optional[Mapping[str, Any]] = None, checkpoint_path: Optional[str] = None,
                init_from: Optional[str] = None, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, attention=..., **options, **kwargs)`` with one-line errors for bad input.

    ``checkpoint_path`` loads this very model's weights strictly; ``init_from`` starts a MoH model from a
    dense checkpoint of the same backbone (continue-tuning, :mod:`moh_vision.models.continue_tuning`).
    """
    import moh_vision.models  # noqa: F401  (registers our models with timm)

    if checkpoint_path and init_from:
        raise ConfigError("give model.checkpoint_path (this model's own weights) or model.init_from (a dense "
                          "checkpoint to continue-tune from), not both")
    check_model_name(name)
    kwargs = {**kwargs, **attention_kwargs(attention)}
    try:
        model = timm.create_model(name, **kwargs)
    except TypeError as err:  # an option the model does not take
        raise ConfigError(f"model '{name}' rejected its arguments: {err}") from err
    if checkpoint_path:
        load_weights(model, checkpoint_path)
    elif init_from:
        from .continue_tuning import init_from_dense
        init_from_dense(model, init_from)
    return model


def load_weights(model: nn.Module, path: str) -> None:
    """Strictly load model weights (a plain state dict or a checkpoint with ``model``/``model_ema``)."""
    from pathlib import Path

    from timm.models import load_state_dict

    if not Path(path).is_file():
        raise ConfigError(f"checkpoint_path={path} does not exist")
    state = load_state_dict(path, use_ema=True, weights_only=True)
    problem = state_dict_mismatch(model.state_dict(), state)
    if problem:
        raise ConfigError(f"checkpoint {path} does not fit this model: {problem}")
    model.load_state_dict(state, strict=True)


def state_dict_mismatch(expected: Mapping[str, Any], given: Mapping[str, Any]) -> str:
    """One line describing missing / unexpected / reshaped keys ('' when the two fit)."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    reshaped = [k for k in given if k in expected and tuple(expected[k].shape) != tuple(given[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} keys with other shapes (e.g. {k}: {tuple(given[k].shape)} vs "
                     f"{tuple(expected[k].shape)})")
    return "; ".join(parts)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and/or ``torch.compile`` wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)
