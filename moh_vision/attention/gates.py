"""MoH's official gates for inference calls, computed head-major.

A MoH layer's routers give a handful of logits per token: ``h - h_s`` routed (``wg``), 2 for the
two-stage mix (``wg_0``) and ``h_s`` shared (``wg_1``). Computed token-major (``[B, N, L]``, as
:meth:`MoH.route <moh_vision.attention.moh.MoH.route>` writes the formulas) every softmax, top-k and
sum runs along a last dimension of 2 to 8 numbers, where the CPU kernels are slowest (a softmax over
``[1960, 4]`` takes ~80 us, an ``exp`` of it ~8 us). :func:`head_major_gates` computes the same gates
from logits laid out ``[B, L, N]`` (one GEMM, ``W @ x^T``), so that every step reduces over dim 1 with
the tokens contiguous: at 10 x 196 tokens, dim 384, 6 heads (2 CPU threads) the routing takes 0.5 ms
instead of 0.8-1.0 ms, about 1% of the layer's forward.

Only calls without autograd use it (:meth:`MoH.route` decides). The values here are the formulas' up to
rounding (a softmax reduced along another dimension may differ in the last bit); ``tests/test_attention.py``
checks gates, selected heads, statistics and outputs.

Training calls use :class:`TokenMajorGates`: the same formulas token-major, as one autograd node with a
written-out backward, so that the routing costs a GPU's host a few dozen launches instead of about a hundred
(``tools/bench_models.py ops=true``); ``tests/test_compile_routing.py`` checks it against the formulas.
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


class TokenMajorGates(torch.autograd.Function):
    """MoH's gates and load-balance loss from the routers' logits, token-major, with a written-out backward.

    ``logits`` [..., L] hold the routers' outputs side by side as :meth:`MoH.router_logits` makes them with one
    GEMM: ``wg`` (R = h - h_s routed), ``wg_0`` (2, when ``h_s > 0``), ``wg_1`` (h_s, when ``h_s > 1``). Returns
    ``gates`` [..., h], ``index`` [..., k] (selected routed heads), ``probs`` [..., R] (routed softmax before
    top-k, detached) and the loss ``R * sum_i me_i ce_i`` (a zero when ``with_loss`` is False). The formulas are
    :meth:`MoH.route`'s; through autograd they are ~20 nodes and ~100 operators forward and backward, here one
    node and ~45: the selected probabilities come from top-k itself, the load ``ce`` from the indices, and the
    backward reuses the forward's softmaxes. Values equal the formulas' up to rounding (the renormalising sum
    adds the k selected probabilities, not R masked ones); ``tests/test_attention.py`` checks outputs and
    every gradient against them."""

    @staticmethod
    def forward(logits: Tensor, shared: int, topk: int, with_loss: bool):
        R = logits.shape[-1] - (2 if shared > 0 else 0) - (shared if shared > 1 else 0)
        routed_logits, rest = logits.split([R, logits.shape[-1] - R], dim=-1)
        probs = routed_logits.softmax(dim=-1)
        values, index = probs.topk(topk, dim=-1)
        denom = values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(values.dtype).eps)
        routed = values / denom * topk  # renormalised over the selected heads, times k
        gates = logits.new_zeros(*logits.shape[:-1], shared + R)
        mix = shared_soft = None
        if shared > 0:
            mix = rest[..., :2].softmax(dim=-1) * 2  # the two-stage mix
            if shared > 1:
                shared_soft = rest[..., 2:].softmax(dim=-1)
                torch.mul(shared_soft * shared, mix[..., :1], out=gates[..., :shared])
            else:
                gates[..., :1] = mix[..., :1]
            gates[..., shared:].scatter_(-1, index, routed * mix[..., 1:])
        else:
            gates.scatter_(-1, index, routed)
        loss = ce = None
        if with_loss:  # ce: the fraction of tokens that selected each head, counted from the indices
            tokens = probs.numel() // R
            me = probs.reshape(-1, R).float().mean(dim=0)
            ce = torch.bincount(index.reshape(-1), minlength=R).to(me.dtype) / tokens  # indices < R: R counts
            loss = R * (me * ce).sum()
        return gates, index, probs, loss, ce, routed, mix, shared_soft, denom

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, shared, topk, with_loss = inputs
        gates, index, probs, loss, ce, routed, mix, shared_soft, denom = output
        ctx.shared, ctx.topk, ctx.logits_dtype = shared, topk, logits.dtype
        ctx.set_materialize_grads(False)  # only the gates and the loss get gradients: no zeros for the rest
        ctx.save_for_backward(index, probs, ce, routed, mix, shared_soft, denom)
        ctx.mark_non_differentiable(*(t for t in (index, probs, ce, routed, mix, shared_soft, denom) if t is not None))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_gates, _index, _probs, d_loss, *_):
        index, probs, ce, routed, mix, shared_soft, denom = ctx.saved_tensors
        h_s, k = ctx.shared, ctx.topk
        R = probs.shape[-1]
        if d_gates is None:
            d_gates = probs.new_zeros(*probs.shape[:-1], h_s + R)
        d_selected = d_gates[..., h_s:].gather(-1, index)  # [..., k]
        parts = []
        if h_s > 0:
            d_shared_gates = d_gates[..., :h_s]
            d_mix = torch.stack([(d_shared_gates * shared_soft).sum(-1) * h_s if h_s > 1 else d_shared_gates[..., 0],
                                 (d_selected * routed).sum(-1)], dim=-1)
            d_routed = d_selected * mix[..., 1:]
            if h_s > 1:
                d_soft = d_shared_gates * mix[..., :1] * h_s
                parts.append(torch._softmax_backward_data(d_soft, shared_soft, -1, shared_soft.dtype))
            parts.insert(0, torch._softmax_backward_data(d_mix * 2, mix / 2, -1, mix.dtype))
        else:
            d_routed = d_selected
        # routed_i = k * v_i / S with S the sum of the selected v: dv_i = k / S * (dr_i - sum_j dr_j routed_j / k)
        d_values = (d_routed - (d_routed * routed).sum(-1, keepdim=True) / k) * (k / denom)
        d_probs = torch.zeros_like(probs).scatter_(-1, index, d_values)
        if ce is not None and d_loss is not None:  # d(R * sum_i me_i ce_i) / dp = R * ce / tokens, every token
            d_probs = d_probs + (d_loss * (R / (probs.numel() // R)) * ce).to(d_probs.dtype)
        parts.insert(0, torch._softmax_backward_data(d_probs, probs, -1, probs.dtype))
        return torch.cat(parts, dim=-1).to(ctx.logits_dtype), None, None, None
