"""MoH's official gates as one autograd node, computed head-major.

A MoH layer's routers give a handful of logits per token: ``h - h_s`` routed (``wg``), 2 for the
two-stage mix (``wg_0``) and ``h_s`` shared (``wg_1``). Computed token-major (``[B, N, L]``, as
:meth:`MoH.route <moh_vision.attention.moh.MoH.route>` writes the formulas) every softmax, top-k and
sum runs along a last dimension of 2 to 8 numbers, where the CPU kernels are slowest (a softmax over
``[1960, 4]`` takes ~80 us, an ``exp`` of it ~8 us), and autograd records some 25 nodes per layer.
:class:`MoHGates` computes the same gates with the logits laid out ``[B, L, N]`` (one GEMM,
``W @ x^T``): every step reduces over dim 1 with the tokens contiguous, and its backward is written out
in closed form (softmax, top-k renormalisation, two-stage mix, load-balance loss). At 10 x 196 tokens,
dim 384, 6 heads (2 CPU threads) the routing's forward takes 0.5 ms instead of 0.8-1.0 ms, about 1% of
the layer's forward; its backward costs what autograd's chain of small nodes did (fewer nodes, but
Python-side work in their place). The README gives the measurements.

The values are those of the token-major formulas up to rounding (a softmax reduced along another
dimension may differ in the last bit); ``tests/test_attention.py`` checks gates, selected heads,
aux loss and every gradient against them. :meth:`MoH.route` uses the token-major formulas where this
node would hide its work or where they are what the caller asked for: under ``torch.jit.trace`` (the
FLOP counter attributes the routers by child module) and ``torch.compile`` (which fuses them itself),
under autocast, with hooks or biases on the routers, and for learned shared heads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


class MoHGates(torch.autograd.Function):
    """``(x [B, N, C], weight [L, C]) -> (gates [B, h, N], index [B, k, N], probs [B, R, N], mask [B, R, N],
    loss [])`` with ``weight`` the routers' rows stacked ``wg`` (R = h - h_s), ``wg_0`` (2, when
    ``h_s > 0``), ``wg_1`` (h_s, when ``h_s > 1``). ``probs``: routed softmax before top-k, ``mask``:
    the selected routed heads (0/1), ``index``: their indices in the routed pool, all without gradient;
    ``loss``: ``R * sum_i me_i ce_i`` in fp32 when ``want_loss``, else a zero that carries no gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, shared: int, topk: int, want_loss: bool):
        B, N, _ = x.shape
        R = weight.shape[0] - (2 if shared > 0 else 0) - (shared if shared > 1 else 0)
        logits = torch.matmul(weight, x.transpose(1, 2))  # [B, L, N]
        probs = logits[:, :R].softmax(dim=1)
        index = probs.topk(topk, dim=1).indices
        mask = torch.zeros_like(probs).scatter_(1, index, 1.0)
        kept = probs * mask
        inv = kept.sum(dim=1, keepdim=True).clamp_min_(torch.finfo(kept.dtype).eps).reciprocal_()
        gates = x.new_empty(B, R + shared, N)
        mix = shares = None
        if shared > 0:
            mix = logits[:, R:R + 2].softmax(dim=1)  # the two-stage mix is 2 * mix
            if shared > 1:
                shares = logits[:, R + 2:].softmax(dim=1)
                torch.mul(shares, mix[:, :1] * (2 * shared), out=gates[:, :shared])
            else:
                torch.mul(mix[:, :1], 2, out=gates[:, :1])
            torch.mul(kept, inv * mix[:, 1:] * (2 * topk), out=gates[:, shared:])
        else:
            torch.mul(kept, inv * topk, out=gates)
        load = None
        loss = x.new_zeros((), dtype=torch.float32)
        if want_loss:  # R * sum_i me_i ce_i: mean probability times fraction of tokens, per routed head
            load = mask.float().mean(dim=(0, 2))
            loss = R * torch.dot(probs.float().mean(dim=(0, 2)), load)
        ctx.save_for_backward(x, weight, probs, mask, kept, inv, mix, shares, load)
        ctx.dims = (R, shared, topk)
        ctx.mark_non_differentiable(index, probs, mask)
        return gates, index, probs, mask, loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_gates: Optional[Tensor], _index, _probs, _mask, grad_loss: Optional[Tensor]):
        x, weight, probs, mask, kept, inv, mix, shares, load = ctx.saved_tensors
        R, shared, topk = ctx.dims
        B, N, _ = x.shape
        grad_logits = probs.new_zeros(B, weight.shape[0], N)
        grad_probs = None
        if grad_gates is not None:
            grad_routed = grad_gates[:, shared:]
            if shared > 0:
                # gates = 2 * mix_0 * shared_gate | 2 * mix_1 * routed_gate: the mix's gradient first
                grad_shared = grad_gates[:, :shared]
                from_shared = ((grad_shared * shares).sum(1, keepdim=True) * shared if shared > 1 else grad_shared)
                from_routed = (grad_routed * kept).sum(1, keepdim=True) * (inv * topk)
                grad_mix = torch.cat([from_shared, from_routed], dim=1) * 2
                grad_logits[:, R:R + 2] = softmax_backward(mix, grad_mix)
                if shared > 1:
                    grad_logits[:, R + 2:] = softmax_backward(shares, grad_shared * (mix[:, :1] * (2 * shared)))
                grad_routed = grad_routed * (mix[:, 1:] * 2)
            # routed gate = topk * kept / sum(kept), kept = probs * mask
            inner = (grad_routed * kept).sum(1, keepdim=True) * inv
            grad_probs = (grad_routed - inner) * (inv * topk) * mask
        if grad_loss is not None and load is not None:  # d loss / d probs = R * ce_i / (B * N)
            from_loss = (grad_loss * (R / (B * N)) * load).to(probs.dtype).view(1, R, 1)
            grad_probs = from_loss if grad_probs is None else grad_probs + from_loss
        if grad_probs is not None:
            grad_logits[:, :R] = softmax_backward(probs, grad_probs)
        grad_x = grad_weight = None
        grad_tokens = grad_logits.transpose(1, 2).reshape(B * N, -1)  # token-major: both GEMMs run faster so
        if ctx.needs_input_grad[0]:
            grad_x = (grad_tokens @ weight).view(B, N, -1)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_tokens.t() @ x.reshape(B * N, -1)
        return grad_x, grad_weight, None, None, None


def softmax_backward(probs: Tensor, grad: Tensor) -> Tensor:
    """Gradient of the logits of ``probs = softmax(logits, dim=1)`` given ``grad`` of ``probs``."""
    return probs * (grad - (grad * probs).sum(dim=1, keepdim=True))


def moh_gates(x: Tensor, weight: Tensor, shared: int, topk: int,
              want_loss: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """:class:`MoHGates` with the loss ``None`` when not wanted."""
    gates, index, probs, mask, loss = MoHGates.apply(x, weight, shared, topk, want_loss)
    return gates, index, probs, mask, (loss if want_loss else None)
