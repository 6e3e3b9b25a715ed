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
load-balance loss ``E * sum_i me_i ce_i`` per routed layer, handed to the caller's recorder
(:func:`~moh_vision.attention.recorder.record_routing`). Eager calls compute gates, loss and their gradients
in one kernel each way (:mod:`~moh_vision.attention.fused_routing`: C++ on the CPU, Triton on CUDA); tracers,
exporters, ``torch.compile`` and ``torch.func`` run :func:`formula_route`, the same formulas written out with ATen
operators. On the masked path that kernel also applies the gates where the heads are merged, and over the ``sdpa``
kernel the routers' logits come from the ``qkv`` GEMM (their weights share its storage,
:mod:`~moh_vision.attention.fused_projection`; the state-dict keys stay the official ones).

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
  ``shared_seen`` (optimizer steps of warm-up so far), ``shared_frozen`` (bool);
* warm-up, the first ``learn_shared_steps`` optimizer steps: the forward uses the hard
  partition ``top-h_s(shared_score)`` (``"gumbel"``: of ``shared_score + Gumbel noise``, a new
  sample per forward) with exactly the official gates on it; backward is straight-through: the
  gate of head i gets ``+ (s_i - stopgrad(s_i)) * stopgrad(G_shared_i - G_routed_i)``, where
  ``s = h_s * softmax(score)`` is the soft relaxation (zero in the forward pass) and
  ``G_shared_i - G_routed_i`` is the change of head i's gate if it switched set: a shared head
  would lose its shared gate (it would be routed, and most tokens would not select it); a routed
  head would get ``a1 * h_s * exp(u_i) / (exp(u_i) + sum_{shared j} exp(u_j))`` (its share of the
  shared softmax, ``u = wg_1 x``; ``a1`` when ``h_s == 1``) instead of its routed gate;
* after the ``learn_shared_steps``-th optimizer step (the trainer calls
  :meth:`MoH.after_optimizer_step`; gradient accumulation and checkpointing do not change the count)
  ``top-h_s(shared_score)`` (noise-free) is frozen into ``shared_mask``;
  from then on the scores no longer matter (they stay in the graph with a zero gradient, so DDP
  sees every parameter used). No forward changes a buffer; eval forwards during warm-up use
  ``top-h_s(shared_score)``. A resumed run continues from the buffers.

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

import functools
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from moh_vision.errors import ConfigError
from .fused_projection import pack_rows, project_with_routers
from .fused_routing import Routing, fused_route, fused_route_merge, fused_routing_available
from .tracing import active_tracer, freezes_dispatch, plain_module, refuse_data_dependent, traces_by_module
from .registry import register_attention
from .routing import (RoutedMixin, SharedPlusTopK, load_balance_loss, renormalised_topk_gates, resolve_moh_heads, topk_mask)
from .sparse import choose_impl, kernels_supporting, sparse_forward, sparse_support  # noqa: F401 (choose_impl)

Tensor = torch.Tensor
# torch.fx (any tracer) records the top-k renormalisation as one call: it reads its dtype's epsilon, which
# a traced proxy does not carry
torch.fx.wrap("renormalised_topk_gates")

MOH_IMPLS = ("auto", "masked", "sparse")
SHARED_ESTIMATORS = ("ste", "gumbel")  # straight-through top-h_s; the same on Gumbel-perturbed scores
LEARNED = "learned"


class Route(NamedTuple):
    """What :meth:`MoH.route` decided for one forward (returned, never stored on the module)."""

    gates: Tensor                    # [B, N, h] per-token head gates
    index: Optional[Tensor]          # [B, N, k] selected routed heads (relative to the routed pool); None: k == 0
    order: Optional[Tensor] = None   # learned shared heads: head order "shared first" ([h])
    frozen: Optional[bool] = None    # learned shared heads: whether the partition was frozen


