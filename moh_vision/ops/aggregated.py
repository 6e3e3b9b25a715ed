"""TransNeXt's aggregated attention: its formula over shifted views and one operator each way, no window copies.

Each query of an ``H x W`` map attends, under one softmax, to the keys of its ``window x window`` neighbourhood
(zero-padded, the padded slots masked, a learned per-head bias per slot) and to ``P`` pooled keys (a position bias
per query and pooled key); its local value sum gets a further, non-softmax weight per slot (the learnable tokens'
``local_weight``)::

    s_l   = q . k[n + o_l] + local_bias[l]      (-inf where n + o_l is outside the map)
    s_p   = q . k_pool[p] + pool_bias[n, p]
    a     = softmax([s_l, s_p])
    out   = sum_l (a_l + local_weight_l) v[n + o_l] + sum_p a_p v_pool[p]

The official code copies every key and value nine times (``F.unfold``) and keeps the copies for backward. Op
``aggregated_attention`` (``kernels.aggregated``):

* ``reference``: :func:`aggregated_attention_reference`, the formula in plain operators over nine shifted views of
  one padded tensor: the test oracle, and what tracers and exporters record;
* ``fused``: ``torch.ops.moh_vision.aggregated_attention`` (one node under ``torch.compile`` and ``torch.jit.trace``)
  returns the output and each query's log-sum-exp; its backward recomputes the attention from them, as flash
  attention does, so training keeps the inputs and ``[B, h, N]`` floats. C++ kernels on the CPU
  (``csrc/aggregated_attention.cpp``, built on first use; the shifted-view formulas without a compiler), Triton on
  CUDA (:mod:`~moh_vision.ops.aggregated_triton`); half precision computed in float32; no attention dropout (a call
  with dropout runs the reference);
* ``flex``: FlexAttention (:mod:`~moh_vision.ops.aggregated_flex`), a CUDA candidate.

Slot ``l`` is the offset ``(l // window - window // 2, l % window - window // 2)``, ``F.unfold``'s order, which the
checkpoints' ``relative_pos_bias_local`` and ``learnable_tokens`` follow."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .dispatch import EAGER_OR_COMPILED, RUNS, Op
from .extensions import load_cpu_kernels
from .tracing import JIT_TRACE

Tensor = torch.Tensor
Size2 = Tuple[int, int]
NAME = "aggregated_attention"  # the op's name (moh_vision.ops.dispatch)

__all__ = ["aggregated_attention", "aggregated_attention_reference", "local_window_mask"]


# ---- Window geometry (computed once per resolution, on the CPU) ------------------------------
def window_slots(window: int) -> List[Tuple[int, int]]:
    """``(row, column)`` start of each slot's view in the padded map, in ``F.unfold``'s slot order."""
    return [(i, j) for i in range(window) for j in range(window)]


@functools.lru_cache(maxsize=64)
@torch.no_grad()
def _cached_window_mask(resolution: Size2, window: int) -> Tuple[Tensor, Tensor]:
    H, W = resolution
    r = window // 2
    inside = F.pad(torch.ones(H, W, device="cpu"), (r, r, r, r))  # not a default device's (meta)
    slots = torch.stack([inside[i:i + H, j:j + W].reshape(-1) for i, j in window_slots(window)], dim=-1)  # [N, L]
    return slots.sum(dim=-1, keepdim=True), slots == 0


def local_window_mask(resolution: Size2, window: int) -> Tuple[Tensor, Tensor]:
    """For a ``window`` neighbourhood with zero padding: the number of in-image neighbours of each position
    ``[N, 1]`` and the mask of out-of-image slots ``[N, window ** 2]``."""
    return tuple(t.clone() for t in _cached_window_mask(tuple(resolution), window))


@functools.lru_cache(maxsize=64)
@torch.no_grad()
def _window_mask_on(resolution: Size2, window: int, device: torch.device) -> Tensor:
    return _cached_window_mask(resolution, window)[1].to(device)  # shared, read-only


# ---- The formula over shifted views ----------------------------------------------------------
def _grid(t: Tensor, size: Size2) -> Tensor:
    """``[B, h, N, c]`` -> ``[B, h, H, W, c]`` (a view; sizes by index, so that ``torch.fx`` can trace it)."""
    return t.reshape(t.shape[0], t.shape[1], size[0], size[1], t.shape[-1])


def _padded(t: Tensor, size: Size2, window: int) -> Tensor:
    """``[B, h, N, d]`` -> ``[B, h, H + 2r, W + 2r, d]``, zero border (one copy, whatever the window)."""
    r = window // 2
    return F.pad(_grid(t, size), (0, 0, r, r, r, r))


def _views(padded: Tensor, size: Size2, window: int):
    """The ``window ** 2`` shifted ``[B, h, H, W, d]`` views of a padded map (views, not copies)."""
    H, W = size
    return [padded[:, :, i:i + H, j:j + W] for i, j in window_slots(window)]


def local_logits(q: Tensor, k_padded: Tensor, size: Size2, window: int) -> Tensor:
    """``q . k`` of every query ``[B, h, N, d]`` with each of its window's keys: ``[B, h, N, window ** 2]``."""
    grid = _grid(q, size)
    logits = torch.stack([(grid * k).sum(-1) for k in _views(k_padded, size, window)], dim=-1)
    return logits.flatten(2, 3)


