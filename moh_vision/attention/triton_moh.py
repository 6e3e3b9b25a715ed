"""Triton kernels for MoH's routed heads: attention over per-head lists of selected tokens.

The sparse path (:mod:`~moh_vision.attention.sparse`) packs the queries of every selected
(token, routed head) pair into one ``[R, d]`` buffer, grouped by head, then image: the list of
head ``e`` in image ``b`` is ``counts[e, b]`` rows starting at ``offsets[e, b]``. These kernels
run flash attention (online softmax; nothing of size N x N is stored) for exactly those rows
against all ``N`` keys/values of head ``e`` in image ``b``, with no padding:

* ``_forward_kernel``: one program per (block of a list, head x image); blocks past the end of
  a list exit at once. Stores the output and the row log-sum-exp for backward.
* ``_backward_dkdv_kernel``: one program per (block of keys, head x image), looping over that
  list: ``dV += P^T dO``, ``dK += dS^T Q``.
* ``_backward_dq_kernel``: one program per (block of a list, head x image), looping over keys:
  ``dQ += dS K``.

Exactness: fp32 inputs use IEEE fp32 dots (no TF32) unless
``torch.backends.cuda.matmul.allow_tf32`` is set; bf16/fp16 inputs accumulate in fp32.

Where it runs: CUDA tensors (compiled), or CPU tensors when ``TRITON_INTERPRET=1`` was in the
environment before Python started (Triton's interpreter: slow, for testing; Triton decides at
import time whether its own standard library is interpreted). Status: tested for exactness
against the masked path in the interpreter only. No GPU was available when it was written, so
it was never compiled or timed, and ``impl="auto"`` never picks it
(:func:`~moh_vision.attention.moh.choose_impl`).
"""
from __future__ import annotations

import math
import os
from typing import Dict, Tuple

import torch

from moh_vision.errors import ConfigError
from .sparse import Dispatch, RoutedAttention