@register_attention("moh")
class MoH(SharedPlusTopK, RoutedMixin):
    """Mixin: MoH head routing over any kernel. Build with ``build_attention("moh", ...)``.

    Args:
        shared_heads: always-active heads (the first ``shared_heads`` head indices); ``"learned"``:
            each layer learns which heads are shared (count from ``activation_ratio``; see the
            module docstring).
        topk: routed heads each token selects (the official ``routed_head``). Explicit
            ``shared_heads`` + ``topk`` win over ``activation_ratio``.
        activation_ratio: fraction of heads a token uses, used when ``topk`` is not given (None:
            0.75); see :func:`~moh_vision.attention.routing.resolve_moh_heads` for the policy.
        impl: how the heads are executed; every choice gives the same outputs and gradients.
            ``"masked"`` computes every head and zeroes unselected ones (the official reference,
            any kernel); ``"sparse"`` computes queries, attention and output projection only for
            the selected (token, head) pairs (pure PyTorch, for kernels that declare a sparse
            path: ``sdpa`` and TransNeXt's two, see :mod:`~moh_vision.attention.sparse`); ``"auto"`` picks
            per call from the kernel's measured rule (``sdpa``: :func:`choose_impl`; TransNeXt: its own table), and runs
            masked under ``torch.compile``, ``torch.jit.trace``, the ONNX exporters, ``torch.export``,
            ``torch.fx`` and ``torch.func`` transforms (:mod:`~moh_vision.attention.tracing`); an explicit
            ``sparse`` refuses under those that would freeze its dispatch.
        learn_shared_steps: with ``shared_heads="learned"``: optimizer steps of warm-up before the
            shared heads are frozen (0: frozen at once, on the initial partition = the first ``h_s``
            heads). Ignored otherwise.
        shared_estimator: with ``shared_heads="learned"``: ``"ste"`` (straight-through top-h_s of
            the scores) or ``"gumbel"`` (straight-through top-h_s of Gumbel-perturbed scores).
    """

    option_ranges = {"shared_heads": "0..num_heads, a per-layer list, null (the ratio policy) or 'learned'",
                     "topk": "0..num_heads - shared_heads, or a per-layer list", "activation_ratio": "(0, 1]",
                     "impl": " | ".join(MOH_IMPLS), "learn_shared_steps": ">= 0",
                     "shared_estimator": " | ".join(SHARED_ESTIMATORS)}
    aux_reduction = "mean"  # official: 0.01 x mean of the load-balance losses over routed layers
    router_names = ("wg", "wg_0", "wg_1")  # the routed softmax, the shared/routed mix, the shared heads' softmax
    variant_parameters = (*router_names, "shared_score")
    flops_roles = {"wg": "fixed", "wg_0": "fixed", "wg_1": "fixed"}
    reference_impl = "masked"

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
            raise ConfigError(f"learn_shared_steps={learn_shared_steps} must be an integer >= 0 (optimizer steps of "
                              f"shared-head warm-up)")
        if shared_estimator not in SHARED_ESTIMATORS:
            raise ConfigError(f"shared_estimator '{shared_estimator}' is unknown; allowed: {', '.join(SHARED_ESTIMATORS)}")
        self.impl = impl
        if impl == "sparse" and impl not in getattr(sparse_support(self), "impls", ()):
            supported = ", ".join(kernels_supporting(impl))
            raise ConfigError(f"MoH impl '{impl}' supports kernel(s) {supported}, not "
                              f"'{self.kernel_name}'; use impl=auto or impl=masked")
        if topk is not None:  # explicit counts win over the ratio policy
            activation_ratio = None
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
        self.pack_projection()
        self.register_load_state_dict_post_hook(_pack_after_load)

    # --- the routers inside the qkv projection -----------------------------------------------------
    def pack_projection(self) -> None:
        """Lay ``qkv``'s and the routers' weights out as one GEMM's
        (:func:`~moh_vision.attention.fused_projection.pack_rows`) where :meth:`project_with_routers` can use it:
        a fixed-partition layer with routers over a kernel that computes its heads from ``qkv`` alone
        (:func:`projects_qkv_alone`) and a plain ``qkv``. Values, parameter objects and state-dict keys unchanged."""
        qkv = self._modules.get("qkv")
        routers = [r for _, r in self.routers()]
        if routers and not self.learned_shared and projects_qkv_alone(type(self)) and type(qkv) is nn.Linear:
            pack_rows(qkv, routers)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(), .double(), .cuda(): every parameter gets a storage of its own
        self.pack_projection()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)  # copy.deepcopy clones every parameter apart (pickle keeps storages shared)
        self.pack_projection()

    def project_with_routers(self, x: Tensor, weights: List[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
        """``qkv(x)`` and the stacked routers' logits of ``x`` from ONE GEMM over the packed weights
        (:mod:`~moh_vision.attention.fused_projection`), or None. ``weights``: :meth:`fused_router_weights` (eager,
        untraced, plain routers). Also needs a plain ``qkv`` (an ``nn.Linear`` without hooks: a hook must fire), a
        kernel that computes its heads from ``qkv`` alone and the packed layout."""
        qkv = self._modules.get("qkv")
        if not projects_qkv_alone(type(self)) or not plain_module(qkv, nn.Linear):
            return None
        return project_with_routers(x, qkv, weights)

    # --- the variant contract ----------------------------------------------------------------------
    def dense_start(self, router_std: float, generator: torch.Generator):
        """Routers that give every active head gate 1, so a layer whose heads are all active starts as
        the dense layer: ``wg_0`` and ``wg_1`` zero (``2 * softmax(0) = (1, 1)``, ``softmax(0) * h_s =
        1``); ``wg`` zero where top-k takes the whole routed pool (renormalised uniform top-k gives 1),
        else ``N(0, router_std^2)`` so each token picks its heads from its own scores (an all-zero
        router would give every token the same heads by tie-breaking, and the unchosen heads would get
        identical updates and stay tied). Learned shared heads start from the official partition."""
        start = {}
        for router in self.router_names:
            linear = getattr(self, router, None)
            if not isinstance(linear, nn.Linear):
                continue
            w = torch.zeros(linear.weight.shape)
            drops_heads = router == "wg" and self.topk < self.num_heads - self.shared_heads
            if drops_heads and router_std > 0:
                w.normal_(0.0, router_std, generator=generator)
            start[f"{router}.weight"] = w.to(linear.weight.dtype)
        if self.learned_shared:
            start["shared_score"] = torch.zeros_like(self.shared_score.detach(), device="cpu")
        return start

    def after_optimizer_step(self) -> None:
        """Learned shared heads: count the step; after ``learn_shared_steps`` of them freeze
        ``top-h_s(shared_score)`` (noise-free) into ``shared_mask``."""
        if not self.learned_shared or bool(self.shared_frozen):
            return
        with torch.no_grad():
            self.shared_seen.add_(1)
            self.shared_mask.copy_(top_mask(self.shared_score.detach(), self.shared_heads))
            self.shared_frozen.fill_(bool(self.shared_seen >= self.learn_shared_steps))

    # --- learned shared heads ------------------------------------------------------------------
    def init_learned_shared(self, dim: int) -> None:
        """Routers over all h heads, the per-head score and the partition buffers (learned mode)."""
        h, h_s = self.num_heads, self.shared_heads
        self.wg = nn.Linear(dim, h, bias=False)  # routed logits; the shared heads' rows are not read
        self.wg_0 = nn.Linear(dim, 2, bias=False)
        if h_s > 1:
            self.wg_1 = nn.Linear(dim, h, bias=False)  # shared-gate logits; the routed heads' rows are not read
        self.shared_score = nn.Parameter(torch.zeros(h))
        self.register_buffer("shared_mask", top_mask(self.shared_score.detach(), h_s))
        self.register_buffer("shared_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("shared_frozen", torch.tensor(self.learn_shared_steps == 0))

    def shared_partition(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """This forward's shared-head mask ``[h]`` (bool), the frozen flag, and (training during
        warm-up only) the soft relaxation ``h_s * softmax(scores)`` [h] for the estimator. Changes
        nothing: the warm-up counts optimizer steps (:meth:`after_optimizer_step`)."""
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
        """:meth:`route` on the learned partition: the official gates computed over the heads the
        mask shares and the heads it routes, scattered back to head order, plus (training, warm-up)
        the straight-through term that carries a gradient to ``shared_score``."""
        h_s, k = self.shared_heads, self.topk
        mask, frozen, soft = self.shared_partition()
        order = mask.to(torch.int32).argsort(descending=True, stable=True)  # shared heads first, each set ascending
        inverse = order.argsort()  # position of every head in that order
        shared_idx, routed_idx = order[:h_s], order[h_s:]
        logits = self.router_logits(x)
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
        return Route(gates, index, order, bool(frozen))

    # --- routing ---------------------------------------------------------------------------------
    def routers(self) -> Tuple[Tuple[str, nn.Linear], ...]:
        """The layer's router projections that exist (``wg``, ``wg_0``, ``wg_1``), in that order."""
        # eagerly the submodule dict itself (Module.__getattr__ is a Python call per name, in every forward);
        # compiled, getattr, which every torch traces
        modules = None if torch.compiler.is_compiling() else self._modules
        found = []
        for name in self.router_names:  # a loop, not a generator with ":=": torch 2.11's compile cannot trace that
            router = getattr(self, name, None) if modules is None else modules.get(name)
            if isinstance(router, nn.Linear):
                found.append((name, router))
        return tuple(found)

    @staticmethod
    def plain_router(router: nn.Module, eager: bool = True) -> bool:
        """Whether ``router`` is a bias-free ``nn.Linear`` without hooks (a hook must still fire), so that its
        weight can be stacked with the others and run as one GEMM. ``eager``: read the parameter dict itself
        (``Module.__getattr__`` is a Python call per name, in every forward); compiled code uses the attribute."""
        bias = router._parameters.get("bias") if eager else router.bias
        return bias is None and plain_module(router, nn.Linear)

    @classmethod
    def plain_routers(cls, routers: Tuple[Tuple[str, nn.Linear], ...]) -> bool:
        """Whether every one of ``routers`` (:meth:`routers`) is :meth:`plain_router`."""
        eager = not torch.compiler.is_compiling()
        for _, r in routers:  # a loop, not all(<generator>): no generator object per call
            if not cls.plain_router(r, eager):
                return False
        return True

    @staticmethod
    def stacked_router_weight(weights: List[Tensor]) -> Tensor:
        """The router weights ``weights`` (in the order of :meth:`routers`) stacked, ``[L, C]``."""
        return weights[0] if len(weights) == 1 else torch.cat(weights)

    def router_logits(self, x: Tensor) -> Dict[str, Tensor]:
        """Every router's logits, from ONE matmul over ``x`` where the routers are plain (see
        :meth:`plain_routers`) and no trace is running (the FLOP counter's trace attributes work by child
        module). The routers read the same input, and GEMMs a few columns wide would each make a pass over
        ``x``, forward and backward: fused, the three routers of a 384-wide layer cost ~1.2 ms instead of
        ~4.4 ms fwd+bwd at 1,960 tokens (1 CPU thread). Where the routing runs its kernels on the masked path,
        the routers go into the ``qkv`` GEMM as well (:meth:`project_with_routers`): one GEMM, no weight stacked
        per call."""
        routers = self.routers()
        if len(routers) < 2 or not self.plain_routers(routers) or traces_by_module(x):
            return {name: r(x) for name, r in routers}
        fused = F.linear(x, self.stacked_router_weight([r.weight for _, r in routers]))
        return dict(zip((name for name, _ in routers), fused.split([r.out_features for _, r in routers], dim=-1)))

    def fused_router_weights(self, x: Tensor) -> Optional[List[Tensor]]:
        """The weights of the routers that exist (``wg``, ``wg_0``, ``wg_1``, in that order) when :meth:`route`
        runs the compiled kernels on ``x`` (:mod:`~moh_vision.attention.fused_routing`: the same gates, loss and
        gradients in one operator each way), else None: eager calls with plain routers (bias-free
        ``nn.Linear`` without hooks), on CPU tensors of the routers' dtype, on CUDA tensors when Triton is
        installed (routed layers), in and out of autocast alike (:func:`fused_route` reads autocast's
        low-precision logits and gives float32 gates, as autocast's float32 softmax does on CUDA);
        ``MOH_VISION_FUSED_ROUTING=0`` turns both off. Tracers, exporters, ``torch.compile`` and ``torch.func`` transforms see the formulas written out."""
        # every forward asks this, and on a small input its host time is a visible part of the layer's call
        # (docs/performance.md): the cheap questions first, the module's own dicts read directly
        if torch.compiler.is_compiling() or isinstance(x, torch.fx.Proxy) or self.learned_shared:
            return None
        modules, weights = self._modules, []
        for name in self.router_names:
            router = modules.get(name)
            if router is None:
                continue
            if not self.plain_router(router):
                return None  # a hook must fire, a bias or another module computes something else
            weights.append(router._parameters["weight"])
        if not weights:  # one head: nothing to route
            return None
        if x.is_cpu:  # the C++ kernel: the routers' dtype (under autocast it reads the GEMM's bf16 logits)
            usable = fused_routing_available() and x.dtype == weights[0].dtype
        else:  # the Triton kernels
            usable = x.is_cuda and fused_routing_available("cuda", self.topk)
        return weights if usable and active_tracer(x) is None else None

    def uses_fused_routing(self, x: Tensor) -> bool:
        """Whether :meth:`route` runs the compiled kernels on ``x`` (:meth:`fused_router_weights`)."""
        return self.fused_router_weights(x) is not None

    def route(self, x: Tensor) -> Route:
        """Per-token head gates ``[B, N, h]`` and the selected routed head indices ``[B, N, k]``
        (relative to the routed pool; ``None`` when nothing is routed). Hands the aux loss and the
        statistics to the open recorder, if any."""
        if self.learned_shared:
            return self.route_learned(x)
        return self.route_fixed(x, self.fused_router_weights(x))

    def route_args(self) -> Tuple[int, int, int, bool]:
        """The routing kernels' and formulas' layout arguments: routed and shared heads, top-k, with the loss."""
        return self.num_heads - self.shared_heads, self.shared_heads, self.topk, self.wants_aux_loss()

    def route_fixed(self, x: Tensor, weights: Optional[List[Tensor]]) -> Route:
        """:meth:`route` of a layer whose shared heads are fixed; ``weights``: :meth:`fused_router_weights`."""
        if weights is not None:
            routing = fused_route(F.linear(x, self.stacked_router_weight(weights)), *self.route_args())
        else:
            routing = formula_route(self.router_logits(x), x, *self.route_args())
        self.record_fixed(routing)
        return Route(routing.gates, routing.index)

    def record_fixed(self, routing: Routing) -> None:
        """Hand a fixed-partition layer's routing to the open recorder, if any."""
        if self.recording():
            self.record_routing(routing.mask, routing.probs, routing.loss, gates=routing.gates,
                                shared_prefix=self.shared_heads)

    def merge_routed(self, x: Tensor, weights: List[Tensor]) -> Tensor:
        """The masked path where the routing runs its kernels (``weights``: :meth:`fused_router_weights`; C++ on the
        CPU, Triton on CUDA): the heads, then the routing and the gates applied where the heads are merged, one
        operator each way (:func:`~moh_vision.attention.fused_routing.fused_route_merge`; the gates are needed
        only there). Returns the gated merge ``[B, N, h * d]``."""
        projected = self.project_with_routers(x, weights)
        if projected is not None:  # qkv and the logits from one GEMM
            heads, logits = self.heads_from_qkv(x, projected[0]), projected[1]
        else:
            heads, logits = self.heads(x), F.linear(x, self.stacked_router_weight(weights))
        if heads.dtype != logits.dtype:  # the kernel gates heads of the logits' dtype
            routing = fused_route(logits, *self.route_args())
            merged = self.merge_heads(heads, routing.gates)
        else:
            merged, routing = fused_route_merge(heads, logits, *self.route_args())
        self.record_fixed(routing)
        return merged

    def forward(self, x: Tensor) -> Tensor:
        if self.learned_shared:
            route = self.route(x)
            impl = self.execution_path(x, route)
        else:  # the path does not depend on the routing
            impl, weights = self._requested_path(x), self.fused_router_weights(x)
            if impl == "masked" and weights is not None:  # the gates applied in the routing kernel's merge
                return self.project_merged(self.merge_routed(x, weights))
            route = self.route_fixed(x, weights)
        if impl == "masked":
            return self.output(self.heads(x), route.gates)
        # learned shared heads: the sparse drivers take the head order "shared heads first"
        order = route.order if self.learned_shared else None
        return sparse_forward(self, x, route.gates, route.index, order)

    def execution_path(self, x: Tensor, route: Optional[Route] = None) -> str:
        """The path this call runs: ``masked`` or ``sparse`` (resolves ``auto``)."""
        path = self._requested_path(x)
        if path != "masked" and self.learned_shared and self.training:
            frozen = bool(self.shared_frozen) if route is None or route.frozen is None else route.frozen
            if not frozen:
                # warm-up: the estimator needs every head's output for every token (what would a token gain
                # from a head it did not select), which only the masked path computes.
                return "masked"
        return path

    def _requested_path(self, x: Tensor) -> str:
        if self.topk == 0 or self.impl == "masked":  # dense-weighted layer: nothing to skip, masked is exact
            return "masked"
        tracer = active_tracer(x)
        if self.impl != "auto":
            # sparse's Functions support torch.func's grad
            if freezes_dispatch(tracer, func_grad=True):
                refuse_data_dependent("MoH", self.impl, tracer)
            return self.impl
        if tracer is not None:
            # the sparse path's per-head token lists have data-dependent sizes: a trace or export would freeze
            # one input's dispatch, vmap cannot batch it, torch.compile would break the graph around it. The
            # reference path is one graph everywhere (and the compiler fuses its routing ops)
            return "masked"
        support = sparse_support(self)
        if support is None or support.auto is None:  # no sparse path, or never measured faster than masked
            return "masked"
        return support.auto(self, x)  # the kernel's rule from its measurements (sdpa: choose_impl)

    def extra_repr(self) -> str:
        learned = (f" (learned: {self.shared_estimator}, {self.learn_shared_steps} steps)"
                   if self.learned_shared else "")
        return (f"{super().extra_repr()}, shared_heads={self.shared_heads}{learned}, topk={self.topk}, "
                f"active={self.active_heads()}/{self.num_heads}, impl={self.impl}")


def formula_route(logits: Dict[str, Tensor], x: Tensor, routed: int, shared: int, topk: int,
                  with_loss: bool) -> Routing:
    """MoH's gates written out with ATen operators, from each router's logits (:meth:`MoH.router_logits`):
    what tracers, exporters, ``torch.compile``, ``torch.func`` and CUDA without Triton run, and the reference the fused
    kernel is tested against. Nothing routed (``topk == 0``): ``mask`` empty, ``probs`` and ``index`` None."""
    if shared > 1:
        shared_gates = logits["wg_1"].softmax(dim=-1) * shared
    else:
        shared_gates = x.new_ones(x.shape[:-1] + (shared,))  # a size, not *args: torch.fx traces it
    if topk == 0:
        return Routing(shared_gates, None, shared_gates[..., :0], None, None)
    probs = logits["wg"].softmax(dim=-1)
    index, mask = topk_mask(probs.detach(), topk)
    routed_gates = renormalised_topk_gates(probs, mask, topk)
    if shared > 0:
        mix = logits["wg_0"].softmax(dim=-1) * 2
        gates = torch.cat([shared_gates * mix[..., :1], routed_gates * mix[..., 1:]], dim=-1)
    else:
        gates = routed_gates
    return Routing(gates, probs, mask, index, load_balance_loss(probs, mask) if with_loss else None)


def _pack_after_load(module: MoH, incompatible_keys) -> None:
    """``load_state_dict(assign=True)`` puts the loaded tensors in place of the parameters: pack them again."""
    module.pack_projection()


@functools.lru_cache(maxsize=None)  # a pure function of the class, asked on every forward
def projects_qkv_alone(cls: type) -> bool:
    """Whether a layer class computes its heads as ``heads_from_qkv(x, qkv(x))``: its kernel defines
    ``heads_from_qkv`` in the class that defines ``heads``, and nothing overrides ``project_qkv`` below it."""
    if cls.heads_from_qkv is None:
        return False
    owner = {name: next(c for c in cls.__mro__ if name in vars(c))
             for name in ("heads", "heads_from_qkv", "project_qkv")}
    return owner["heads"] is owner["heads_from_qkv"] and issubclass(owner["heads"], owner["project_qkv"])


def top_mask(scores: Tensor, count: int) -> Tensor:
    """``[h]`` bool mask of the ``count`` largest scores; ties go to the lower head index."""
    rank = scores.argsort(descending=True, stable=True).argsort()  # out of place: traceable (fvcore)
    return rank < count
