"""MoH's routing as one compiled CPU kernel forward and one backward.

Written out with ATen operators (:meth:`MoH.route <moh_vision.attention.moh.MoH.route>`), a layer's gates
take three softmaxes, a top-k, a scatter, the renormalisation, the mix, the load-balance loss and the
backward of each: about 30 operators forward and 70 backward on a few numbers per token, where the host's
per-operator cost is most of the time. ``csrc/moh_routing.cpp`` does all of it per token in one kernel each
way (``torch.ops.moh_routing.route`` / ``route_backward``, registered with ``torch.library``): from the
stacked routers' logits ``[..., L]`` it returns the gates ``[..., h]``, the routed softmax ``[..., R]``, the
0/1 selection ``[..., R]``, the selected heads ``[..., k]`` and (training) the load-balance loss; its backward
is the formulas' derivative written out. Under autocast it reads the router GEMM's low-precision logits as they
are and stores float32 gates, probabilities and selection (``float_out``), as autocast's float32 softmax gives
them to the formulas on CUDA and as the Triton kernels do. Equal to the formulas up to rounding
(``tests/test_fused_routing.py``: values, selections, the loss and every gradient).

On MoH's masked path the kernels also apply the gates where the heads are merged (:func:`fused_route_merge`;
``torch.ops.moh_routing.route_merge`` / ``route_merge_backward`` on the CPU, the same Triton kernels with their
merge switched on for CUDA): called after attention (the gates are needed only there), they route each token
and write its gated, merged head outputs in the same pass (the products ``merge_heads`` computes); the backward
gives the heads' gradient and the logits' from the merged output's in one pass too. So the gate multiply is
neither a pass over the heads nor an operator of its own, forward or backward.

Where it runs: eager calls on CPU tensors, in and out of autocast (:meth:`MoH.uses_fused_routing`), and on CUDA
tensors its Triton twin (:mod:`~moh_vision.attention.triton_routing`); tracers, exporters, ``torch.compile`` (whose own code
generation fuses the formulas) and ``torch.func`` see the formulas. The kernel is compiled on first use with
the C++ compiler torch's extensions use (``torch.utils.cpp_extension``: g++ and ninja, about 30 s, once per
machine: the build is cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). Without
a compiler, or with ``MOH_VISION_FUSED_ROUTING=0`` in the environment (which turns the Triton kernels off
too), MoH runs the formulas (same values) and says so once.

Ties: the kernels take the lower head among equal probabilities, as the formulas do
(:func:`~moh_vision.attention.routing.topk_mask`), so a zero router selects the same heads on every path.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from moh_vision.extensions import build, load_cpu_kernels

Tensor = torch.Tensor

SOURCE = Path(__file__).with_name("csrc") / "moh_routing.cpp"
ENV_SWITCH = "MOH_VISION_FUSED_ROUTING"
LOW_PRECISION = (torch.bfloat16, torch.float16)


def fused_routing_available(device_type: str = "cpu", topk: int = 1) -> bool:
    """Whether a layer routing ``topk`` heads per token on ``device_type`` runs the fused kernels: on the CPU,
    whether ``torch.ops.moh_routing`` is loaded (built on the first call; False, said once, if it cannot be);
    on CUDA, whether Triton is installed (:mod:`~moh_vision.attention.triton_routing`), the layer routes and
    ``MOH_VISION_FUSED_ROUTING=0`` does not turn the kernels off."""
    if device_type == "cuda":
        return topk > 0 and os.environ.get(ENV_SWITCH, "1") != "0" and _triton_present()
    if device_type != "cpu":
        return False
    return load_cpu_kernels("moh_routing", "route", SOURCE, ENV_SWITCH, "MoH's fused routing")


def _triton_present() -> bool:
    from .triton_moh import triton_available
    return triton_available()


def _build() -> bool:
    """Build (or find) the CPU kernel now: :func:`moh_vision.extensions.build` (``=triton``, CUDA's switch, leaves
    it on)."""
    return build("moh_routing", "route", SOURCE, ENV_SWITCH, "MoH's fused routing")


class Routing(NamedTuple):
    """MoH's routing of one forward: what :func:`fused_route` and the formulas
    (:func:`~moh_vision.attention.moh.formula_route`) return."""

    gates: Tensor                # [..., h]
    probs: Optional[Tensor]      # [..., R] routed softmax (topk == 0: None)
    mask: Tensor                 # [..., R] 0/1 selection (topk == 0: empty)
    index: Optional[Tensor]      # [..., k] selected routed heads, by decreasing probability (topk == 0: None)
    loss: Optional[Tensor]       # load-balance loss (float32 scalar) when asked for


class _FusedRoute(torch.autograd.Function):
    # forward(ctx, ...) rather than setup_context: Function.apply binds a setup_context Function's arguments
    # with inspect.signature, ~50 us a call (more than the kernel); this Function never runs under torch.func
    @staticmethod
    def forward(ctx, logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool, float_out: bool):
        out = torch.ops.moh_routing.route(logits, routed, shared, topk, with_loss, float_out)
        ctx.save_for_backward(logits, out[1], out[2])
        ctx.layout = (routed, shared, topk)
        ctx.mark_non_differentiable(out[1], out[2], out[3])
        ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient
        return out

    @staticmethod
    def backward(ctx, grad_gates, _probs, _mask, _index, grad_loss):
        logits, probs, mask = ctx.saved_tensors
        if grad_gates is None:  # only the loss was used
            grad_gates = probs.new_zeros(*logits.shape[:-1], sum(ctx.layout[:2]))  # the gates' dtype
        grad = torch.ops.moh_routing.route_backward(grad_gates, grad_loss, logits, probs, mask, *ctx.layout)
        return grad, None, None, None, None, None


class _FusedRouteMerge(torch.autograd.Function):
    # forward(ctx, ...), as _FusedRoute: eager CPU calls only
    @staticmethod
    def forward(ctx, heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool,
                float_out: bool):
        out = torch.ops.moh_routing.route_merge(heads, logits, routed, shared, topk, with_loss, float_out)
        ctx.save_for_backward(heads, logits, out[1], out[2], out[3])
        ctx.layout = (routed, shared, topk)
        ctx.mark_non_differentiable(*out[1:5])  # the gates act through the merged output
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad_merged, _gates, _probs, _mask, _index, grad_loss):
        heads, logits, gates, probs, mask = ctx.saved_tensors
        if grad_merged is None:  # only the loss was used
            B, h, N, d = heads.shape
            grad_merged = heads.new_zeros(B, N, h * d)
        grad_heads, grad_logits = torch.ops.moh_routing.route_merge_backward(grad_merged, grad_loss, heads, gates,
                                                                            logits, probs, mask, *ctx.layout)
        return grad_heads, grad_logits, None, None, None, None, None


def fused_route_merge(heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int,
                      with_loss: bool) -> Tuple[Tensor, Routing]:
    """:func:`fused_route` and, in the same pass, the gates applied where the heads are merged (CPU: the C++ kernel;
    CUDA: its Triton twin, :func:`~moh_vision.attention.triton_routing.triton_route_merge`, ``topk > 0``):
    from the head outputs ``[B, h, N, d]`` (any strides; the logits' dtype) the gated merge ``[B, N, h * d]``
    that ``merge_heads(heads, gates)`` gives (the same products), and the routing. One operator each way, in
    place of the routing's and the gate multiply's."""
    if logits.is_cuda:
        from .triton_routing import triton_route_merge
        merged, *routing = triton_route_merge(heads, logits, routed, shared, topk, with_loss)
        return merged, _routing(routing, topk)
    float_out = logits.dtype in LOW_PRECISION and torch.is_autocast_enabled("cpu")
    grad = torch.is_grad_enabled() and (heads.requires_grad or logits.requires_grad)
    route = _FusedRouteMerge.apply if grad else torch.ops.moh_routing.route_merge
    merged, *routing = route(heads, logits, routed, shared, topk, with_loss, float_out)
    return merged, _routing(routing, topk)


def fused_route(logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool) -> Routing:
    """MoH's gates from the stacked router logits ``[..., L]`` (rows ``wg``, ``wg_0``, ``wg_1`` as
    :meth:`MoH.stacked_router_weight` stacks them), with ``routed = h - h_s`` routed heads; the load-balance
    loss when ``with_loss``. Needs :func:`fused_routing_available`."""
    if logits.is_cuda:
        from .triton_routing import triton_route
        out = triton_route(logits, routed, shared, topk, with_loss)
    else:
        # autocast's GEMM gives low-precision logits and its softmax (the formulas') float32 probabilities: the
        # kernel reads the logits as they are and stores float32 gates, probabilities and selection, as the Triton
        # kernels do (the same gates, selection and loss as the formulas, no cast of the logits)
        float_out = logits.dtype in LOW_PRECISION and torch.is_autocast_enabled("cpu")
        # the operator alone where there is nothing to differentiate
        route = _FusedRoute.apply if torch.is_grad_enabled() and logits.requires_grad else torch.ops.moh_routing.route
        out = route(logits, routed, shared, topk, with_loss, float_out)
    return _routing(out, topk)


def _routing(out: Sequence[Tensor], topk: int) -> Routing:
    """The kernels' (gates, probs, mask, index, loss) as a :class:`Routing`."""
    gates, probs, mask, index, loss = out
    if topk == 0:  # nothing routed: no probabilities, no selected heads (as the formulas give it)
        probs = index = None
    return Routing(gates, probs, mask, index, loss if loss.dim() == 0 else None)
