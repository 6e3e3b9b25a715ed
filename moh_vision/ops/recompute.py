"""Pieces of TransNeXt that, in eager training, keep only their inputs for backward and recompute the rest there.

Autograd keeps every intermediate a backward formula reads; around TransNeXt's attention and in its ConvGLU those are
wide tensors that are cheap to recompute. Each op (config key ``kernels.recompute``) has its formula (``reference``)
and a ``recompute`` implementation that keeps less, with the same values and gradients:

* ``gated_tail``: the ConvGLU after ``fc1``, ``fc2(GELU(dwconv(x)) * gate)``, keeping ``x`` and ``gate`` only;
* ``cosine_queries``: the aggregated attention's queries ``(q / |q| + embedding) * scale`` and the learnable tokens'
  weight ``q / |q| @ tokens + bias``, keeping ``q`` only;
* ``average_pool``: the pooled branch's adaptive average pool, keeping nothing (its backward reads a shape);
* ``position_mlp``: the position-bias MLP, its ``[Uh * Uw, 512]`` hidden layer recomputed in backward.

``recompute`` runs where eager autograd records the call (``auto`` on every device: saved bytes do not depend on the
device; ``torch.compile``'s partitioner decides what to recompute itself, tracers record the formulas)."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .depthwise import depthwise_conv
from .dispatch import EAGER, Op

Tensor = torch.Tensor
Size2 = Tuple[int, int]
RECOMPUTE = dict(tracers=EAGER, training_only=True)
AUTO = {"cpu": "recompute", "cuda": "recompute"}


def _float(*tensors: Tensor) -> List[Tensor]:
    """Half-precision tensors in float32 (float32 and float64 as they are)."""
    return [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]


# ---- The ConvGLU's tail ----------------------------------------------------------------------
def gated_tail_reference(x: Tensor, gate: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], weight: Tensor,
                         bias: Optional[Tensor], height: int, width: int, depthwise: str = "auto") -> Tensor:
    """``linear(GELU(dwconv(x)) * gate, weight, bias)`` for tokens ``x``, ``gate`` ``[B, N, hidden]`` of a
    ``height x width`` image (``depthwise``: the ``kernels.depthwise`` choice)."""
    conv = depthwise_conv(x, conv_weight, conv_bias, height, width, kernel=depthwise)
    return F.linear(F.gelu(conv) * gate, weight, bias)


class _GatedTail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], weight: Tensor,
                bias: Optional[Tensor], height: int, width: int, depthwise: str) -> Tensor:
        ctx.save_for_backward(x, gate, conv_weight, conv_bias, weight)
        ctx.geometry, ctx.has_bias = (height, width, depthwise), bias is not None
        conv = depthwise_conv(x, conv_weight, conv_bias, height, width, kernel=depthwise)
        return F.linear(F.gelu(conv) * gate, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, gate, conv_weight, conv_bias, weight = ctx.saved_tensors
        height, width, depthwise = ctx.geometry
        with torch.enable_grad():  # the convolution's own backward, on its recomputed output
            conv_inputs = [t.detach().requires_grad_() if t is not None else None for t in (x, conv_weight, conv_bias)]
            a_ = depthwise_conv(*conv_inputs, height, width, kernel=depthwise)
        a = a_.detach()
        activated = F.gelu(a)
        grad_hidden = grad @ weight
        grad_a = torch.ops.aten.gelu_backward(grad_hidden * gate, a)  # GELU's derivative in one pass
        wanted = [t for t in conv_inputs if t is not None]
        grad_x, grad_conv_weight, *grad_conv_bias = torch.autograd.grad(a_, wanted, grad_a)
        grad_weight = grad.flatten(0, -2).t() @ (activated * gate).flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return (grad_x, grad_hidden * activated, grad_conv_weight, grad_conv_bias[0] if grad_conv_bias else None,
                grad_weight, grad_bias, None, None, None)


GATED_TAIL = Op("gated_tail", key="recompute", reference=gated_tail_reference, auto=AUTO)


@GATED_TAIL.implement("recompute", **RECOMPUTE)
def gated_tail_recompute(x: Tensor, gate: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], weight: Tensor,
                         bias: Optional[Tensor], height: int, width: int, depthwise: str = "auto") -> Tensor:
    """Under autocast the Function runs in the autocast dtype (its backward runs outside autocast)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    tensors = [None if t is None else t.to(dtype) for t in (x, gate, conv_weight, conv_bias, weight, bias)]
    with torch.autocast(device, enabled=False):
        return _GatedTail.apply(*tensors, height, width, depthwise)


# ---- The aggregated attention's queries ------------------------------------------------------
NORM_EPS = 1e-12  # F.normalize's


