"""The attention registry and the contract every attention variant keeps.

An attention module is two things composed by inheritance:

* a *form*: how a head attends (scaled dot-product, TransNeXt's cosine attention, TransNeXt's aggregated local +
  pooled attention). A form owns the projections and produces per-head outputs; it is what a backbone asks for.
* a *variant*: what is done with the heads (``mha``: all heads, equal weight; ``moh``: shared plus routed top-k heads
  with learned gates; ``moa``: top-k query/output experts over one shared key/value head). A variant is a mixin (an
  :class:`AttentionVariant`) that overrides the form's steps.

``build_attention(name, dim, num_heads, form=...)`` returns ``Variant + Form`` as one ``nn.Module``, so parameters
sit directly on the module (``attn.qkv``, ``attn.wg``, ...) exactly where the official checkpoints keep them. A composed
class is importable by name from its form's module (``moh_vision.attention.forms.moh__sdpa``,
``moh_vision.models.transnext.moh__transnext_full``), so pickling a model finds it: registering a form gives its
module a ``__getattr__`` that composes such names on demand.

Discovery: every module of this package is imported on ``import moh_vision.attention``, and so is every entry point of
the group ``moh_vision.attention`` (how a separate pip package adds a variant:
``[project.entry-points."moh_vision.attention"] my_attention = "my_pkg.my_attention"``)."""
from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from moh_vision.errors import ConfigError

_VARIANTS: Dict[str, type] = {}
_FORMS: Dict[str, type] = {}
_COMPOSED: Dict[tuple, type] = {}  # (variant, form) -> class; immutable once made

# Before issue 60 a form was called a "kernel" (``build_attention(..., kernel=...)``, a ViT's ``kernel`` option); the
# old key is still taken, with a deprecation warning: "kernel" now names an op's implementation only (kernels.<key>).
OLD_FORM_KEY = "kernel"
COMPOSED_SEPARATOR = "__"  # a composed class is named <variant>__<form> in its form's module