def local_sum(weight: Tensor, v_padded: Tensor, size: Size2, window: int) -> Tensor:
    """``sum_l weight[..., l] v[n + o_l]``: ``[B, h, N, L]`` weights over each window's values -> ``[B, h, N, d]``."""
    grid = _grid(weight, size).unsqueeze(-1)
    out = None
    for slot, v in enumerate(_views(v_padded, size, window)):
        term = grid[..., slot, :] * v
        out = term if out is None else out + term
    return out.flatten(2, 3)


def _scatter_windows(terms, shape, size: Size2, window: int) -> Tensor:
    """Adjoint of :func:`_views`: ``terms[l]`` ``[B, h, H, W, d]`` summed at the slots' offsets, cropped to
    ``[B, h, N, d]``."""
    H, W = size
    r = window // 2
    padded = terms[0].new_zeros(*shape[:2], H + 2 * r, W + 2 * r, shape[-1])
    for (i, j), term in zip(window_slots(window), terms):
        padded[:, :, i:i + H, j:j + W] += term
    return padded[:, :, r:r + H, r:r + W].reshape(shape)


def aggregated_attention_reference(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, pool_bias: Tensor,
                                   local_bias: Tensor, local_weight: Tensor, size: Size2, window: int,
                                   dropout: float = 0.0, padding_mask: Optional[Tensor] = None) -> Tensor:
    """The aggregated attention in plain operators (autograd through every one). ``q`` ``[B, h, N, d]`` scaled queries;
    ``k`` (normalised), ``v`` ``[B, hk, N, d]`` and ``k_pool``, ``v_pool`` ``[B, hk, P, d]`` with ``hk`` in ``(1, h)``;
    ``pool_bias`` ``[h, N, P]``; ``local_bias`` ``[h, L]``; ``local_weight`` ``[B, h, N, L]``; ``size = (H, W)`` with
    ``H * W = N``; ``dropout`` on the attention probabilities; ``padding_mask`` ``[N, L]`` (True outside the map) if the
    caller holds it (a module buffer, which ``torch.fx`` can trace). Returns ``[B, h, N, d]``."""
    attn = _logits(q, _padded(k, size, window), k_pool, pool_bias, local_bias, size, window, padding_mask)
    attn = attn.softmax(dim=-1)
    if dropout:
        attn = F.dropout(attn, dropout)
    attn_local, attn_pool = attn.split([window * window, k_pool.shape[-2]], dim=-1)
    return _weighted_values(attn_local, attn_pool, local_weight, v, v_pool, size, window)


def _logits(q, k_padded, k_pool, pool_bias, local_bias, size, window, padding_mask=None) -> Tensor:
    """The window logits (masked slots -inf) and the pooled logits of every query, ``[B, h, N, L + P]``."""
    if padding_mask is None:
        padding_mask = _window_mask_on(tuple(size), window, q.device)
    logits_local = local_logits(q, k_padded, size, window) + local_bias.unsqueeze(1)
    logits_local = logits_local.masked_fill(padding_mask, float("-inf"))
    return torch.cat([logits_local, q @ k_pool.transpose(-2, -1) + pool_bias], dim=-1)


def _weighted_values(attn_local, attn_pool, local_weight, v, v_pool, size, window) -> Tensor:
    """``sum_l (a_l + local_weight_l) v[n + o_l] + sum_p a_p v_pool[p]``. Padded slots hold zero values, so
    the unmasked local weight adds nothing there."""
    return local_sum(attn_local + local_weight, _padded(v, size, window), size, window) + attn_pool @ v_pool


# ---- The operator, forward and backward, on any device (float32 arithmetic) ------------------
def _probabilities(q, k_padded, k_pool, pool_bias, local_bias, lse, size, window) -> Tuple[Tensor, Tensor]:
    """The attention ``(local [B, h, N, L], pooled [B, h, N, P])``: ``exp(logits - lse)`` when ``lse`` is
    given, else the softmax; masked slots 0."""
    logits = _logits(q, k_padded, k_pool, pool_bias, local_bias, size, window)
    if lse is None:
        lse = logits.logsumexp(dim=-1)
    attn = (logits - lse.unsqueeze(-1)).exp_()
    return attn.split([window * window, k_pool.shape[-2]], dim=-1), lse


