"""The ops the models call, each with its reference formula and its kernels in one place, one dispatch choosing.

A model calls one function per op; which implementation runs is the ``kernels`` config (:class:`Kernels`, held by the
model as plain configuration) and the call's device and tracer state (:meth:`~moh_vision.ops.dispatch.Op.choose`).
Each family of ops (``kernels.<key>``), its implementations, and ``auto`` per device:

- ``aggregated`` (``aggregated_attention``): ``reference``; ``fused`` (C++ on the CPU, Triton on CUDA); ``flex``
  (FlexAttention, CUDA). ``auto``: ``fused`` on the CPU, ``fused`` on CUDA.
- ``routing`` (``moh_routing``: routing and gated merge): ``reference``; ``fused`` (one Triton kernel each way, CUDA).
  ``auto``: ``reference`` on the CPU, ``fused`` on CUDA.
- ``depthwise`` (``depthwise_conv``): ``reference`` (NCHW, the official layout); ``channels_last`` (the tokens read in
  place); ``triton`` (CUDA); ``written_grad`` (its backward written out). ``auto``: ``channels_last`` on the CPU,
  ``reference`` on CUDA.
- ``recompute`` (``gated_tail``, ``cosine_queries``, ``average_pool``, ``position_mlp``): ``reference``; ``recompute``
  (eager training: keep the inputs, recompute the rest in backward). ``auto``: ``recompute`` on the CPU, ``recompute``
  on CUDA.

``python train.py kernels=reference`` runs every model on the reference formulas alone. ``docs/performance.md`` has
the same table with the record that keeps each ``auto`` entry; ``tests/test_ops_docs.py`` checks both against the
registered implementations."""
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
