"""The attention registry.

An attention module is two things composed by inheritance:

* a *kernel*: how a head attends (scaled dot-product, TransNeXt's cosine attention, TransNeXt's
  aggregated local + pooled attention). A kernel owns the projections and produces per-head
  outputs; it is what a backbone asks for.
* a *variant*: what is done with the heads (``mha``: all heads, equal weight; ``moh``: shared plus
  routed top-k heads with learned gates; ``moa``: top-k query/output experts over one shared
  key/value head). A variant is a mixin that overrides the kernel's steps.

``build_attention(name, dim, num_heads, kernel=...)`` returns ``Variant + Kernel`` as one
``nn.Module``, so parameters sit directly on the module (``attn.qkv``, ``attn.wg``, ...) exactly
where the official checkpoints keep them.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from moh_vision.errors import ConfigError

_VARIANTS: Dict[str, type] = {}
_KERNELS: Dict[str, type] = {}
_COMPOSED: Dict[tuple, type] = {}  # (variant, kernel) -> class; immutable once made

# Options a backbone passes to every attention it builds; they are not user-facing options.
_BACKBONE_OPTIONS = ("kernel",)


def register_attention(name: str) -> Callable[[type], type]:
    """Register an attention variant (a mixin over a kernel) under ``name``."""

    def wrap(cls: type) -> type:
        if name in _VARIANTS and _VARIANTS[name] is not cls:
            raise ValueError(f"attention '{name}' is already registered by {_VARIANTS[name].__qualname__}")
        cls.attention_name = name
        _VARIANTS[name] = cls
        return cls

    return wrap


def register_kernel(name: str) -> Callable[[type], type]:
    """Register an attention kernel (a complete dense multi-head attention) under ``name``."""

    def wrap(cls: type) -> type:
        if name in _KERNELS and _KERNELS[name] is not cls:
            raise ValueError(f"kernel '{name}' is already registered by {_KERNELS[name].__qualname__}")
        cls.kernel_name = name
        _KERNELS[name] = cls
        return cls

    return wrap


def list_attention() -> List[str]:
    """Names of the registered attention variants, in registration order."""
    return list(_VARIANTS)


def list_kernels() -> List[str]:
    return list(_KERNELS)


def attention_class(name: str, kernel: str = "sdpa") -> type:
    """The composed ``nn.Module`` class for variant ``name`` over ``kernel``."""
    if name not in _VARIANTS:
        raise ConfigError(f"unknown attention '{name}'; known: {', '.join(list_attention())}")
    if kernel not in _KERNELS:
        raise ConfigError(f"unknown attention kernel '{kernel}'; known: {', '.join(list_kernels())}")
    variant, base = _VARIANTS[name], _KERNELS[kernel]
    key = (variant, base)
    if key not in _COMPOSED:
        _COMPOSED[key] = type(f"{variant.__name__}{base.__name__}", (variant, base), {"__module__": variant.__module__})
    return _COMPOSED[key]


def attention_options(name: str, kernel: str = "sdpa") -> List[str]:
    """Keyword options the composed class accepts (besides ``dim`` and ``num_heads``)."""
    names: List[str] = []
    for klass in attention_class(name, kernel).__mro__:
        if "__init__" not in vars(klass) or klass in (nn.Module, object):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "dim", "num_heads"):
                if p.name not in names:
                    names.append(p.name)
    return names


def build_attention(name: str, dim: int, num_heads: int, kernel: str = "sdpa", **options: Any) -> nn.Module:
    """Build attention ``name`` (``mha``, ``moh``, ``moa``, ...) of width ``dim`` with ``num_heads`` heads.

    ``kernel`` picks how a head attends (``sdpa`` for plain ViT/DiT blocks; backbones register their
    own). Unknown names and options raise :class:`ConfigError` with the allowed values.
    """
    cls = attention_class(name, kernel)
    allowed = attention_options(name, kernel)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"attention '{name}' (kernel '{kernel}') got unknown option(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(allowed)}"
        )
    return cls(dim, num_heads, **options)


def layer_options(options: Dict[str, Any], index: int, num_layers: int) -> Dict[str, Any]:
    """Pick layer ``index``'s value from every per-layer list in ``options``.

    A value that is a list/tuple is read as one entry per layer and must have ``num_layers``
    entries; scalars apply to every layer. This is how presets give per-layer ``shared_heads``
    and ``topk``.
    """
    picked = {}
    for key, value in options.items():
        if isinstance(value, Sequence) and not isinstance(value, str):
            if len(value) != num_layers:
                raise ConfigError(f"attention option {key} has {len(value)} entries but there are {num_layers} layers")
            value = value[index]
        picked[key] = value
    return picked


# ----------------------------------------------------------------------------------------------
# Gathering what routed layers left on themselves after a forward pass
# ----------------------------------------------------------------------------------------------
def routed_modules(model: nn.Module):
    """(name, module) for every attention module that routes heads (has ``aux_loss``)."""
    for name, module in model.named_modules():
        if getattr(module, "is_routed", False):
            yield name, module


def collect_aux_loss(model: nn.Module, coef: float = 0.01) -> torch.Tensor:
    """``coef * mean`` of the auxiliary losses the routed layers computed in the last training forward.

    This is the official MoH total (``0.01 * mean over layers``). Layers that route nothing (dense
    layers, ``topk == 0``) and layers in eval mode contribute nothing. Returns a zero scalar when no
    layer has a loss.
    """
    losses = [m.aux_loss for _, m in routed_modules(model) if m.aux_loss is not None]
    if not losses:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return coef * torch.stack([loss.float() for loss in losses]).mean()


def collect_routing_stats(model: nn.Module) -> Dict[str, Dict[str, Any]]:
    """Per routed layer: ``load`` (fraction of tokens that used each head/expert; sums to the
    active heads per token), ``entropy`` (mean router entropy in nats, None when nothing is routed),
    ``shared_heads``, ``topk`` and ``num_heads``. Read from the last forward pass."""
    stats = {}
    for name, module in routed_modules(model):
        if module.routing_stats is not None:
            stats[name] = dict(module.routing_stats)
    return stats


def reset_routing(model: nn.Module) -> None:
    """Forget aux losses and statistics of the last forward (e.g. before an eval pass)."""
    for _, module in routed_modules(model):
        module.aux_loss = None
        module.routing_stats = None


def find_attention(model: nn.Module) -> List[tuple]:
    """(name, module) for every registry-built attention module in ``model``."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "attention_name") and hasattr(m, "kernel_name")]


def describe(module: nn.Module) -> Optional[str]:
    name = getattr(module, "attention_name", None)
    return None if name is None else f"{name}[{module.kernel_name}]"
