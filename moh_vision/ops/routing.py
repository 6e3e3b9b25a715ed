"""MoH's routing and gated head merge: the formulas, and one kernel each way that computes both.

From the stacked routers' logits ``[..., L]`` (``wg``'s R routed columns, ``wg_0``'s 2 where heads are both shared
and routed, ``wg_1``'s ``h_s`` where more than one is shared): routed gates ``p = softmax(wg x)``, top-k kept,
renormalised, times ``topk``; shared gates ``softmax(wg_1 x) * h_s`` (``1`` when ``h_s == 1``); the two-stage mix
``2 * softmax(wg_0 x)``; the load-balance loss ``E * sum_i me_i ce_i`` (training). The heads ``[B, h, N, d]`` times
their gates, merged to ``[B, N, h * d]``, go to the output projection. Op ``moh_routing`` (``kernels.routing``):

* ``reference``: :func:`route` (ATen operators; under ``torch.compile`` inductor fuses them), then the gate multiply;
* ``fused`` (CUDA): routing, loss and gated merge in one Triton kernel each way (:mod:`~moh_vision.ops.routing_triton`:
  the gates applied where the heads are merged, as a fused attention applies them in its epilogue). Eager calls only;
  under autocast it reads the low-precision logits as they are and gives float32 gates, as autocast's float32 softmax
  gives them to the formulas (``tests/test_fused_routing.py``). No CPU kernel: a C++ one was within 5% of the formulas.

Ties: the kernels take the lower head among equal probabilities, as :func:`topk_mask` does."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .dispatch import EAGER, Op
from .triton import triton_available

Tensor = torch.Tensor


class Routing(NamedTuple):
    """MoH's routing of one forward."""

    gates: Tensor                # [..., h]
    probs: Optional[Tensor]      # [..., R] routed softmax (topk == 0: None)
    mask: Tensor                 # [..., R] 0/1 selection (topk == 0: empty)
    index: Optional[Tensor]      # [..., k] selected routed heads, by decreasing probability (topk == 0: None)
    loss: Optional[Tensor]       # load-balance loss (float32 scalar) when asked for


# ---- The formulas ----------------------------------------------------------------------------
def router_widths(routed: int, shared: int, topk: int) -> Tuple[int, int, int]:
    """Columns of ``wg``, ``wg_0`` and ``wg_1`` in the stacked logits (0: that router does not exist)."""
    return (routed if topk else 0), (2 if topk and shared else 0), (shared if shared > 1 else 0)


def topk_mask(probs: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """Indices ``[..., k]`` of the k largest entries (by decreasing value) and the matching 0/1 mask (no gradient); on
    ties the lower index ranks first, as the fused kernels choose. Written as ranks (how many entries beat each one: a
    comparison of every pair over the last dim, a handful of heads), not ``torch.topk``: under ``torch.compile`` the
    mask is then point-wise work that the compiler fuses with the softmax before it and the gates after it, and a graph
    that reads only the mask drops the indices. ``torch.topk`` would also leave the order of ties unspecified."""
    heads = torch.arange(probs.shape[-1], device=probs.device)
    mine, theirs = probs.unsqueeze(-1), probs.unsqueeze(-2)  # [..., i, 1] against [..., 1, j]
    beaten = (theirs > mine) | ((theirs == mine) & (heads < heads.unsqueeze(-1)))  # [..., i, j]: j ranks above i
    rank = beaten.sum(dim=-1)  # [..., R]: 0 for the largest
    mask = (rank < k).to(probs.dtype)
    slots = torch.arange(k, device=probs.device).unsqueeze(-1)  # [k, 1]
    index = (rank.unsqueeze(-2) == slots).to(torch.int32).argmax(dim=-1)  # [..., k]: the entry of rank 0, 1, ...
    return index, mask


@torch.fx.wrap  # any fx tracer records it as one call: it reads its dtype's epsilon, which a proxy does not carry
def renormalised_topk_gates(probs: Tensor, mask: Tensor, k: int) -> Tensor:
    """Keep the selected probabilities, renormalise them to sum 1, multiply by k (official MoH)."""
    kept = probs * mask
    denom = kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).eps)
    return kept / denom * k