def _arithmetic_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the operator computes ``dtype`` inputs in: float32 for half precision, else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _float(*tensors: Tensor) -> List[Tensor]:
    """Half-precision tensors in float32 (float32 and float64 as they are)."""
    return [t.to(_arithmetic_dtype(t.dtype)) for t in tensors]


def _forward_plain(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, size, window) -> Tuple[Tensor, Tensor]:
    dtype = q.dtype
    q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight = _float(
        q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight)
    (attn_local, attn_pool), lse = _probabilities(q, _padded(k, size, window), k_pool, pool_bias, local_bias, None,
                                                  size, window)
    return _weighted_values(attn_local, attn_pool, local_weight, v, v_pool, size, window).to(dtype), lse


def _backward_plain(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, size, window):
    inputs = (q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight)
    grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight = _float(grad, *inputs)
    k_padded, v_padded = _padded(k, size, window), _padded(v, size, window)
    (attn_local, attn_pool), _ = _probabilities(q, k_padded, k_pool, pool_bias, local_bias, lse, size, window)
    # d out / d (local weight) = d out / d (local attention) = grad . v[n + o_l]
    grad_local = local_logits(grad, v_padded, size, window)          # [B, h, N, L]
    grad_pool = grad @ v_pool.transpose(-2, -1)                      # [B, h, N, P]
    delta = (attn_local * grad_local).sum(-1, keepdim=True) + (attn_pool * grad_pool).sum(-1, keepdim=True)
    ds_local, ds_pool = attn_local * (grad_local - delta), attn_pool * (grad_pool - delta)

    dq = local_sum(ds_local, k_padded, size, window) + ds_pool @ k_pool
    grid_q, grid_grad = _grid(q, size), _grid(grad, size)
    weights = [_grid(w, size) for w in (ds_local, attn_local + local_weight)]
    slots = range(window * window)
    dk = _scatter_windows([weights[0][..., s, None] * grid_q for s in slots], k.shape, size, window)
    dv = _scatter_windows([weights[1][..., s, None] * grid_grad for s in slots], v.shape, size, window)
    grads = (dq, dk, dv, ds_pool.transpose(-2, -1) @ q, attn_pool.transpose(-2, -1) @ grad, ds_pool.sum(0),
             ds_local.sum((0, 2)), grad_local)
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))


@torch.library.custom_op("moh_vision::aggregated_attention", mutates_args=())
def _aggregated_op(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, pool_bias: Tensor,
                   local_bias: Tensor, local_weight: Tensor, height: int, width: int,
                   window: int) -> Tuple[Tensor, Tensor]:
    return _forward_plain(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, (height, width), window)


@torch.library.custom_op("moh_vision::aggregated_attention_backward", mutates_args=())
def _aggregated_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor,
                            pool_bias: Tensor, local_bias: Tensor, local_weight: Tensor, lse: Tensor, height: int,
                            width: int, window: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                              Tensor, Tensor]:
    return _backward_plain(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, (height, width),
                           window)


SOURCE = Path(__file__).with_name("csrc") / "aggregated_attention.cpp"


def cpu_kernels_available() -> bool:
    """Whether the C++ CPU kernels (``csrc/aggregated_attention.cpp``) are loaded (built on the first call)."""
    return load_cpu_kernels("moh_aggregated", "forward", SOURCE, "TransNeXt's aggregated attention")


def _contiguous(dtype: torch.dtype, *tensors: Tensor) -> List[Tensor]:
    return [t.to(dtype).contiguous() for t in tensors]


def _cpu_forward(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window):
    args = _contiguous(_arithmetic_dtype(q.dtype), q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight)
    out, lse = torch.ops.moh_aggregated.forward(*args, height, width, window)
    return out.to(q.dtype), lse


def _cpu_backward(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, height, width, window):
    inputs = (q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight)
    grads = torch.ops.moh_aggregated.backward(*_contiguous(_arithmetic_dtype(q.dtype), grad, *inputs, lse), height,
                                              width, window)
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))


def _cuda_forward(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window):
    from . import aggregated_triton as kernels
    return kernels.forward(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, (height, width), window)


def _cuda_backward(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, height, width, window):
    from . import aggregated_triton as kernels
    return kernels.backward(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, (height, width),
                            window)


