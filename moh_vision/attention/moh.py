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

import math
from typing import Optional, Tuple

import torch
from torch import nn

from moh_vision.errors import ConfigError
from .registry import register_attention
from .routing import (RoutedMixin, load_balance_loss, renormalised_topk_gates, resolve_moh_heads, topk_mask)
from .sparse import SPARSE_KERNELS, sparse_flops_ratio, sparse_moh_forward

Tensor = torch.Tensor

MOH_IMPLS = ("auto", "masked", "sparse", "triton")


# ----------------------------------------------------------------------------------------------
# impl="auto": when the sparse path pays
#
# Sparse MoH costs about its FLOP bound (``sparse_flops_ratio``: keys/values for every head plus
# queries, attention and output projection of the active heads, over dense) plus an overhead
# (gathers, scatters, one call per routed head) that shrinks as sequences grow; masked MoH costs
# ~1.00-1.05x dense. ``auto`` runs sparse when ``bound + overhead(tokens) <= 0.95``: predicted to
# beat masked by a margin larger than the noise of the measurements below.
#
# Measured on CPU only: 2-core AMD EPYC VM (AVX-512), torch 2.14.1, fp32, 1 thread, process CPU
# time (the machine was shared with other jobs, so wall time was useless), with
#   python tools/bench_attention.py --threads 1 --clock cpu --seqlens 64 196 576 1024 \
#       --ratios 0.5 0.6 0.67 0.75 0.83 0.9          (and --seqlens 4096 --ratios 0.5 0.75 0.9)
# for (dim, heads) = (768, 12), (384, 6) [seqlens 64 256 1024], (1152, 16) [seqlens 256 1024],
# ~2048 tokens per batch, forward and forward+backward. Overhead = the largest
# ``sparse/dense - bound`` seen at that length (forward was the worse mode; noise about +-0.03),
# outliers aside; between lengths it is interpolated in log(tokens). Shorter than 64 tokens,
# narrower than dim 384 or head_dim 64 (outside the measurements): masked.
# CUDA: no GPU was available, so nothing is picked there but the reference path until
# ``tools/bench_attention.py --device cuda`` has been run and a table like this one added.
# ----------------------------------------------------------------------------------------------
CPU_SPARSE_OVERHEAD = ((64, 0.18), (196, 0.15), (576, 0.12), (1024, 0.12), (4096, 0.04))
SPARSE_MAX_PREDICTED = 0.95
MEASURED_MIN_DIM, MEASURED_MIN_HEAD_DIM = 384, 64


def sparse_overhead(tokens: int, table=CPU_SPARSE_OVERHEAD) -> Optional[float]:
    """Measured overhead of the sparse path at ``tokens`` per image (None below the table)."""
    if tokens < table[0][0]:
        return None
    for (n0, o0), (n1, o1) in zip(table, table[1:]):
        if tokens <= n1:
            t = (math.log(tokens) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return o0 + t * (o1 - o0)
    return table[-1][1]


def choose_impl(device: str, tokens: int, dim: int, num_heads: int, head_dim: int, shared_heads: int,
                topk: int) -> str:
    """``"sparse"`` or ``"masked"`` for an MoH layer over ``sdpa`` (what ``impl="auto"`` runs)."""
    if topk == 0 or device != "cpu":
        return "masked"
    if dim < MEASURED_MIN_DIM or head_dim < MEASURED_MIN_HEAD_DIM:  # outside what was measured
        return "masked"
    overhead = sparse_overhead(tokens)
    if overhead is None:
        return "masked"
    bound = sparse_flops_ratio(dim, num_heads, head_dim, tokens, shared_heads, topk)
    return "sparse" if bound + overhead <= SPARSE_MAX_PREDICTED else "masked"


@register_attention("moh")
class MoH(RoutedMixin):
    """Mixin: MoH head routing over any kernel. Build with ``build_attention("moh", ...)``.

    Args:
        shared_heads: always-active heads (the first ``shared_heads`` head indices).
        topk: routed heads each token selects (the official ``routed_head``).
        activation_ratio: alternative to ``topk``: fraction of heads a token uses; see
            :func:`~moh_vision.attention.routing.resolve_moh_heads` for the policy.
        impl: how the heads are executed; every choice gives the same outputs and gradients.
            ``"masked"`` computes every head and zeroes unselected ones (the official reference,
            any kernel); ``"sparse"`` computes queries, attention and output projection only for
            the selected (token, head) pairs (pure PyTorch, ``sdpa`` kernel only, see
            :mod:`~moh_vision.attention.sparse`); ``"triton"`` is ``sparse`` with a Triton
            attention kernel for the routed heads (CUDA; on CPU only under ``TRITON_INTERPRET=1``);
            ``"auto"`` picks per call from measured thresholds (:func:`choose_impl`).
    """

    def __init__(self, dim: int, num_heads: int, *, shared_heads: Optional[int] = None, topk: Optional[int] = None,
                 activation_ratio: Optional[float] = None, impl: str = "auto", **kernel_options):
        super().__init__(dim, num_heads, **kernel_options)
        if impl not in MOH_IMPLS:
            raise ConfigError(f"MoH impl '{impl}' is unknown; allowed: {', '.join(MOH_IMPLS)}")
        self.impl = impl
        if impl in ("sparse", "triton") and self.kernel_name not in SPARSE_KERNELS:
            raise ConfigError(f"MoH impl '{impl}' supports kernel(s) {', '.join(SPARSE_KERNELS)}, not "
                              f"'{self.kernel_name}'; use impl=auto or impl=masked")
        if impl == "triton" and self.attn_drop > 0:
            raise ConfigError(f"MoH impl 'triton' has no attention dropout (attn_drop={self.attn_drop}); "
                              "use impl=sparse or impl=auto")
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
            self.store_routing(torch.ones_like(shared), None, None, gates=shared)
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
        self.store_routing(active, probs, load_balance_loss(probs, mask) if self.training else None, gates=gates)
        return gates, index

    def forward(self, x: Tensor) -> Tensor:
        gates, index = self.route(x)
        impl = self.execution_path(x)
        if impl == "masked":
            return self.output(self.heads(x), gates)
        if impl == "triton":
            from .triton_moh import triton_routed_attention  # imports triton only when asked for
            return sparse_moh_forward(self, x, gates, index, triton_routed_attention())
        return sparse_moh_forward(self, x, gates, index)

    def execution_path(self, x: Tensor) -> str:
        """The path this call runs: ``masked``, ``sparse`` or ``triton`` (resolves ``auto``)."""
        if self.topk == 0:  # dense-weighted layer: nothing to skip, masked is the exact computation
            return "masked"
        if self.impl != "auto":
            return self.impl
        if self.kernel_name not in SPARSE_KERNELS:
            return "masked"
        return choose_impl(x.device.type, x.shape[1], self.dim, self.num_heads, self.head_dim, self.shared_heads,
                           self.topk)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, shared_heads={self.shared_heads}, topk={self.topk}, "
                f"active={self.active_heads}/{self.num_heads}, impl={self.impl}")
