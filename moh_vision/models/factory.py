"""How every model is built: a registered name plus the attention config group, through timm's builder.

:func:`build_from_preset` is what each ``@register_model`` entry point calls: the preset's arguments, overridden by the
user's, go through ``timm.models.build_model_with_cfg``, so ``features_only``, ``out_indices``, ``feature_cls``,
``pretrained_cfg`` / ``pretrained_cfg_overlay`` and ``pretrained=True`` work as for timm's own models;
``pretrained=True`` loads the released weights through :mod:`~moh_vision.models.hub`, in their official formats, ours,
and ``.safetensors``. :mod:`~moh_vision.models.families` says which registered names are ours and the family of each."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import torch
from timm.layers import register_notrace_module
from timm.models import build_model_with_cfg
from torch import nn

from moh_vision.attention import HeadAttention
from moh_vision.checkpoints import read_weights
from moh_vision.errors import ConfigError
from .hub import released_weights_file
from .families import check_model_name, list_models, model_class, model_family, register_family  # noqa: F401

Tensor = torch.Tensor

ROUTING_KEYS = ("shared_heads", "topk")
# What timm.create_model hands every entry point besides the model's own arguments.
TIMM_CFG_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")

# torch.fx: timm's tracer (its feature extraction, ``test_model_forward_fx``) keeps an attention layer as one
# leaf node, which runs eagerly inside the graph (its execution path chosen per call, as without fx). Any other
# fx tracer (torchvision's create_feature_extractor) traces through the layer: under fx a routed layer runs its
# reference formulas (moh_vision.ops.dispatch), whose code is traceable.
register_notrace_module(HeadAttention)


# ---- Entry points: preset + user arguments -> timm's builder ---------------------------------
def preset_arguments(preset: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """Constructor arguments of a registered model: its preset, overridden by the user's kwargs. A MoH preset's official
    routing (per-layer ``shared_heads``/``topk``) applies unless the user picks another attention or their own
    ``activation_ratio``/``shared_heads``/``topk``: then the user's routing replaces it rather than clashing with it."""
    args = dict(preset)
    user_routes = kwargs.get("attention", args.get("attention")) != args.get("attention") or any(
        k in kwargs for k in ("activation_ratio", *ROUTING_KEYS))
    if user_routes:
        for key in ROUTING_KEYS:
            args.pop(key, None)
    args.update(kwargs)
    return args


def build_from_preset(model_cls: Callable[..., nn.Module], name: str, pretrained: bool, preset: Mapping[str, Any],
                      kwargs: Dict[str, Any], feature_cfg: Optional[Dict[str, Any]] = None,
                      filter_fn: Optional[Callable] = None, **builder_kwargs: Any) -> nn.Module:
    """Build registered model ``name`` through ``timm.models.build_model_with_cfg``. ``kwargs``: what
    ``timm.create_model`` passed (model arguments, attention options, timm's feature and ``pretrained_cfg*`` options);
    ``feature_cfg``: the family's ``features_only`` default (``None``: not a feature backbone); ``filter_fn`` adapts a
    checkpoint to the model before ``pretrained=True`` loads it; ``builder_kwargs`` go to the builder as they are (e.g.
    ``in_chans`` for a model that calls it otherwise)."""
    kwargs = dict(kwargs)
    timm_args = {k: kwargs.pop(k) for k in TIMM_CFG_KWARGS if k in kwargs}
    if feature_cfg is None and any(k in kwargs for k in ("features_only", "out_indices", "feature_cls")):
        raise ConfigError(f"{name} is not a feature backbone: features_only/out_indices/feature_cls apply to the "
                          f"image classifiers (TransNeXt, plain ViT)")
    if not kwargs.get("features_only"):  # timm's entry points ignore these without features_only
        kwargs.pop("out_indices", None)
        kwargs.pop("feature_cls", None)
    overlay = _pretrained_weights(name, pretrained, timm_args.get("pretrained_cfg"),
                                  timm_args.get("pretrained_cfg_overlay"), timm_args.get("cache_dir"))
    args = preset_arguments(preset, kwargs)
    try:
        model = build_model_with_cfg(model_cls, name, pretrained, pretrained_cfg=timm_args.get("pretrained_cfg"),
                                     pretrained_cfg_overlay=overlay, feature_cfg=dict(feature_cfg or {}),
                                     pretrained_filter_fn=filter_fn, cache_dir=timm_args.get("cache_dir"),
                                     **builder_kwargs, **args)
    except RuntimeError as err:
        if "loading state_dict" not in str(err):
            raise
        problem = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(f"pretrained weights {overlay.get('file', '')} do not fit {name} with these arguments: "
                          f"{problem[:600]}") from None
    file = overlay.get("file")
    inner = model if hasattr(type(model), "family") else model.model  # features_only: timm's wrapper
    if inner is not model:
        model.pretrained_cfg = model.default_cfg = _source_cfg(model.pretrained_cfg, file)
    # the model's cfg describes this very model (its input size, classes, pool size)
    inner.pretrained_cfg = inner.default_cfg = instance_cfg(_source_cfg(inner.pretrained_cfg, file),
                                                            inner.instance_cfg())
    return model


def _source_cfg(cfg: Mapping[str, Any], file: Optional[str]) -> Dict[str, Any]:
    """A built model's cfg names the weights file it was loaded from, without holding its tensors twice."""
    cfg = {k: v for k, v in cfg.items() if k != "state_dict"}
    return {**cfg, "file": file} if file else cfg


def instance_cfg(cfg: Dict[str, Any], instance: Dict[str, Any]) -> Dict[str, Any]:
    """``cfg`` updated with what a built model really takes (input size, classes, pool size); per-channel
    statistics follow a changed channel count (their mean, repeated)."""
    cfg = {**cfg, **instance}
    channels = cfg["input_size"][0]
    for key in ("mean", "std"):
        values = tuple(cfg.get(key) or ())
        if values and len(values) != channels:
            cfg[key] = (round(sum(values) / len(values), 4),) * channels
    return cfg


def _pretrained_weights(name: str, pretrained: bool, pretrained_cfg: Any, overlay: Optional[Mapping[str, Any]],
                   cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """The ``pretrained_cfg_overlay`` to build with. With ``pretrained=True`` the released weights are found
    (:func:`~moh_vision.models.hub.released_weights_file`) and read here (released training checkpoints that timm's
    tensors-only loader refuses included), then handed to timm's builder as ``state_dict``."""
    overlay = dict(overlay or {})
    if not pretrained or overlay.get("state_dict"):
        return overlay
    cfg = {**_registered_cfg(name, pretrained_cfg), **overlay}
    if overlay.get("file"):  # a local file: the hub and URL are not asked
        cfg = {"file": overlay["file"]}
    path = released_weights_file(name, cfg, cache_dir)
    if path is None:
        raise ConfigError(f"{name}: no released weights to load with pretrained=True: pass a local file with "
                          f"pretrained_cfg_overlay=dict(file=<checkpoint>) (official or ours), or load one with "
                          f"checkpoint_path=<checkpoint> (this model's weights, adapted to its classes and size)")
    overlay.update(file=str(path), state_dict=read_weights(path))  # official formats too (moh_vision.checkpoints)
    return overlay


def _registered_cfg(name: str, pretrained_cfg: Any) -> Dict[str, Any]:
    """What timm resolves for this build (the name's default cfg, a tag's, or one passed in), as a dict."""
    from timm.models._builder import resolve_pretrained_cfg

    return resolve_pretrained_cfg(name, pretrained_cfg=pretrained_cfg).to_dict()
