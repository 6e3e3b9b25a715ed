"""The ops the models call, each with its reference formula and its kernels in one place, one dispatch choosing.

A model calls one function per op; which implementation runs is the ``kernels`` config (:class:`Kernels`, held by the
model as plain configuration) and the call's device and tracer state (:meth:`~moh_vision.ops.dispatch.Op.choose`):

==================  ==================  =====================================================  ================
op                  ``kernels.<key>``   implementations besides ``reference``                  ``auto``
==================  ==================  =====================================================  ================
aggregated_attention ``aggregated``     ``fused`` (C++ / Triton), ``flex`` (CUDA candidate)     fused
moh_routing         ``routing``         ``fused`` (C++ / Triton: routing + gated merge)         fused
depthwise_conv      ``depthwise``       ``triton`` (CUDA candidate), ``written_grad``           reference
gated_tail, ...     ``recompute``       ``recompute`` (eager training: keep inputs only)        recompute
==================  ==================  =====================================================  ================

``python train.py kernels=reference`` runs every model on the reference formulas alone; ``docs/performance.md`` lists
the record that keeps each ``auto`` entry."""
from . import aggregated_flex  # noqa: F401  (registers the flex candidate)
from .aggregated import aggregated_attention, aggregated_attention_reference, local_window_mask
from .depthwise import depthwise_conv
from .dispatch import AUTO, OPS, REFERENCE, Kernels, Op, choices, resolved
from .recompute import average_pool, cosine_queries, gated_tail, position_mlp
from .routing import Routing, load_balance_loss, merge_heads, route, route_merge, topk_mask

__all__ = ["Kernels", "Op", "OPS", "AUTO", "REFERENCE", "choices", "resolved", "aggregated_attention",
           "aggregated_attention_reference", "local_window_mask", "depthwise_conv", "gated_tail", "cosine_queries",
           "average_pool", "position_mlp", "Routing", "route", "route_merge", "merge_heads", "topk_mask",
           "load_balance_loss"]