Tensor = torch.Tensor

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Kernels (plain functions; compiled or interpreted on first use by ``_kernels``)
# ----------------------------------------------------------------------------------------------
def _forward_kernel(Q, K, V, O, LSE, COUNTS, OFFSETS,
                    stride_q, stride_kb, stride_ke, stride_kn, stride_vb, stride_ve, stride_vn,
                    N, B, HEAD_DIM, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_eb = tl.program_id(1)  # = e * B + b
    e = pid_eb // B
    b = pid_eb % B
    count = tl.load(COUNTS + pid_eb)
    if pid_m * BLOCK_M >= count:  # past the end of this (head, image)'s list
        return
    row0 = tl.load(OFFSETS + pid_eb).to(tl.int64)  # first row of this (head, image) list
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < count
    d_mask = offs_d < HEAD_DIM
    q_ptrs = Q + (row0 + offs_m)[:, None] * stride_q + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + e.to(tl.int64) * stride_ke
    v_base = V + b.to(tl.int64) * stride_vb + e.to(tl.int64) * stride_ve

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    o_ptrs = O + (row0 + offs_m)[:, None] * stride_q + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    tl.store(LSE + row0 + offs_m, m_i + tl.log(l_i), mask=m_mask)


def _backward_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, COUNTS, OFFSETS,
                          stride_q, stride_kb, stride_ke, stride_kn, stride_vb, stride_ve, stride_vn,
                          stride_gb, stride_ge, stride_gn,
                          N, B, HEAD_DIM, scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_eb = tl.program_id(1)
    e = pid_eb // B
    b = pid_eb % B
    count = tl.load(COUNTS + pid_eb)
    row0 = tl.load(OFFSETS + pid_eb).to(tl.int64)  # first row of this (head, image) list
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < N
    d_mask = offs_d < HEAD_DIM
    kv_mask = n_mask[:, None] & d_mask[None, :]
    b64, e64 = b.to(tl.int64), e.to(tl.int64)
    k = tl.load(K + b64 * stride_kb + e64 * stride_ke + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + e64 * stride_ve + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)

    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    for start_m in range(0, count, BLOCK_M):  # only this head's selected tokens in this image
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = row0 + offs_m
        qd_mask = m_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + rows[:, None] * stride_q + offs_d[None, :], mask=qd_mask, other=0.0)
        do = tl.load(DO + rows[:, None] * stride_q + offs_d[None, :], mask=qd_mask, other=0.0)
        lse = tl.load(LSE + rows, mask=m_mask, other=0.0)
        delta = tl.load(DELTA + rows, mask=m_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.exp(s - lse[:, None])
        p = tl.where(m_mask[:, None] & n_mask[None, :], p, 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    dk = dk * scale
    g_off = b64 * stride_gb + e64 * stride_ge + offs_n[:, None] * stride_gn + offs_d[None, :]
    tl.store(DK + g_off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _backward_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, COUNTS, OFFSETS,
                        stride_q, stride_kb, stride_ke, stride_kn, stride_vb, stride_ve, stride_vn,
                        N, B, HEAD_DIM, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_eb = tl.program_id(1)
    e = pid_eb // B
    b = pid_eb % B
    count = tl.load(COUNTS + pid_eb)
    if pid_m * BLOCK_M >= count:
        return
    row0 = tl.load(OFFSETS + pid_eb).to(tl.int64)  # first row of this (head, image) list
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < count
    d_mask = offs_d < HEAD_DIM
    rows = row0 + offs_m
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + rows[:, None] * stride_q + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_q + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + rows, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + rows, mask=m_mask, other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + e.to(tl.int64) * stride_ke
    v_base = V + b.to(tl.int64) * stride_vb + e.to(tl.int64) * stride_ve

    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.exp(s - lse[:, None])
        p = tl.where(n_mask[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    tl.store(DQ + rows[:, None] * stride_q + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qd_mask)


_COMPILED: Dict[bool, Tuple] = {}


def _kernels(interpret: bool):
    """The three kernels, compiled with ``triton.jit`` or wrapped for Triton's CPU interpreter."""
    if interpret not in _COMPILED:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction as wrap
        else:
            wrap = triton.jit
        _COMPILED[interpret] = tuple(wrap(fn) for fn in (_forward_kernel, _backward_dkdv_kernel, _backward_dq_kernel))
    return _COMPILED[interpret]


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------
def _check_device(t: Tensor) -> bool:
    """True to interpret on CPU, False to compile for CUDA; ConfigError for anything else."""
    if triton is None:
        raise ConfigError("MoH impl 'triton' needs the triton package; use impl=sparse or impl=auto")
    if t.is_cuda:
        return False
    if t.device.type == "cpu" and interpreter_requested():
        if isinstance(tl.sum, triton.runtime.JITFunction):
            raise ConfigError("TRITON_INTERPRET=1 was set after triton was imported; Triton's interpreter needs it in "
                              "the environment before Python starts")
        return True
    raise ConfigError(f"MoH impl 'triton' needs CUDA tensors (got {t.device.type}; set TRITON_INTERPRET=1 to run "
                      "Triton's CPU interpreter for testing); use impl=sparse or impl=auto")


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _blocks(interpret: bool, head_dim: int) -> dict:
    """Tile sizes: 16 in the interpreter (fast there); on a GPU 64, or 32 for head_dim > 64
    (e.g. DiT-XL's 72, padded to 128) to stay within shared memory. Not tuned on a GPU."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    size = 16 if interpret else (64 if block_d <= 64 else 32)
    return dict(BLOCK_M=size, BLOCK_N=size, BLOCK_D=block_d)


class RoutedFlashAttention(torch.autograd.Function):
    """Attention of the packed routed queries ``q`` [R, d] over ``k``, ``v`` [B, E, N, d]."""

    @staticmethod
    def forward(ctx, q, k, v, counts, offsets, max_len: int):
        interpret = _check_device(q)
        fwd, _, _ = _kernels(interpret)
        B, E, N, d = k.shape
        q, k, v = q.contiguous(), _last_dim_contiguous(k), _last_dim_contiguous(v)
        blocks = _blocks(interpret, d)
        scale = 1.0 / math.sqrt(d)
        o = torch.empty_like(q)  # every row belongs to exactly one (head, image) list
        lse = torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(max_len, blocks["BLOCK_M"]), E * B)
        fwd[grid](q, k, v, o, lse, counts, offsets,
                  q.stride(0), *k.stride()[:3], *v.stride()[:3], N, B, d, scale,
                  PRECISION=_precision(q.dtype), **blocks)
        ctx.save_for_backward(q, k, v, o, lse, counts, offsets)
        ctx.max_len, ctx.interpret, ctx.scale = max_len, interpret, scale
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse, counts, offsets = ctx.saved_tensors
        _, dkdv_kernel, dq_kernel = _kernels(ctx.interpret)
        B, E, N, d = k.shape
        blocks = _blocks(ctx.interpret, d)
        grad_o = grad_o.contiguous()
        delta = (grad_o.float() * o.float()).sum(-1)  # rowsum(dO * O), the softmax-backward term
        dq = torch.empty_like(q)
        dk = torch.empty(B, E, N, d, dtype=k.dtype, device=k.device)
        dv = torch.empty_like(dk)
        common = dict(PRECISION=_precision(q.dtype), **blocks)
        dkdv_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), E * B)](
            q, k, v, grad_o, lse, delta, dk, dv, counts, offsets,
            q.stride(0), *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], N, B, d, ctx.scale, **common)
        dq_kernel[(triton.cdiv(ctx.max_len, blocks["BLOCK_M"]), E * B)](
            q, k, v, grad_o, lse, delta, dq, counts, offsets,
            q.stride(0), *k.stride()[:3], *v.stride()[:3], N, B, d, ctx.scale, **common)
        return dq, dk, dv, None, None, None


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_routed_attention() -> RoutedAttention:
    """A drop-in for :func:`~moh_vision.attention.sparse.sdpa_routed_attention` that runs the
    Triton kernels (no attention dropout: ``impl="triton"`` refuses ``attn_drop > 0``)."""

    def attend(q: Tensor, k: Tensor, v: Tensor, dispatch: Dispatch) -> Tensor:
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):  # like SDPA under autocast: low-precision inputs
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        meta = _dispatch_tensors(dispatch, q.device)
        with torch.autocast(device_type=device_type, enabled=False):
            return RoutedFlashAttention.apply(q, k, v, *meta, max(max(dispatch.lengths), 1))

    return attend


def _dispatch_tensors(dispatch: Dispatch, device) -> Tuple[Tensor, Tensor]:
    """int32 per-(head, image) list lengths and first rows, indexed ``e * B + b``, for the kernels."""
    counts = dispatch.counts.to(device=device, dtype=torch.int32).reshape(-1).contiguous()
    offsets = dispatch.offsets.to(device=device, dtype=torch.int32).reshape(-1).contiguous()
    return counts, offsets