# ---- The variant contract --------------------------------------------------------------------
class AttentionVariant:
    """Base of every registered variant: what the rest of the codebase asks a variant, with the answers of a dense
    attention as defaults. A variant's file is the only place that knows it. Class attributes a variant may set:

    * ``option_ranges``: ``{option: allowed values}`` in words, for error messages and docs; the options themselves
      (types, defaults) are the keyword arguments of the variant's ``__init__``, mirrored by
      ``configs/attention/<name>.yaml`` (a test checks it).
    * ``aux_reduction``: how per-layer auxiliary losses combine: ``"mean"`` (MoH's official total) or ``"sum"`` (MoA's).
    * ``variant_parameters``: names of the submodules/parameters the variant adds over a dense attention of the same
      form (routers, experts). A checkpoint holding one of them is not dense.
    * ``flops_roles``: ``{child: role}`` for its own children: ``"per_head"`` (its cost scales with the heads a token
      activates), ``"query_rows"`` (only the query rows scale), ``"fixed"``.
    * ``dense_start_refusal``: why the variant cannot start from a dense attention's weights (``None``: it can,
      :meth:`dense_start`)."""

    attention_name = "?"
    option_ranges: Dict[str, str] = {}
    aux_reduction = "mean"
    variant_parameters: Tuple[str, ...] = ()
    flops_roles: Dict[str, str] = {}
    dense_start_refusal: Optional[str] = None

    @classmethod
    def options_for_ratio(cls, num_heads: int, activation_ratio: float) -> Dict[str, Any]:
        """The variant's routing options that realise ``activation_ratio`` on a layer of ``num_heads``."""
        if float(activation_ratio) != 1.0:
            raise ConfigError(f"attention '{cls.attention_name}' uses every head; it takes no activation_ratio "
                              f"below 1 (got {activation_ratio})")
        return {}

    def active_heads(self) -> int:
        """Heads (or experts) each token uses in this layer: what FLOPs, reports and summaries read."""
        return int(self.num_heads)

    def dense_start(self, router_std: float, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """Start values of :attr:`variant_parameters` (state-dict names relative to this module) for a layer whose
        form weights were copied from a dense attention (continue-tuning)."""
        if self.dense_start_refusal:
            raise ConfigError(self.dense_start_refusal)
        return {}

    def after_optimizer_step(self) -> None:
        """Called once per optimizer step (schedules that count steps, e.g. a warm-up)."""

    def routing_description(self) -> Dict[str, Any]:
        """Plain numbers describing this layer's routing (logged and shown in reports)."""
        return {"num_heads": int(self.num_heads), "active_heads": self.active_heads()}


def register_attention(name: str) -> Callable[[type], type]:
    """Register an attention variant (an :class:`AttentionVariant` mixin over a form) under ``name``."""
    if not name.isidentifier():
        raise ValueError(f"attention name '{name}' must be a Python identifier")

    def wrap(cls: type) -> type:
        if name in _VARIANTS and _VARIANTS[name] is not cls:
            raise ValueError(f"attention '{name}' is already registered by {_VARIANTS[name].__qualname__}")
        if not issubclass(cls, AttentionVariant):
            raise TypeError(f"attention '{name}': {cls.__qualname__} must derive from AttentionVariant")
        cls.attention_name = name
        _VARIANTS[name] = cls
        return cls

    return wrap


def register_form(name: str) -> Callable[[type], type]:
    """Register an attention form (a complete dense multi-head attention) under ``name``."""
    if not name.isidentifier():
        raise ValueError(f"form name '{name}' must be a Python identifier")

    def wrap(cls: type) -> type:
        if name in _FORMS and _FORMS[name] is not cls:
            raise ValueError(f"form '{name}' is already registered by {_FORMS[name].__qualname__}")
        cls.form_name = name
        _FORMS[name] = cls
        _serve_composed_classes(sys.modules[cls.__module__])
        return cls

    return wrap


def composed_class(name: str) -> type:
    """The composed class named ``<variant>__<form>`` (what pickle looks up); AttributeError for other names."""
    variant, sep, form = name.partition(COMPOSED_SEPARATOR)
    if not sep or variant not in _VARIANTS or form not in _FORMS:
        raise AttributeError(name)
    return attention_class(variant, form)


def _serve_composed_classes(module) -> None:
    """Give a form's module a module-level ``__getattr__`` (PEP 562) that answers composed names."""
    previous = getattr(module, "__getattr__", None)
    if getattr(previous, "serves_composed_classes", False):
        return

    def __getattr__(name: str):
        try:
            return composed_class(name)
        except AttributeError:
            if previous is not None:
                return previous(name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None

    __getattr__.serves_composed_classes = True
    module.__getattr__ = __getattr__


def list_attention() -> List[str]:
    """Names of the registered attention variants, in registration order."""
    return list(_VARIANTS)


def list_forms() -> List[str]:
    return list(_FORMS)


def variant_class(name: str) -> type:
    """The registered variant mixin ``name``."""
    if name not in _VARIANTS:
        raise ConfigError(f"unknown attention '{name}'; known: {', '.join(list_attention())}")
    return _VARIANTS[name]


def attention_class(name: str, form: str = "sdpa") -> type:
    """The composed ``nn.Module`` class for variant ``name`` over ``form``."""
    variant = variant_class(name)
    if form not in _FORMS:
        raise ConfigError(f"unknown attention form '{form}'; known: {', '.join(list_forms())}")
    base = _FORMS[form]
    key = (variant, base)
    if key not in _COMPOSED:
        cls = type(f"{variant.__name__}{base.__name__}", (variant, base), {})
        # importable by name: pickle / torch.save(model) look it up in the form's module
        cls.__module__, cls.__qualname__ = base.__module__, f"{name}{COMPOSED_SEPARATOR}{form}"
        _COMPOSED[key] = cls
    return _COMPOSED[key]


def attention_options(name: str, form: str = "sdpa") -> List[str]:
    """Keyword options the composed class accepts (besides ``dim`` and ``num_heads``)."""
    names: List[str] = []
    for klass in attention_class(name, form).__mro__:
        if "__init__" not in vars(klass) or klass in (nn.Module, object):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "dim", "num_heads"):
                if p.name not in names:
                    names.append(p.name)
    return names


def variant_option_defaults(name: str) -> Dict[str, Any]:
    """``{option: default}`` of variant ``name``'s own options (its ``__init__`` keywords)."""
    init = vars(variant_class(name)).get("__init__")
    if init is None:
        return {}
    return {p.name: p.default for p in inspect.signature(init).parameters.values() if p.kind is p.KEYWORD_ONLY}


def pop_old_form_key(options: Dict[str, Any], form: str) -> str:
    """``form``, or the value ``options`` gives under the old key ``kernel`` (removed from ``options``, with a
    :class:`DeprecationWarning`); both given and different: :class:`ConfigError`."""
    if OLD_FORM_KEY not in options:
        return form
    old = options.pop(OLD_FORM_KEY)
    warnings.warn(f"the attention option '{OLD_FORM_KEY}' is now called 'form' ({OLD_FORM_KEY}={old} -> form={old}); "
                  f"'{OLD_FORM_KEY}' names an op's implementation (kernels.<key>)", DeprecationWarning, stacklevel=3)
    if form not in ("sdpa", old):
        raise ConfigError(f"form={form} and the old {OLD_FORM_KEY}={old} disagree; give form= only")
    return old


def build_attention(name: str, dim: int, num_heads: int, form: str = "sdpa", **options: Any) -> nn.Module:
    """Build attention ``name`` (``mha``, ``moh``, ``moa``, ...) of width ``dim`` with ``num_heads`` heads; ``form``
    picks how a head attends (``sdpa`` for plain ViT/DiT blocks; backbones register their own). Unknown names and
    options raise :class:`ConfigError` with the allowed values. The old ``kernel=`` is taken for ``form=``, with a
    deprecation warning."""
    form = pop_old_form_key(options, form)
    cls = attention_class(name, form)
    allowed = attention_options(name, form)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"attention '{name}' (form '{form}') got unknown option(s) {', '.join(unknown)}; "
                          f"it takes: {', '.join(allowed)}")
    return cls(dim, num_heads, **options)


