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

Learned shared heads (``shared_heads="learned"``, not in the paper; its reviewers asked for it)
---------------------------------------------------------------------------------------------
The official layer always shares heads ``0..h_s-1``. With ``shared_heads="learned"`` each layer
learns WHICH ``h_s`` heads are shared (``h_s`` and ``topk`` still come from ``activation_ratio``,
the policy of :func:`~moh_vision.attention.routing.resolve_moh_heads`):

* parameters: ``shared_score`` ([h], zero-initialised: the partition starts as the official
  first ``h_s`` heads, ties broken by index), and routers over *all* h heads, ``wg`` [h, C]
  (routed logits; only the non-shared heads' rows are read) and ``wg_1`` [h, C] (shared-gate
  logits; only the shared heads' rows are read; absent when ``h_s == 1``), plus ``wg_0`` [2, C];
* buffers (persistent, in the state dict): ``shared_mask`` ([h] bool, the partition in force),
  ``shared_seen`` (training forwards of warm-up so far), ``shared_frozen`` (bool);
* warm-up, the first ``learn_shared_steps`` training forwards: the forward uses the hard
  partition ``top-h_s(shared_score)`` (``"gumbel"``: of ``shared_score + Gumbel noise``, a new
  sample per forward) with exactly the official gates on it; backward is straight-through: the
  gate of head i gets ``+ (s_i - stopgrad(s_i)) * stopgrad(G_shared_i - G_routed_i)``, where
  ``s = h_s * softmax(score)`` is the soft relaxation (zero in the forward pass) and
  ``G_shared_i - G_routed_i`` is the change of head i's gate if it switched set: a shared head
  would lose its shared gate (it would be routed, and most tokens would not select it); a routed
  head would get ``a1 * h_s * exp(u_i) / (exp(u_i) + sum_{shared j} exp(u_j))`` (its share of the
  shared softmax, ``u = wg_1 x``; ``a1`` when ``h_s == 1``) instead of its routed gate;
* at the end of the ``learn_shared_steps``-th training forward ``top-h_s(shared_score)`` as that
  forward saw it (noise-free; with ``"ste"`` the partition it used) is frozen into ``shared_mask``;
  from then on the scores no longer matter (they stay in the graph with a zero gradient, so DDP
  sees every parameter used). Eval forwards during warm-up use ``top-h_s(shared_score)`` and change
  nothing. The masked path needs no host sync for any of this (tensor ops on the buffers).
  Gradient accumulation counts micro-batches; a resumed run continues from the buffers.

Every token always uses exactly ``h_s + topk`` heads, during warm-up and after. A frozen learned
layer computes what an official layer computes whose heads are permuted so that the learned
shared heads come first (``tests/test_learned_shared_heads.py``). Learning applies only where
both sets are non-empty (``0 < h_s`` and ``topk > 0``); elsewhere (a dense-weighted layer with
``a == h``, or ``a == 1`` with no shared head) the layer is the standard one. Every ``impl`` runs
learned layers: the sparse paths see the heads permuted so that the shared ones come first
(:class:`~moh_vision.attention.sparse.HeadPermutedView`: ``qkv`` rows and ``proj`` columns gathered
per call), ``impl="auto"`` decides as for a fixed layer with the same counts. Warm-up training
forwards always run masked: the estimator needs the output of every head for every token (what a
token would gain from a head it did not select), which only the masked path computes.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import nn

from moh_vision.errors import ConfigError
from .registry import register_attention
from .routing import (RoutedMixin, load_balance_loss, renormalised_topk_gates, resolve_moh_heads, topk_mask)
from .sparse import SPARSE_KERNELS, HeadPermutedView, sparse_flops_ratio, sparse_moh_forward

Tensor = torch.Tensor

MOH_IMPLS = ("auto", "masked", "sparse", "triton")
SHARED_ESTIMATORS = ("ste", "gumbel")  # straight-through top-h_s; the same on Gumbel-perturbed scores
LEARNED = "learned"


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
        shared_heads: always-active heads (the first ``shared_heads`` head indices); ``"learned"``:
            each layer learns which heads are shared (count from ``activation_ratio``; see the
            module docstring).
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
        learn_shared_steps: with ``shared_heads="learned"``: training forwards (micro-batches) of
            warm-up before the shared heads are frozen (0: frozen at once, on the initial
            partition = the first ``h_s`` heads). Ignored otherwise.
        shared_estimator: with ``shared_heads="learned"``: ``"ste"`` (straight-through top-h_s of
            the scores) or ``"gumbel"`` (straight-through top-h_s of Gumbel-perturbed scores).
    """

    def __init__(self, dim: int, num_heads: int, *, shared_heads: Union[int, str, None] = None,
                 topk: Optional[int] = None, activation_ratio: Optional[float] = None, impl: str = "auto",
                 learn_shared_steps: int = 500, shared_estimator: str = "ste", **kernel_options):
        super().__init__(dim, num_heads, **kernel_options)
        if impl not in MOH_IMPLS:
            raise ConfigError(f"MoH impl '{impl}' is unknown; allowed: {', '.join(MOH_IMPLS)}")
        learned = isinstance(shared_heads, str)
        if learned:
            if shared_heads != LEARNED:
                raise ConfigError(f"shared_heads='{shared_heads}' is unknown; give a count, null (the activation-ratio "
                                  f"policy) or '{LEARNED}'")
            if topk is not None:
                raise ConfigError(f"shared_heads={LEARNED} takes the shared and routed head counts from "
                                  f"activation_ratio; drop topk={topk}")
            shared_heads = None
        if isinstance(learn_shared_steps, bool) or not isinstance(learn_shared_steps, int) or learn_shared_steps < 0:
            raise ConfigError(f"learn_shared_steps={learn_shared_steps} must be an integer >= 0 (training forwards of "
                              f"shared-head warm-up)")
        if shared_estimator not in SHARED_ESTIMATORS:
            raise ConfigError(f"shared_estimator '{shared_estimator}' is unknown; allowed: {', '.join(SHARED_ESTIMATORS)}")
        self.impl = impl
        if impl in ("sparse", "triton") and self.kernel_name not in SPARSE_KERNELS:
            raise ConfigError(f"MoH impl '{impl}' supports kernel(s) {', '.join(SPARSE_KERNELS)}, not "
                              f"'{self.kernel_name}'; use impl=auto or impl=masked")
        if impl == "triton" and self.attn_drop > 0:
            raise ConfigError(f"MoH impl 'triton' has no attention dropout (attn_drop={self.attn_drop}); "
                              "use impl=sparse or impl=auto")
        self.shared_heads, self.topk = resolve_moh_heads(self.num_heads, shared_heads, topk, activation_ratio)
        # learning which heads are shared needs both sets non-empty; other layers stay standard
        self.learned_shared = learned and self.shared_heads > 0 and self.topk > 0
        self.learn_shared_steps, self.shared_estimator = int(learn_shared_steps), shared_estimator
        routed = self.num_heads - self.shared_heads
        if self.learned_shared:
            self.init_learned_shared(dim)
        elif self.topk > 0:
            self.wg = nn.Linear(dim, routed, bias=False)
            if self.shared_heads > 0:
                self.wg_0 = nn.Linear(dim, 2, bias=False)
        if self.shared_heads > 1 and not self.learned_shared:
            self.wg_1 = nn.Linear(dim, self.shared_heads, bias=False)
        self.init_routing_state()

    # --- learned shared heads ------------------------------------------------------------------
    def init_learned_shared(self, dim: int) -> None:
        """Routers over all h heads, the per-head score and the partition buffers (learned mode)."""
        h, h_s = self.num_heads, self.shared_heads
        self.wg = nn.Linear(dim, h, bias=False)  # routed logits; the shared heads' rows are not read
        self.wg_0 = nn.Linear(dim, 2, bias=False)
        if h_s > 1:
            self.wg_1 = nn.Linear(dim, h, bias=False)  # shared-gate logits; the routed heads' rows are not read
        self.shared_score = nn.Parameter(torch.zeros(h))
        self.partition_order: Optional[Tensor] = None  # of the last route(): shared heads first
        self.partition_frozen: Optional[Tensor] = None  # whether the last route() ran on a frozen partition
        self.register_buffer("shared_mask", top_mask(self.shared_score.detach(), h_s))
        self.register_buffer("shared_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("shared_frozen", torch.tensor(self.learn_shared_steps == 0))

    def shared_partition(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """This forward's shared-head mask ``[h]`` (bool), the frozen flag before it, and (training
        during warm-up only) the soft relaxation ``h_s * softmax(scores)`` [h] for the estimator.
        A training forward also advances the warm-up counter and freezes the partition at its end."""
        h_s, scores = self.shared_heads, self.shared_score
        frozen = self.shared_frozen.clone()
        soft = None
        with torch.no_grad():
            clean = top_mask(scores.detach(), h_s)
        if self.training:
            perturbed = scores
            if self.shared_estimator == "gumbel":
                uniform = torch.rand_like(scores.detach()).clamp_(1e-20, 1.0)
                perturbed = scores - torch.log(-torch.log(uniform)).clamp_min(-1e4)  # + Gumbel(0, 1)
            soft = perturbed.float().softmax(dim=-1) * h_s
            with torch.no_grad():
                chosen = top_mask(perturbed.detach(), h_s) if perturbed is not scores else clean
                mask = torch.where(frozen, self.shared_mask, chosen)
                self.shared_mask.copy_(torch.where(frozen, self.shared_mask, clean))
                self.shared_seen.add_((~frozen).long())
                self.shared_frozen.logical_or_(self.shared_seen >= self.learn_shared_steps)
        else:
            mask = torch.where(frozen, self.shared_mask, clean)
        return mask, frozen, soft

    def route_learned(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`route` on the learned partition: the official gates computed over the heads the
        mask shares and the heads it routes, scattered back to head order, plus (training, warm-up)
        the straight-through term that carries a gradient to ``shared_score``."""
        h_s, k = self.shared_heads, self.topk
        mask, frozen, soft = self.shared_partition()
        order = mask.to(torch.int32).argsort(descending=True, stable=True)  # shared heads first, each set ascending
        inverse = order.argsort()  # position of every head in that order
        self.partition_order, self.partition_frozen = order, frozen  # read by forward / execution_path
        shared_idx, routed_idx = order[:h_s], order[h_s:]
        mix = self.wg_0(x).softmax(dim=-1) * 2
        if h_s > 1:
            shared_logits = self.wg_1(x)
            shared = shared_logits.index_select(-1, shared_idx).softmax(dim=-1) * h_s
        else:
            shared = x.new_ones(*x.shape[:-1], h_s)
        probs = self.wg(x).index_select(-1, routed_idx).softmax(dim=-1)
        index, selected = topk_mask(probs.detach(), k)
        routed = renormalised_topk_gates(probs, selected, k)
        gates = torch.cat([shared * mix[..., :1], routed * mix[..., 1:]], dim=-1).index_select(-1, inverse)
        if soft is not None:
            with torch.no_grad():  # first-order change of each head's gate if it switched set
                if h_s > 1:  # a routed head joining the shared softmax: its share of it (bounded by h_s)
                    norm = shared_logits.index_select(-1, shared_idx).float().logsumexp(dim=-1, keepdim=True)
                    as_shared = torch.sigmoid(shared_logits.float() - norm) * h_s * mix[..., :1]
                else:
                    as_shared = mix[..., :1].float().expand(*gates.shape)
                delta = torch.where(mask, gates.float(), as_shared - gates.float())
            live = (~frozen).to(soft.dtype)  # no estimator once frozen (the scores stay in the graph)
            gates = gates + ((soft - soft.detach()) * live * delta).to(gates.dtype)
        active = torch.cat([torch.ones_like(shared), selected], dim=-1).index_select(-1, inverse)
        self.store_routing(active, probs, load_balance_loss(probs, selected) if self.training else None, gates=gates)
        self.routing_stats.update(shared_mask=mask.detach().clone(), shared_frozen=self.shared_frozen.detach().clone())
        return gates, index

    @property
    def active_heads(self) -> int:
        return self.shared_heads + self.topk

    def route(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """Per-token head gates ``[B, N, h]`` and the selected routed head indices ``[B, N, k]``
        (relative to the routed pool; ``None`` when nothing is routed). Stores loss and statistics."""
        if self.learned_shared:
            return self.route_learned(x)
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
        m = self
        if self.learned_shared:  # the sparse path wants the shared heads first: permute the heads
            m, gates = HeadPermutedView(self, self.partition_order), gates.index_select(-1, self.partition_order)
        if impl == "triton":
            from .triton_moh import triton_routed_attention  # imports triton only when asked for
            return sparse_moh_forward(m, x, gates, index, triton_routed_attention())
        return sparse_moh_forward(m, x, gates, index)

    def execution_path(self, x: Tensor) -> str:
        """The path this call runs: ``masked``, ``sparse`` or ``triton`` (resolves ``auto``)."""
        path = self._requested_path(x)
        if path != "masked" and self.learned_shared and self.training and not bool(
                self.shared_frozen if self.partition_frozen is None else self.partition_frozen):
            # warm-up: the estimator needs every head's output for every token (what would a token gain
            # from a head it did not select), which only the masked path computes. (One host sync; the
            # sparse path makes one anyway.)
            return "masked"
        return path

    def _requested_path(self, x: Tensor) -> str:
        if self.topk == 0:  # dense-weighted layer: nothing to skip, masked is the exact computation
            return "masked"
        if self.impl != "auto":
            return self.impl
        if self.kernel_name not in SPARSE_KERNELS:
            return "masked"
        return choose_impl(x.device.type, x.shape[1], self.dim, self.num_heads, self.head_dim, self.shared_heads,
                           self.topk)

    def extra_repr(self) -> str:
        learned = (f" (learned: {self.shared_estimator}, {self.learn_shared_steps} steps)"
                   if self.learned_shared else "")
        return (f"{super().extra_repr()}, shared_heads={self.shared_heads}{learned}, topk={self.topk}, "
                f"active={self.active_heads}/{self.num_heads}, impl={self.impl}")


def top_mask(scores: Tensor, count: int) -> Tensor:
    """``[h]`` bool mask of the ``count`` largest scores; ties go to the lower head index."""
    rank = scores.argsort(descending=True, stable=True).argsort()  # out of place: traceable (fvcore)
    return rank < count
