"""Mixture-of-Head attention (MoH, Jin et al., ICML 2025).

Multi-head attention is a sum over heads, ``sum_i H_i W_O^i``; MoH weights that sum per token, ``sum_i g_i H_i W_O^i``,
with ``g_i = 0`` for heads the token did not select. Heads ``0..h_s-1`` are shared (always on); each token picks
``topk`` of the remaining ``h - h_s`` routed heads.

Gates, as in the official code (parameter names ``wg``, ``wg_0``, ``wg_1`` match its checkpoints):

* routed: ``p = softmax(wg x)``; keep the top-k, renormalise them to sum 1, times ``topk``;
* shared: ``softmax(wg_1 x) * h_s`` (``1`` when ``h_s == 1``);
* two-stage mix: ``(a1, a2) = 2 * softmax(wg_0 x)`` scales shared and routed gates;
* ``topk == 0`` (every head shared) is a dense layer with learned per-token head weights.

The gates multiply each head's output before the output projection. Training adds the load-balance loss ``E * sum_i
me_i ce_i`` per routed layer, handed to the caller's recorder (:func:`~moh_vision.attention.recorder.record_routing`).
The formulas and their fused kernel (routing, loss and gated merge in one operator each way) live in
:mod:`moh_vision.ops.routing`; ``kernels.routing`` picks.

Learned shared heads (``shared_heads="learned"``, not in the paper; its reviewers asked for it)
---------------------------------------------------------------------------------------------
Each layer learns WHICH ``h_s`` heads are shared (``h_s`` and ``topk`` still come from ``activation_ratio``):
a zero-initialised per-head ``shared_score`` (the partition starts as the official first ``h_s`` heads), routers
over all ``h`` heads (``wg`` and ``wg_1`` read only the routed / shared heads' rows) and the buffers
``shared_mask`` (the partition in force), ``shared_seen`` (optimizer steps of warm-up) and ``shared_frozen``.
During the first ``learn_shared_steps`` optimizer steps the forward uses the hard partition
``top-h_s(shared_score)`` (``"gumbel"``: of the score plus Gumbel noise) with exactly the official gates on it;
backward is straight-through: head i's gate gets ``+ (s_i - stopgrad(s_i)) * stopgrad(G_shared_i - G_routed_i)``,
with ``s = h_s * softmax(score)`` and ``G_shared_i - G_routed_i`` the change of its gate if it switched set. Then
(:meth:`MoH.after_optimizer_step`) ``top-h_s(shared_score)`` is frozen into ``shared_mask``. Every token always uses
``h_s + topk`` heads; a frozen learned layer computes what an official layer with its heads permuted computes
(``tests/test_learned_shared_heads.py``). Learning applies only where both sets are non-empty."""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from moh_vision import ops
from moh_vision.errors import ConfigError
from moh_vision.ops.routing import Routing, load_balance_loss, renormalised_topk_gates, topk_mask
from .registry import register_attention
from .routing import RoutedMixin, SharedPlusTopK, resolve_moh_heads

Tensor = torch.Tensor
# torch.fx (any tracer) records the top-k renormalisation as one call: it reads its dtype's epsilon, which a traced
# proxy does not carry (fx.wrap patches the name in the module that calls it)
torch.fx.wrap("renormalised_topk_gates")

SHARED_ESTIMATORS = ("ste", "gumbel")  # straight-through top-h_s; the same on Gumbel-perturbed scores
LEARNED = "learned"


class Route(NamedTuple):
    """What :meth:`MoH.route` decided for one forward (returned, never stored on the module)."""

    gates: Tensor                    # [B, N, h] per-token head gates
    index: Optional[Tensor]          # [B, N, k] selected routed heads (relative to the routed pool); None: k == 0


