"""Pluggable attention: ``build_attention(name, dim, num_heads, kernel=..., **options)``.

Importing this package registers the built-in kernel (``sdpa``) and variants (``mha``, ``moh``,
``moa``). A new variant is one file with a ``@register_attention`` mixin plus one YAML in
``configs/attention/``.
"""
from .registry import (attention_class, attention_options, build_attention, collect_aux_loss, collect_routing_stats,
                       find_attention, layer_options, list_attention, list_kernels, register_attention,
                       register_kernel, reset_routing, routed_modules)
from .kernels import DotProductAttention, HeadAttention, dot_product_attention
from . import mha, moh, moa  # noqa: F401  (registration, in this order)
from .moh import MoH
from .moa import MoA

__all__ = [
    "register_attention", "register_kernel", "build_attention", "list_attention", "list_kernels",
    "attention_class", "attention_options", "layer_options", "collect_aux_loss", "collect_routing_stats",
    "reset_routing", "routed_modules", "find_attention", "HeadAttention", "DotProductAttention",
    "dot_product_attention", "MoH", "MoA",
]