def cosine_queries_reference(q: Tensor, embedding: Tensor, scale: Tensor, tokens: Tensor,
                             token_bias: Tensor) -> Tuple[Tensor, Tensor]:
    """``((n + embedding) * scale, n @ tokens + token_bias)`` with ``n = q / |q|``: the scaled queries (``q``'s
    dtype) and the local weight ``[B, h, N, L]``. ``q`` ``[B, h, N, d]``, ``embedding`` ``[h, 1, d]``, ``scale``
    ``[h, N, 1]`` (temperature times length scale), ``tokens`` ``[h, d, L]``, ``token_bias`` ``[h, 1, L]``."""
    q_norm = F.normalize(q, dim=-1)
    return ((q_norm + embedding) * scale).to(q.dtype), q_norm @ tokens + token_bias


class _CosineQueries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, embedding, scale, tokens, token_bias):
        ctx.save_for_backward(q, embedding, scale, tokens)
        ctx.dtypes = (q.dtype, token_bias.dtype)
        q32, tokens32 = _float(q, tokens)
        q_norm = F.normalize(q32, dim=-1)
        return ((q_norm + embedding) * scale).to(q.dtype), (q_norm @ tokens32 + token_bias).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_q, grad_weight):
        q, embedding, scale, tokens = ctx.saved_tensors
        q32, tokens32, grad_q, grad_weight = _float(q, tokens, grad_q, grad_weight)
        norm = q32.norm(dim=-1, keepdim=True)
        q_norm = q32 / norm.clamp_min(NORM_EPS)
        grad_shifted = grad_q * scale
        grad_norm = grad_shifted + grad_weight @ tokens32.transpose(-2, -1)
        # d (q / |q|): the component of the gradient across q, over |q| (below eps the norm is a constant)
        radial = (q_norm * grad_norm).sum(-1, keepdim=True)
        grad_input = torch.where(norm > NORM_EPS, grad_norm - q_norm * radial, grad_norm) / norm.clamp_min(NORM_EPS)
        grads = (grad_input, grad_shifted.sum((0, 2), keepdim=True).squeeze(0),
                 (grad_q * (q_norm + embedding)).sum(-1, keepdim=True).sum(0),
                 (q_norm.transpose(-2, -1) @ grad_weight).sum(0), grad_weight.sum((0, 2), keepdim=True).squeeze(0))
        dtypes = (ctx.dtypes[0], embedding.dtype, scale.dtype, tokens.dtype, ctx.dtypes[1])
        return tuple(g.to(dtype) for g, dtype in zip(grads, dtypes))


COSINE_QUERIES = Op("cosine_queries", key="recompute", reference=cosine_queries_reference, auto=AUTO)
COSINE_QUERIES.implement("recompute", **RECOMPUTE)(_CosineQueries.apply)


# ---- The pooled branch's pool ----------------------------------------------------------------
class _AveragePool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, size: Size2) -> Tensor:
        ctx.shape = x.shape
        return F.adaptive_avg_pool2d(x, size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return torch.ops.aten._adaptive_avg_pool2d_backward(grad, grad.new_empty(ctx.shape)), None


AVERAGE_POOL = Op("average_pool", key="recompute", reference=F.adaptive_avg_pool2d, auto=AUTO)
AVERAGE_POOL.implement("recompute", **RECOMPUTE)(_AveragePool.apply)


# ---- The position-bias MLP -------------------------------------------------------------------
def _call(table: Tensor, mlp: Callable[[Tensor], Tensor]) -> Tensor:
    return mlp(table)


def _checkpointed(table: Tensor, mlp: Callable[[Tensor], Tensor]) -> Tensor:
    return checkpoint(mlp, table, use_reentrant=False)


POSITION_MLP = Op("position_mlp", key="recompute", reference=_call, auto=AUTO)
POSITION_MLP.implement("recompute", **RECOMPUTE)(_checkpointed)


# ---- What the models call --------------------------------------------------------------------
def gated_tail(x: Tensor, gate: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], weight: Tensor,
               bias: Optional[Tensor], height: int, width: int, kernels) -> Tensor:
    """``linear(GELU(dwconv(x)) * gate, weight, bias)`` (``kernels``: a :class:`~moh_vision.ops.Kernels`)."""
    return GATED_TAIL(kernels.recompute, x, gate, conv_weight, conv_bias, weight, bias, height, width,
                      kernels.depthwise)


def cosine_queries(q: Tensor, embedding: Tensor, scale: Tensor, tokens: Tensor, token_bias: Tensor,
                   kernel: str = "auto") -> Tuple[Tensor, Tensor]:
    """The scaled cosine queries and the learnable tokens' local weight (:func:`cosine_queries_reference`)."""
    return COSINE_QUERIES(kernel, q, embedding, scale, tokens, token_bias)


def average_pool(x: Tensor, size: Size2, kernel: str = "auto") -> Tensor:
    """``F.adaptive_avg_pool2d(x, size)``."""
    return AVERAGE_POOL(kernel, x, size)


def position_mlp(table: Tensor, mlp: Callable[[Tensor], Tensor], kernel: str = "auto") -> Tensor:
    """``mlp(table)``, the MLP's hidden layer recomputed in backward under ``recompute``."""
    return POSITION_MLP(kernel, table, mlp)