def _forward_formulas(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window):
    return _forward_plain(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, (height, width), window)


def _backward_formulas(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, height, width, window):
    return _backward_plain(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, (height, width),
                           window)


def _kernel(part: str, kernel, formulas, args):
    """The kernel (looked up by name when it runs) in the operator, or its formulas where its first call on this device
    fails (:meth:`~moh_vision.ops.dispatch.KernelRuns.guarded`): in eager calls, compiled graphs and backward alike;
    what autograd saves is the operator's either way."""
    return RUNS.guarded(NAME, f"fused {part}", args[1].device.type, globals()[kernel], formulas, args)


@_aggregated_op.register_kernel("cpu")
def _aggregated_cpu(*args):
    if not cpu_kernels_available():
        return _forward_formulas(*args)
    return _kernel("forward kernel", "_cpu_forward", _forward_formulas, args)


@_aggregated_backward_op.register_kernel("cpu")
def _aggregated_backward_cpu(*args):
    if not cpu_kernels_available():
        return _backward_formulas(*args)
    return _kernel("backward kernel", "_cpu_backward", _backward_formulas, args)


@_aggregated_op.register_kernel("cuda")
def _aggregated_cuda(*args):
    from . import aggregated_triton as kernels
    q, k_pool = args[0], args[3]
    if not kernels.supports(k_pool.shape[-2], q.shape[-1]):
        return _forward_formulas(*args)
    return _kernel("forward kernel", "_cuda_forward", _forward_formulas, args)


@_aggregated_backward_op.register_kernel("cuda")
def _aggregated_backward_cuda(*args):
    from . import aggregated_triton as kernels
    q, k_pool = args[1], args[4]
    if not kernels.supports(k_pool.shape[-2], q.shape[-1]):
        return _backward_formulas(*args)
    return _kernel("backward kernel", "_cuda_backward", _backward_formulas, args)


@_aggregated_op.register_fake
def _aggregated_fake(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, height, width, window):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=_arithmetic_dtype(q.dtype))


@_aggregated_backward_op.register_fake
def _aggregated_backward_fake(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, height, width,
                              window):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for t in (q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight))


def _setup_context(ctx, inputs, output) -> None:
    *tensors, height, width, window = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.geometry = (height, width, window)


def _backward(ctx, grad, _grad_lse):
    grads = torch.ops.moh_vision.aggregated_attention_backward(grad.contiguous(), *ctx.saved_tensors, *ctx.geometry)
    return (*grads, None, None, None)


_aggregated_op.register_autograd(_backward, setup_context=_setup_context)


# ---- The op: the reference and its implementations (moh_vision.ops.dispatch chooses) ---------
AGGREGATED = Op(NAME, key="aggregated", reference=aggregated_attention_reference,
                auto={"cpu": "fused", "cuda": "fused"})


@AGGREGATED.implement("fused", tracers=(*EAGER_OR_COMPILED, JIT_TRACE))
def aggregated_attention_fused(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, pool_bias: Tensor,
                               local_bias: Tensor, local_weight: Tensor, size: Size2, window: int,
                               dropout: float = 0.0, padding_mask: Optional[Tensor] = None) -> Tensor:
    """The operator (arguments as :func:`aggregated_attention_reference`); with attention dropout, which the operator
    does not draw, the reference."""
    if dropout:
        return aggregated_attention_reference(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, size,
                                              window, dropout, padding_mask)
    shape, dtype = q.shape, q.dtype
    # a shared key/value head is read by every query head, not copied
    k, v = k.expand(shape).to(dtype), v.expand(shape).to(dtype)
    k_pool, v_pool = (t.expand(*shape[:2], *t.shape[2:]).to(dtype) for t in (k_pool, v_pool))
    if q.is_cpu and torch.compiler.is_compiling():
        # the C++ kernels read contiguous rows: compiled, the compiler writes q, k and v so where it computes them;
        # eagerly the operator copies them, and autograd keeps the views it was given rather than the copies
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, _ = torch.ops.moh_vision.aggregated_attention(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight,
                                                       int(size[0]), int(size[1]), int(window))
    return out


def aggregated_attention(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, pool_bias: Tensor,
                         local_bias: Tensor, local_weight: Tensor, size: Size2, window: int, dropout: float = 0.0,
                         padding_mask: Optional[Tensor] = None, kernel: str = "auto") -> Tensor:
    """The aggregated attention ``[B, h, N, d]`` (arguments as :func:`aggregated_attention_reference`) by the
    implementation ``kernel`` (``kernels.aggregated``) chooses."""
    return AGGREGATED(kernel, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, size, window, dropout,
                      padding_mask)