@register_attention("moh")
class MoH(SharedPlusTopK, RoutedMixin):
    """Mixin: MoH head routing over any form. Build with ``build_attention("moh", ...)``.

    Args:
        shared_heads: always-active heads (the first ``shared_heads`` head indices); ``"learned"``: each layer learns
            which heads are shared (count from ``activation_ratio``; see the module docstring).
        topk: routed heads each token selects (the official ``routed_head``). Explicit ``shared_heads`` + ``topk`` win
            over ``activation_ratio``.
        activation_ratio: fraction of heads a token uses, used when ``topk`` is not given (None: 0.75); see
            :func:`~moh_vision.attention.routing.resolve_moh_heads` for the policy.
        learn_shared_steps: with ``shared_heads="learned"``: optimizer steps of warm-up before the shared heads are
            frozen (0: frozen at once, on the first ``h_s`` heads). Ignored otherwise.
        shared_estimator: with ``shared_heads="learned"``: ``"ste"`` (straight-through top-h_s of the scores) or
            ``"gumbel"`` (the same on Gumbel-perturbed scores).
    """

    option_ranges = {"shared_heads": "0..num_heads, a per-layer list, null (the ratio policy) or 'learned'",
                     "topk": "0..num_heads - shared_heads, or a per-layer list", "activation_ratio": "(0, 1]",
                     "learn_shared_steps": ">= 0", "shared_estimator": " | ".join(SHARED_ESTIMATORS)}
    aux_reduction = "mean"  # official: 0.01 x mean of the load-balance losses over routed layers
    router_names = ("wg", "wg_0", "wg_1")  # the routed softmax, the shared/routed mix, the shared heads' softmax
    variant_parameters = (*router_names, "shared_score")
    flops_roles = {"wg": "fixed", "wg_0": "fixed", "wg_1": "fixed"}

    def __init__(self, dim: int, num_heads: int, *, shared_heads: Union[int, str, None] = None,
                 topk: Optional[int] = None, activation_ratio: Optional[float] = None, learn_shared_steps: int = 500,
                 shared_estimator: str = "ste", **form_options):
        super().__init__(dim, num_heads, **form_options)
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
            raise ConfigError(f"learn_shared_steps={learn_shared_steps} must be an integer >= 0 (optimizer steps of "
                              f"shared-head warm-up)")
        if shared_estimator not in SHARED_ESTIMATORS:
            raise ConfigError(f"shared_estimator '{shared_estimator}' is unknown; allowed: {', '.join(SHARED_ESTIMATORS)}")
        if topk is not None:  # explicit counts win over the ratio policy
            activation_ratio = None
        self.shared_heads, self.topk = resolve_moh_heads(self.num_heads, shared_heads, topk, activation_ratio)
        # learning which heads are shared needs both sets non-empty; other layers stay standard
        self.learned_shared = learned and self.shared_heads > 0 and self.topk > 0
        self.learn_shared_steps, self.shared_estimator = int(learn_shared_steps), shared_estimator
        h, h_s = self.num_heads, self.shared_heads
        if self.topk > 0:
            self.wg = nn.Linear(dim, h if self.learned_shared else h - h_s, bias=False)
            if h_s > 0:
                self.wg_0 = nn.Linear(dim, 2, bias=False)
        if h_s > 1:
            self.wg_1 = nn.Linear(dim, h if self.learned_shared else h_s, bias=False)
        if self.learned_shared:
            self.shared_score = nn.Parameter(torch.zeros(h))
            self.register_buffer("shared_mask", top_mask(self.shared_score.detach(), h_s))
            self.register_buffer("shared_seen", torch.zeros((), dtype=torch.long))
            self.register_buffer("shared_frozen", torch.tensor(self.learn_shared_steps == 0))

    # --- the variant contract ----------------------------------------------------------------------
    def dense_start(self, router_std: float, generator: torch.Generator):
        """Routers that give every active head gate 1, so a layer whose heads are all active starts as the dense layer:
        ``wg_0`` and ``wg_1`` zero (``2 * softmax(0) = (1, 1)``, ``softmax(0) * h_s = 1``); ``wg`` zero where top-k
        takes the whole routed pool (renormalised uniform top-k gives 1), else ``N(0, router_std^2)`` so each token
        picks its heads from its own scores (an all-zero router would give every token the same heads by tie-breaking,
        and the unchosen heads would get identical updates and stay tied). Learned shared heads start from the official
        partition."""
        start = {}
        for name, linear in self.routers():
            w = torch.zeros(linear.weight.shape)
            drops_heads = name == "wg" and self.topk < self.num_heads - self.shared_heads
            if drops_heads and router_std > 0:
                w.normal_(0.0, router_std, generator=generator)
            start[f"{name}.weight"] = w.to(linear.weight.dtype)
        if self.learned_shared:
            start["shared_score"] = torch.zeros_like(self.shared_score.detach(), device="cpu")
        return start

    def after_optimizer_step(self) -> None:
        """Learned shared heads: count the step; after ``learn_shared_steps`` freeze ``top-h_s(shared_score)``."""
        if not self.learned_shared:
            return
        with torch.no_grad():  # on the device: the training step never waits for the host
            live = ~self.shared_frozen
            self.shared_seen.add_(live.long())
            self.shared_mask.copy_(torch.where(live, top_mask(self.shared_score.detach(), self.shared_heads),
                                               self.shared_mask))
            self.shared_frozen.copy_(self.shared_frozen | (self.shared_seen >= self.learn_shared_steps))

    # --- routing ---------------------------------------------------------------------------------
    def routers(self) -> Tuple[Tuple[str, nn.Linear], ...]:
        """The layer's router projections that exist (``wg``, ``wg_0``, ``wg_1``), in that order."""
        return tuple((name, getattr(self, name)) for name in self.router_names if hasattr(self, name))

    def router_logits(self, x: Tensor) -> Tensor:
        """The routers' logits side by side, ``[..., wg | wg_0 | wg_1]`` (nothing routed and one head: no column)."""
        routers = self.routers()
        if not routers:
            return x[..., :0]
        return torch.cat([router(x) for _, router in routers], dim=-1) if len(routers) > 1 else routers[0][1](x)

    def route_args(self) -> Tuple[int, int, int, bool]:
        """The routing's layout: routed and shared heads, top-k, and whether to compute the loss."""
        return self.num_heads - self.shared_heads, self.shared_heads, self.topk, self.wants_aux_loss()

    def route(self, x: Tensor) -> Route:
        """Per-token head gates ``[B, N, h]`` and the selected routed heads ``[B, N, k]`` (relative to the routed
        pool; ``None`` when nothing is routed), by the formulas. Hands the aux loss and statistics to the open
        recorder, if any."""
        if self.learned_shared:
            return self.route_learned(x)
        routing = ops.route(self.router_logits(x), *self.route_args())
        self.record(routing)
        return Route(routing.gates, routing.index)

    def record(self, routing: Routing) -> None:
        """Hand a fixed-partition layer's routing to the open recorder, if any."""
        if self.recording():
            self.record_routing(routing.mask, routing.probs, routing.loss, gates=routing.gates,
                                shared_prefix=self.shared_heads)

    def forward(self, x: Tensor) -> Tensor:
        heads = self.heads(x)
        if self.learned_shared:
            return self.output(heads, self.route_learned(x).gates)
        merged, routing = ops.route_merge(heads, self.router_logits(x), *self.route_args(), kernel=self.kernels.routing)
        self.record(routing)
        return self.project_merged(merged)

    # --- learned shared heads ------------------------------------------------------------------
    def shared_partition(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """This forward's shared-head mask ``[h]`` (bool), the frozen flag, and (training during warm-up only) the soft
        relaxation ``h_s * softmax(scores)`` [h] for the estimator. Changes nothing: the warm-up counts optimizer
        steps (:meth:`after_optimizer_step`)."""
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
        else:
            mask = torch.where(frozen, self.shared_mask, clean)
        return mask, frozen, soft

    def route_learned(self, x: Tensor) -> Route:
        """:meth:`route` on the learned partition: the official gates over the heads the mask shares and those it
        routes, scattered back to head order, plus (training, warm-up) the straight-through term to ``shared_score``."""
        h_s, k = self.shared_heads, self.topk
        mask, frozen, soft = self.shared_partition()
        order = mask.to(torch.int32).argsort(descending=True, stable=True)  # shared heads first, each set ascending
        inverse = order.argsort()  # position of every head in that order
        shared_idx, routed_idx = order[:h_s], order[h_s:]
        logits: Dict[str, Tensor] = {name: router(x) for name, router in self.routers()}
        mix = logits["wg_0"].softmax(dim=-1) * 2
        if h_s > 1:
            shared_logits = logits["wg_1"]
            shared = shared_logits.index_select(-1, shared_idx).softmax(dim=-1) * h_s
        else:
            shared = x.new_ones(x.shape[:-1] + (h_s,))  # a size, not *args: torch.fx traces it
        probs = logits["wg"].index_select(-1, routed_idx).softmax(dim=-1)
        index, selected = topk_mask(probs.detach(), k)
        routed = renormalised_topk_gates(probs, selected, k)
        gates = torch.cat([shared * mix[..., :1], routed * mix[..., 1:]], dim=-1).index_select(-1, inverse)
        if soft is not None:
            with torch.no_grad():  # first-order change of each head's gate if it switched set
                if h_s > 1:  # a routed head joining the shared softmax: its share of it (bounded by h_s)
                    norm = shared_logits.index_select(-1, shared_idx).float().logsumexp(dim=-1, keepdim=True)
                    as_shared = torch.sigmoid(shared_logits.float() - norm) * h_s * mix[..., :1]
                else:
                    as_shared = mix[..., :1].float().expand(gates.shape)  # a size, not *args: torch.fx traces it
                delta = torch.where(mask, gates.float(), as_shared - gates.float())
            live = (~frozen).to(soft.dtype)  # no estimator once frozen (the scores stay in the graph)
            gates = gates + ((soft - soft.detach()) * live * delta).to(gates.dtype)
        loss = load_balance_loss(probs, selected) if self.wants_aux_loss() else None
        if self.recording():
            active = torch.cat([torch.ones_like(shared), selected], dim=-1).index_select(-1, inverse)
            self.record_routing(active, probs, loss, gates=gates, shared_mask=mask.detach().clone(),
                                shared_frozen=frozen.detach().clone())
        return Route(gates, index)

    def extra_repr(self) -> str:
        learned = (f" (learned: {self.shared_estimator}, {self.learn_shared_steps} steps)"
                   if self.learned_shared else "")
        return (f"{super().extra_repr()}, shared_heads={self.shared_heads}{learned}, topk={self.topk}, "
                f"active={self.active_heads()}/{self.num_heads}")


def top_mask(scores: Tensor, count: int) -> Tensor:
    """``[h]`` bool mask of the ``count`` largest scores; ties go to the lower head index."""
    rank = scores.argsort(descending=True, stable=True).argsort()  # out of place: traceable (fvcore)
    return rank < count
