"""Pluggable attention: ``build_attention(name, dim, num_heads, form=..., **options)``.

Importing this package imports every module in it (each variant file registers itself: a new variant is one file here
with a ``@register_attention`` class plus one YAML in ``configs/attention/``), then every entry point of the group
``moh_vision.attention`` (variants in other packages). Routed layers report their auxiliary loss and statistics to a
recorder the caller opens (:func:`record_routing`)."""
import importlib
import logging
import pkgutil
from importlib.metadata import entry_points

from .registry import (AttentionVariant, active_head_fraction, after_optimizer_step, attention_class,
                       attention_options, build_attention, find_attention, flops_roles_of, layer_options, list_attention,
                       list_forms, optimizer_step_hooks, register_attention, register_form, routed_layer_names,
                       routed_modules, variant_class, variant_option_defaults)
from .recorder import LayerRecord, RoutingRecorder, active_recorder, record_routing
from .forms import DotProductAttention, HeadAttention, dot_product_attention

_log = logging.getLogger(__name__)

# Built-in variants first, in this order (list_attention() order), then whatever else the package holds.
for _name in ("mha", "moh", "moa"):
    importlib.import_module(f"{__name__}.{_name}")
for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
for _entry in entry_points(group="moh_vision.attention"):
    try:
        _entry.load()
    except Exception as _err:  # a broken plug-in must not break the built-in variants
        _log.warning("attention entry point %s (%s) failed to load: %s", _entry.name, _entry.value, _err)

from .moh import MoH  # noqa: E402
from .moa import MoA  # noqa: E402

__all__ = ["AttentionVariant", "register_attention", "register_form", "build_attention", "list_attention",
           "list_forms", "attention_class", "variant_class", "attention_options", "variant_option_defaults",
           "layer_options", "record_routing", "RoutingRecorder", "routed_layer_names", "LayerRecord", "active_recorder",
           "routed_modules", "find_attention", "active_head_fraction", "after_optimizer_step",
           "optimizer_step_hooks", "flops_roles_of",
           "HeadAttention", "DotProductAttention", "dot_product_attention", "MoH", "MoA"]