def layer_options(options: Dict[str, Any], index: int, num_layers: int) -> Dict[str, Any]:
    """Pick layer ``index``'s value from every per-layer list in ``options``: a list/tuple is one entry per layer and
    must have ``num_layers`` entries; scalars apply to every layer (how presets give per-layer ``shared_heads``)."""
    picked = {}
    for key, value in options.items():
        if isinstance(value, Sequence) and not isinstance(value, str):
            if len(value) != num_layers:
                raise ConfigError(f"attention option {key} has {len(value)} entries but there are {num_layers} layers")
            value = value[index]
        picked[key] = value
    return picked


# ---- Asking a model about its attention layers -----------------------------------------------
def find_attention(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) for every registry-built attention module in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AttentionVariant)]


def routed_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """(name, module) for every attention module that routes heads (records routing)."""
    for name, module in find_attention(model):
        if getattr(module, "is_routed", False):
            yield name, module


def routed_layer_names(model: nn.Module) -> List[str]:
    """Layers in which a token uses fewer heads than the layer has: the one definition of a routed layer
    (``routed_layers`` in ``summary.json``, ``tools/flops.py``, ``tools/analyze_routing.py``)."""
    return [name for name, m in find_attention(model) if m.active_heads() < int(m.num_heads)]


def active_head_fraction(model: nn.Module) -> Optional[float]:
    """Active heads per token over all heads, summed over the attention layers (None: no layer)."""
    layers = find_attention(model)
    heads = sum(int(m.num_heads) for _, m in layers)
    return sum(m.active_heads() for _, m in layers) / heads if heads else None


def after_optimizer_step(model: nn.Module) -> None:
    """Tell every attention layer that an optimizer step was taken (once per step; a loop that steps often keeps
    :func:`optimizer_step_hooks` instead, found once)."""
    for hook in optimizer_step_hooks(model):
        hook()


def optimizer_step_hooks(model: nn.Module) -> List[Callable[[], None]]:
    """The ``after_optimizer_step`` of every attention layer of ``model`` whose variant has one (the trainer finds them
    once and calls each after every optimizer step, so a step never walks the model)."""
    return [module.after_optimizer_step for _, module in find_attention(model)
            if type(module).after_optimizer_step is not AttentionVariant.after_optimizer_step]


def flops_roles_of(module: nn.Module) -> Dict[str, str]:
    """``{child: role}`` declared by the module's form and variant (the variant's win)."""
    roles: Dict[str, str] = {}
    for klass in reversed(type(module).__mro__):
        roles.update(vars(klass).get("flops_roles", {}))
    return roles


def describe(module: nn.Module) -> Optional[str]:
    name = getattr(module, "attention_name", None)
    return None if name is None else f"{name}[{module.form_name}]"
