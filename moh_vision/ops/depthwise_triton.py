"""The ConvGLU's depthwise convolution of tokens in Triton (``kernels.depthwise=triton``), a CUDA candidate.

It reads the tokens ``[B, N, C]`` of an ``H x W`` image where they are, where cuDNN wants a dense image (a copy) and its
grouped kernels have slow shapes (pytorch#34977):

* ``_correlate``: a block of tokens x a block of channels of one image; per tap one masked load of the neighbours' rows
  (nothing padded), a multiply-add in float32; writes dense ``[B, N, C]``. The input's gradient is the same sum over
  the mirrored taps of the output's gradient.
* ``_weight_grads``: a chunk of tokens x a block of channels; per tap the products of the output's gradient with the
  neighbours' inputs summed over the chunk (and the gradient itself, for the bias), one row each in a ``[chunks, k * k
  + 1, C]`` float32 buffer that torch sums.

Not a default until a record shows it faster on CUDA (``tools/gpu_checks.sh`` times it beside cuDNN). Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (``tests/test_depthwise.py``)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .triton import tl, triton

Tensor = torch.Tensor
BLOCK_N, BLOCK_C = 32, 64
WEIGHT_BLOCK_N = 16  # tokens a step of the weight's gradient: 9 loaded [16, 64] tiles fit sm_90's registers


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _correlate(X, Wt, Bias, Out, s_xb, s_xn, HEIGHT, WIDTH, C, K: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """``Out[b, n, c] = Bias[c] + sum_t Wt[t, c] X[b, n + o_t, c]`` over the taps whose neighbour is in the map."""
    b = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live_n, live_c = n < HEIGHT * WIDTH, c < C
    y, x = n // WIDTH, n % WIDTH
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=live_c, other=0.0).to(tl.float32)[None, :]
    for t in tl.static_range(K * K):
        yy, xx = y + t // K - K // 2, x + t % K - K // 2
        ok = live_n & (yy >= 0) & (yy < HEIGHT) & (xx >= 0) & (xx < WIDTH)
        v = tl.load(X + b * s_xb + (yy * WIDTH + xx).to(tl.int64)[:, None] * s_xn + c[None, :],
                    mask=ok[:, None] & live_c[None, :], other=0.0)
        w = tl.load(Wt + t * C + c, mask=live_c, other=0.0)
        acc += v.to(tl.float32) * w.to(tl.float32)[None, :]
    out = Out + b * HEIGHT * WIDTH * C + n.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=live_n[:, None] & live_c[None, :])


@_jit
def _weight_grads(G, X, Partial, s_xb, s_xn, TOKENS, HEIGHT, WIDTH, C, PER_CHUNK, K: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """``Partial[chunk, t, c] = sum over the chunk's tokens of G[b, n, c] X[b, n + o_t, c]`` (row ``K * K``: of
    ``G`` alone), tokens numbered across images (``TOKENS = B x N``)."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live_c = c < C
    taps = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
    for start in range(chunk * PER_CHUNK, tl.minimum((chunk + 1) * PER_CHUNK, TOKENS), BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        live = idx < tl.minimum((chunk + 1) * PER_CHUNK, TOKENS)
        b, n = (idx // (HEIGHT * WIDTH)).to(tl.int64), idx % (HEIGHT * WIDTH)
        y, x = n // WIDTH, n % WIDTH
        g = tl.load(G + idx.to(tl.int64)[:, None] * C + c[None, :], mask=live[:, None] & live_c[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.where(taps[:, None] == K * K, tl.sum(g, 0)[None, :], 0.0)
        for t in tl.static_range(K * K):
            yy, xx = y + t // K - K // 2, x + t % K - K // 2
            ok = live & (yy >= 0) & (yy < HEIGHT) & (xx >= 0) & (xx < WIDTH)
            v = tl.load(X + b[:, None] * s_xb + (yy * WIDTH + xx).to(tl.int64)[:, None] * s_xn + c[None, :],
                        mask=ok[:, None] & live_c[None, :], other=0.0).to(tl.float32)
            acc += tl.where(taps[:, None] == t, tl.sum(g * v, 0)[None, :], 0.0)
    out = Partial + chunk.to(tl.int64) * ROWS * C + taps[:, None] * C + c[None, :]
    tl.store(out, acc, mask=(taps[:, None] <= K * K) & live_c[None, :])


def _taps(weight: Tensor, mirrored: bool) -> Tensor:
    """``[C, 1, k, k]`` -> ``[k * k, C]`` (tap-major), the taps reversed for the input's gradient."""
    taps = weight.flatten(1).t()
    return (taps.flip(0) if mirrored else taps).contiguous()


def _correlated(x: Tensor, taps: Tensor, bias: Optional[Tensor], height: int, width: int, k: int) -> Tensor:
    B, N, C = x.shape
    out = torch.empty(B, N, C, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(C, BLOCK_C), B)
    _correlate[grid](x, taps, taps if bias is None else bias, out, x.stride(0), x.stride(1), height, width, C, K=k,
                     HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C)
    return out


def _weight_grad(grad: Tensor, x: Tensor, height: int, width: int, k: int) -> Tuple[Tensor, Tensor]:
    B, N, C = x.shape
    tokens = B * N
    per_chunk = triton.cdiv(triton.cdiv(tokens, 256), WEIGHT_BLOCK_N) * WEIGHT_BLOCK_N  # at most 256 chunks
    chunks = triton.cdiv(tokens, per_chunk)
    rows = triton.next_power_of_2(k * k + 1)
    partial = torch.zeros(chunks, rows, C, dtype=torch.float32, device=x.device)
    _weight_grads[(chunks, triton.cdiv(C, BLOCK_C))](grad, x, partial, x.stride(0), x.stride(1), tokens, height,
                                                      width, C, per_chunk, K=k, ROWS=rows, BLOCK_N=WEIGHT_BLOCK_N,
                                                      BLOCK_C=BLOCK_C)
    total = partial.sum(0)
    return total[:k * k].t().reshape(C, 1, k, k), total[k * k]


class _DepthwiseTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, height, width):
        ctx.save_for_backward(x, weight)
        ctx.geometry, ctx.has_bias = (height, width), bias is not None
        return _correlated(x, _taps(weight, False), bias, height, width, weight.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        (height, width), k = ctx.geometry, weight.shape[-1]
        grad = grad.contiguous()
        grad_x = _correlated(grad, _taps(weight, True), None, height, width, k)
        grad_weight, grad_bias = _weight_grad(grad, x, height, width, k)
        return (grad_x, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype) if ctx.has_bias else None, None, None)


def depthwise_conv_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int) -> Tensor:
    """The ``k x k`` depthwise convolution (padding ``k // 2``) of tokens ``x`` ``[B, N, C]`` (channels contiguous,
    any token stride) as an ``height x width`` image, ``weight`` ``[C, 1, k, k]``: dense ``[B, N, C]`` tokens, as
    ``F.conv2d`` on that image gives them (float32 sums for half-precision inputs)."""
    if triton is None:
        raise RuntimeError("depthwise_conv_triton needs Triton")
    if x.stride(-1) != 1:  # the kernels step over tokens by x's stride, over channels one by one
        x = x.contiguous()
    return _DepthwiseTriton.apply(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), int(height),
                                  int(width))