def load_balance_loss(probs: Tensor, mask: Tensor) -> Tensor:
    """MoH's per-layer loss ``E * sum_i me_i * ce_i``: ``me`` the mean router probability per routed head over all
    tokens (before top-k), ``ce`` the fraction of tokens that selected each head (no gradient). Per device."""
    num_experts = probs.shape[-1]
    me = probs.reshape(-1, num_experts).float().mean(dim=0)
    ce = mask.reshape(-1, num_experts).float().mean(dim=0).detach()
    return num_experts * (me * ce).sum()


def route(logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool) -> Routing:
    """MoH's gates (and the loss when ``with_loss``) from the stacked logits, written out with ATen operators.
    Nothing routed (``topk == 0``): ``mask`` empty, ``probs`` and ``index`` None."""
    w_routed, w_mix, w_shared = router_widths(routed, shared, topk)
    routed_logits, mix_logits, shared_logits = logits.split([w_routed, w_mix, w_shared], dim=-1)
    if shared > 1:
        shared_gates = shared_logits.softmax(dim=-1) * shared
    else:
        shared_gates = logits.new_ones(logits.shape[:-1] + (shared,))  # a size, not *args: torch.fx traces it
    if topk == 0:
        return Routing(shared_gates, None, shared_gates[..., :0], None, None)
    probs = routed_logits.softmax(dim=-1)
    index, mask = topk_mask(probs.detach(), topk)
    gates = renormalised_topk_gates(probs, mask, topk)
    if shared > 0:
        mix = mix_logits.softmax(dim=-1) * 2
        gates = torch.cat([shared_gates * mix[..., :1], gates * mix[..., 1:]], dim=-1)
    return Routing(gates, probs, mask, index, load_balance_loss(probs, mask) if with_loss else None)


def merge_heads(heads: Tensor, gates: Optional[Tensor] = None) -> Tensor:
    """``[B, h, N, d]`` (times per-token gates ``[B, N, h]``) -> ``[B, N, h * d]``."""
    B, h, N, d = heads.shape
    heads = heads.transpose(1, 2)
    if gates is not None:
        heads = heads * gates.unsqueeze(-1).to(heads.dtype)
    return heads.reshape(B, N, h * d)


def route_merge_reference(heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int,
                          with_loss: bool) -> Tuple[Tensor, Routing]:
    """:func:`route`, then the heads times their gates, merged: ``([B, N, h * d], routing)``."""
    routing = route(logits, routed, shared, topk, with_loss)
    return merge_heads(heads, routing.gates), routing


# ---- The fused kernels -----------------------------------------------------------------------
ROUTING = Op("moh_routing", key="routing", reference=route_merge_reference, auto={"cuda": "fused"})


@ROUTING.implement("fused", devices=("cuda",), tracers=EAGER, available=triton_available)
def route_merge_fused(heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int,
                      with_loss: bool) -> Tuple[Tensor, Routing]:
    """:func:`route_merge_reference` in one Triton kernel each way; a layer that routes nothing, or heads and logits of
    different dtypes, runs the reference."""
    if topk == 0 or heads.dtype != logits.dtype:
        return route_merge_reference(heads, logits, routed, shared, topk, with_loss)
    from .routing_triton import triton_route_merge
    merged, gates, probs, mask, index, loss = triton_route_merge(heads, logits, routed, shared, topk, with_loss,
                                                                 formula=route_merge_reference)
    return merged, Routing(gates, probs, mask, index, loss if loss.dim() == 0 else None)


def route_merge(heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool,
                kernel: str = "auto") -> Tuple[Tensor, Routing]:
    """The heads ``[B, h, N, d]`` gated by the routing of the stacked logits and merged, ``[B, N, h * d]``, and the
    routing, by the implementation ``kernel`` (``kernels.routing``) chooses."""
    return ROUTING(kernel, heads, logits, routed, shared, topk, with_loss)
