"""MoH's official gates for inference calls, computed head-major.

A MoH layer's routers give a handful of logits per token: ``h - h_s`` routed (``wg``), 2 for the
two-stage mix (``wg_0``) and ``h_s`` shared (``wg_1``). Computed token-major (``[B, N, L]``, as
:meth:`MoH.route <moh_vision.attention.moh.MoH.route>` writes the formulas) every softmax, top-k and
sum runs along a last dimension of 2 to 8 numbers, where the CPU kernels are slowest (a softmax over
``[1960, 4]`` takes ~80 us, an ``exp`` of it ~8 us). :func:`head_major_gates` computes the same gates
from logits laid out ``[B, L, N]`` (one GEMM, ``W @ x^T``), so that every step reduces over dim 1 with
the tokens contiguous: at 10 x 196 tokens, dim 384, 6 heads (2 CPU threads) the routing takes 0.5 ms
instead of 0.8-1.0 ms, about 1% of the layer's forward.

Only calls without autograd use it (:meth:`MoH.route` decides). For training, a version with a written-out
backward (one autograd node, the formulas token-major) was measured twice: the second time it dispatched 155
operators per layer call forward and backward instead of 164, but its Python forward and backward cost more
host time than autograd's C++ nodes save (2.12 ms against 1.88 ms per training call on a negligible input,
2-core Intel Xeon VM, one thread; docs/performance.md), and on a GPU the host's time is what sets an eager
layer's; training keeps the formulas. The values here are the formulas' up to rounding (a softmax reduced
along another dimension may differ in the last bit); ``tests/test_attention.py`` checks gates, selected
heads, statistics and outputs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


@torch.no_grad()
def head_major_gates(x: Tensor, weight: Tensor, shared: int,
                     topk: int) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """MoH's gates for ``x`` [B, N, C] from ``weight`` [L, C], the routers' rows stacked ``wg`` (R = h - h_s),
    ``wg_0`` (2, when ``h_s > 0``), ``wg_1`` (h_s, when ``h_s > 1``). Returns, head-major: ``gates``
    [B, h, N], ``index`` [B, k, N] (selected routed heads, in the routed pool), ``probs`` [B, R, N] (routed
    softmax before top-k) and ``mask`` [B, R, N] (the selection, 0/1); with ``topk == 0`` (every head shared,
    ``weight`` is ``wg_1``) the gates alone, the others None."""
    B, N, _ = x.shape
    # [B, L, N]; bmm over the broadcast weight is what matmul runs, in 3 operators instead of its 8
    logits = torch.bmm(weight.expand(B, -1, -1), x.transpose(1, 2))
    if topk == 0:  # a dense layer with learned per-token head weights
        return logits.softmax(dim=1).mul_(shared), None, None, None
    R = weight.shape[0] - (2 if shared > 0 else 0) - (shared if shared > 1 else 0)
    probs = logits[:, :R].softmax(dim=1)
    index = probs.topk(topk, dim=1).indices
    mask = torch.zeros_like(probs).scatter_(1, index, 1.0)
    kept = probs * mask  # renormalised over the selected heads, times topk
    scale = kept.sum(dim=1, keepdim=True).clamp_min_(torch.finfo(kept.dtype).eps).reciprocal_().mul_(topk)
    gates = x.new_empty(B, R + shared, N)
    if shared > 0:
        mix = logits[:, R:R + 2].softmax(dim=1).mul_(2)  # the two-stage mix
        if shared > 1:
            torch.mul(logits[:, R + 2:].softmax(dim=1), mix[:, :1] * shared, out=gates[:, :shared])
        else:
            gates[:, :1] = mix[:, :1]
        scale = scale * mix[:, 1:]
    torch.mul(kept, scale, out=gates[:, shared:])
    return gates, index, probs, mask

