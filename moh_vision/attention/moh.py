"""Mixture-of-Head attention (MoH, Jin et al., ICML 2025).

Multi-head attention is a sum over heads, ``sum_i H_i W_O^i``; MoH weights that sum per token,
``sum_i g_i H_i W_O^i``, with ``g_i = 0`` for heads the token did not select. Heads ``0..h_s-1``
are shared (always on); each token picks ``topk`` of the remaining ``h - h_s`` routed heads.

Gates, as in the official code (parameter names ``wg``, ``wg_0``, ``wg_1`` match its checkpoints):

* routed: ``p = softmax(wg x)``; keep the top-k, renormalise them to sum 1, times ``topk``;
* shared: ``softmax(wg_1 x) * h_s`` (``1`` when ``h_s == 1``);
* two-stage mix: ``(a1, a2) = 2 * softmax(wg_0 x)`` scales shared and routed gates;
* ``topk == 0`` (every head shared) is a dense layer with learned per-token head weights.

The gates multiply each head's output before the output projection. Training adds the
load-balance loss ``E * sum_i me_i ce_i`` per routed layer (``collect_aux_loss``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from moh_vision.errors import ConfigError
from .registry import register_attention
from .routing import (RoutedMixin, load_balance_loss, renormalised_topk_gates, resolve_moh_heads, topk_mask)

Tensor = torch.Tensor

MOH_IMPLS = ("auto", "masked")


@register_attention("moh")
class MoH(RoutedMixin):
    """Mixin: MoH head routing over any kernel. Build with ``build_attention("moh", ...)``.

    Args:
        shared_heads: always-active heads (the first ``shared_heads`` head indices).
        topk: routed heads each token selects (the official ``routed_head``).
        activation_ratio: alternative to ``topk``: fraction of heads a token uses; see
            :func:`~moh_vision.attention.routing.resolve_moh_heads` for the policy.
        impl: ``"masked"`` computes every head and zeroes unselected ones (the official
            reference); ``"auto"`` picks the fastest exact path available.
    """

    def __init__(self, dim: int, num_heads: int, *, shared_heads: Optional[int] = None, topk: Optional[int] = None,
                 activation_ratio: Optional[float] = None, impl: str = "auto", **kernel_options):
        super().__init__(dim, num_heads, **kernel_options)
        if impl not in MOH_IMPLS:
            raise ConfigError(f"MoH impl '{impl}' is unknown; allowed: {', '.join(MOH_IMPLS)}")
        self.impl = impl
        self.shared_heads, self.topk = resolve_moh_heads(self.num_heads, shared_heads, topk, activation_ratio)
        routed = self.num_heads - self.shared_heads
        if self.topk > 0:
            self.wg = nn.Linear(dim, routed, bias=False)
            if self.shared_heads > 0:
                self.wg_0 = nn.Linear(dim, 2, bias=False)
        if self.shared_heads > 1:
            self.wg_1 = nn.Linear(dim, self.shared_heads, bias=False)
        self.init_routing_state()

    @property
    def active_heads(self) -> int:
        return self.shared_heads + self.topk

    def route(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """Per-token head gates ``[B, N, h]`` and the selected routed head indices ``[B, N, k]``
        (relative to the routed pool; ``None`` when nothing is routed). Stores loss and statistics."""
        h_s, k = self.shared_heads, self.topk
        if h_s > 1:
            shared = self.wg_1(x).softmax(dim=-1) * h_s
        else:
            shared = x.new_ones(*x.shape[:-1], h_s)
        if k == 0:
            self.store_routing(torch.ones_like(shared), None, None)
            return shared, None

        probs = self.wg(x).softmax(dim=-1)
        index, mask = topk_mask(probs.detach(), k)
        routed = renormalised_topk_gates(probs, mask, k)
        if h_s > 0:
            mix = self.wg_0(x).softmax(dim=-1) * 2
            gates = torch.cat([shared * mix[..., :1], routed * mix[..., 1:]], dim=-1)
        else:
            gates = routed
        active = torch.cat([torch.ones_like(shared), mask], dim=-1)
        self.store_routing(active, probs, load_balance_loss(probs, mask) if self.training else None)
        return gates, index

    def forward(self, x: Tensor) -> Tensor:
        gates, _ = self.route(x)
        return self.output(self.heads(x), gates)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, shared_heads={self.shared_heads}, topk={self.topk}, "
                f"active={self.active_heads}/{self.num_heads}, impl={self.impl}")
