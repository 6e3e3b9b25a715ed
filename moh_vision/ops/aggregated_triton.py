"""TransNeXt's aggregated attention in Triton: one kernel forward, two backward, no window copies.

The CUDA kernels behind ``torch.ops.moh_vision.aggregated_attention`` (:mod:`.aggregated_attention` has the formula).
One program takes a block of ``BLOCK`` query tokens of one (image, head):

* ``_forward``: each query's window logits from ``window ** 2`` loads of its neighbours' key rows (masked at the
  border: nothing is padded or copied), the pooled logits as one ``[BLOCK, d] x [d, P]`` product, one softmax over both
  in registers, then the output from the neighbours' value rows and one ``[BLOCK, P] x [P, d]`` product. Stores the
  output and each query's log-sum-exp.
* ``_backward_queries``: recomputes the attention from the log-sum-exp; writes the queries' gradient and the local
  weight's, and per (query, slot) the two numbers the keys' side needs (the logit gradient and the value weight,
  ``[B, h, N, L]`` floats); adds the pooled keys', pooled values' and pooled bias's gradients with atomics.
* ``_backward_keys``: each key token gathers, over the window slots, the queries that see it: ``dk``, ``dv``.

Sizes: any ``H x W`` map, odd window, ``d`` up to 128 and ``P`` up to 1,024 pooled tokens (:func:`supports`; larger
runs the shifted-view formulas). float32 inputs use IEEE products (no TF32); bf16 / fp16 accumulate in float32. Under
``TRITON_INTERPRET=1`` (set before Python starts) they run on CPU tensors (``tests/test_aggregated_attention.py``)."""
from __future__ import annotations

from typing import Tuple

import torch

from .triton import tl, triton

Tensor = torch.Tensor
MAX_POOL, MAX_HEAD_DIM = 1024, 128
# The window's slots are a loop, not unrolled, and 8 warps share a block: ptxas (sm_90, bf16, d 24, 49 pooled keys,
# 64 queries a block) then fits the forward in 128 registers a thread, the queries' backward in 218 and the keys' in
# 96 with no spills, where unrolled with 4 warps all three took 255 and the backward kernels spilled 0.9-1.5 kB.
NUM_WARPS = 8


def supports(pool_len: int, head_dim: int) -> bool:
    """Whether the kernels take ``pool_len`` pooled keys of ``head_dim`` (Triton present)."""
    return triton is not None and pool_len <= MAX_POOL and head_dim <= MAX_HEAD_DIM


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _neighbour(rows, live, y, x, slot, HEIGHT, WIDTH, WS: tl.constexpr, SIGN: tl.constexpr):
    """Token index of window slot ``slot`` of tokens ``rows`` (SIGN=1), or of the token whose slot ``slot``
    is ``rows`` (SIGN=-1), and whether it lies in the map."""
    yy = y + SIGN * (slot // WS - WS // 2)
    xx = x + SIGN * (slot % WS - WS // 2)
    ok = live & (yy >= 0) & (yy < HEIGHT) & (xx >= 0) & (xx < WIDTH)
    return yy * WIDTH + xx, ok


@_jit
def _column(tile, cols, slot):
    """Column ``slot`` of a ``[BLOCK, LP]`` tile, ``[BLOCK]``."""
    return tl.sum(tl.where(cols[None, :] == slot, tile, 0.0), 1)


@_jit
def _program(HEADS, N, WIDTH, BLOCK: tl.constexpr):
    """This program's (image x head) ``bh``, its image ``b`` and head ``h``, and its block of tokens: indices
    ``rows``, which are in the map (``live``), their row ``y`` and column ``x``."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return bh, (bh // HEADS).to(tl.int64), (bh % HEADS).to(tl.int64), rows, rows < N, rows // WIDTH, rows % WIDTH


@_jit
def _attention(Q, K, KP, PB, LB, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_kpb, s_kph, s_kpn, HEADS, N, P, L, D, HEIGHT,
               WIDTH, WS: tl.constexpr, LP: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
               PRECISION: tl.constexpr):
    """This program's block of tokens (:func:`_program`) and its column indices (head dim ``cd``, pooled keys
    ``cp``, window slots ``cl``), with the queries ``[BLOCK, BD]`` (their dtype), the window logits ``[BLOCK,
    LP]`` and the pooled logits ``[BLOCK, BP]`` (masked slots and columns: -inf) and the pooled keys."""
    bh, b, h, rows, live, y, x = _program(HEADS, N, WIDTH, BLOCK)
    cd, cp, cl = tl.arange(0, BD), tl.arange(0, BP), tl.arange(0, LP)
    in_d, in_p = cd < D, cp < P
    q = tl.load(Q + b * s_qb + h * s_qh + rows[:, None] * s_qn + cd[None, :], mask=live[:, None] & in_d[None, :],
                other=0.0)
    qf = q.to(tl.float32)
    s_local = tl.full([BLOCK, LP], float("-inf"), tl.float32)
    for slot in tl.range(0, WS * WS):
        nb, ok = _neighbour(rows, live, y, x, slot, HEIGHT, WIDTH, WS, 1)
        k = tl.load(K + b * s_kb + h * s_kh + nb[:, None] * s_kn + cd[None, :], mask=ok[:, None] & in_d[None, :],
                    other=0.0)
        s = tl.sum(qf * k.to(tl.float32), 1) + tl.load(LB + h * L + slot).to(tl.float32)
        s_local = tl.where(cl[None, :] == slot, tl.where(ok, s, float("-inf"))[:, None], s_local)
    kp = tl.load(KP + b * s_kpb + h * s_kph + cp[:, None] * s_kpn + cd[None, :], mask=in_p[:, None] & in_d[None, :],
                 other=0.0)
    s_pool = tl.dot(q, tl.trans(kp), input_precision=PRECISION)
    bias = tl.load(PB + h * N * P + rows[:, None] * P + cp[None, :], mask=live[:, None] & in_p[None, :], other=0.0)
    s_pool = tl.where(in_p[None, :], s_pool + bias.to(tl.float32), float("-inf"))
    return bh, b, h, rows, live, y, x, cd, in_d, cp, in_p, cl, q, s_local, s_pool, kp


@_jit
def _forward(Q, K, V, KP, VP, PB, LB, LW, O, LSE,
             s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_kpb, s_kph, s_kpn, s_vpb, s_vph, s_vpn,
             HEADS, N, P, L, D, HEIGHT, WIDTH,
             WS: tl.constexpr, LP: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
             PRECISION: tl.constexpr):
    bh, b, h, rows, live, y, x, cd, in_d, cp, in_p, cl, q, s_local, s_pool, kp = _attention(
        Q, K, KP, PB, LB, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_kpb, s_kph, s_kpn, HEADS, N, P, L, D, HEIGHT, WIDTH,
        WS, LP, BLOCK, BD, BP, PRECISION)
    top = tl.maximum(tl.max(s_local, 1), tl.max(s_pool, 1))
    e_local, e_pool = tl.exp(s_local - top[:, None]), tl.exp(s_pool - top[:, None])
    total = tl.sum(e_local, 1) + tl.sum(e_pool, 1)
    lw = tl.load(LW + bh.to(tl.int64) * N * L + rows[:, None] * L + cl[None, :],
                 mask=live[:, None] & (cl[None, :] < L), other=0.0)
    weight = e_local / total[:, None] + lw.to(tl.float32)  # padded slots read zero values below
    vp = tl.load(VP + b * s_vpb + h * s_vph + cp[:, None] * s_vpn + cd[None, :], mask=in_p[:, None] & in_d[None, :],
                 other=0.0)
    out = tl.dot((e_pool / total[:, None]).to(vp.dtype), vp, input_precision=PRECISION)
    for slot in tl.range(0, WS * WS):
        nb, ok = _neighbour(rows, live, y, x, slot, HEIGHT, WIDTH, WS, 1)
        v = tl.load(V + b * s_vb + h * s_vh + nb[:, None] * s_vn + cd[None, :], mask=ok[:, None] & in_d[None, :],
                    other=0.0)
        out += _column(weight, cl, slot)[:, None] * v.to(tl.float32)
    o_rows = bh.to(tl.int64) * N + rows
    tl.store(O + o_rows[:, None] * D + cd[None, :], out.to(O.dtype.element_ty), mask=live[:, None] & in_d[None, :])
    tl.store(LSE + o_rows, top + tl.log(total), mask=live)


@_jit
def _backward_queries(Q, K, V, KP, VP, PB, LB, LW, LSE, DO, DQ, DLW, DSL, AL, DKP, DVP, DPB,
                      s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_kpb, s_kph, s_kpn, s_vpb, s_vph, s_vpn,
                      HEADS, N, P, L, D, HEIGHT, WIDTH,
                      WS: tl.constexpr, LP: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
                      PRECISION: tl.constexpr):
    bh, b, h, rows, live, y, x, cd, in_d, cp, in_p, cl, q, s_local, s_pool, kp = _attention(
        Q, K, KP, PB, LB, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_kpb, s_kph, s_kpn, HEADS, N, P, L, D, HEIGHT, WIDTH,
        WS, LP, BLOCK, BD, BP, PRECISION)
    in_l = cl < L
    o_rows = bh.to(tl.int64) * N + rows
    lse = tl.load(LSE + o_rows, mask=live, other=0.0)
    p_local, p_pool = tl.exp(s_local - lse[:, None]), tl.exp(s_pool - lse[:, None])
    grad = tl.load(DO + o_rows[:, None] * D + cd[None, :], mask=live[:, None] & in_d[None, :], other=0.0)
    gf = grad.to(tl.float32)
    g_local = tl.zeros([BLOCK, LP], dtype=tl.float32)  # d out / d (weight of slot l) = grad . v[n + o_l]
    for slot in tl.range(0, WS * WS):
        nb, ok = _neighbour(rows, live, y, x, slot, HEIGHT, WIDTH, WS, 1)
        v = tl.load(V + b * s_vb + h * s_vh + nb[:, None] * s_vn + cd[None, :], mask=ok[:, None] & in_d[None, :],
                    other=0.0)
        g_local = tl.where(cl[None, :] == slot, tl.sum(gf * v.to(tl.float32), 1)[:, None], g_local)
    vp = tl.load(VP + b * s_vpb + h * s_vph + cp[:, None] * s_vpn + cd[None, :], mask=in_p[:, None] & in_d[None, :],
                 other=0.0)
    g_pool = tl.dot(grad, tl.trans(vp), input_precision=PRECISION)
    delta = tl.sum(p_local * g_local, 1) + tl.sum(p_pool * g_pool, 1)
    ds_local = p_local * (g_local - delta[:, None])
    ds_pool = tl.where(live[:, None], p_pool * (g_pool - delta[:, None]), 0.0)

    dq = tl.dot(ds_pool.to(kp.dtype), kp, input_precision=PRECISION)
    for slot in tl.range(0, WS * WS):
        nb, ok = _neighbour(rows, live, y, x, slot, HEIGHT, WIDTH, WS, 1)
        k = tl.load(K + b * s_kb + h * s_kh + nb[:, None] * s_kn + cd[None, :], mask=ok[:, None] & in_d[None, :],
                    other=0.0)
        dq += _column(ds_local, cl, slot)[:, None] * k.to(tl.float32)
    tl.store(DQ + o_rows[:, None] * D + cd[None, :], dq.to(DQ.dtype.element_ty), mask=live[:, None] & in_d[None, :])

    slots = o_rows[:, None] * L + cl[None, :]
    live_slots = live[:, None] & in_l[None, :]
    lw = tl.load(LW + slots, mask=live_slots, other=0.0).to(tl.float32)
    tl.store(DLW + slots, g_local.to(DLW.dtype.element_ty), mask=live_slots)
    tl.store(DSL + slots, ds_local, mask=live_slots)
    tl.store(AL + slots, p_local + lw, mask=live_slots)

    pool = bh.to(tl.int64) * P * D + cp[:, None] * D + cd[None, :]
    in_pd = in_p[:, None] & in_d[None, :]
    tl.atomic_add(DKP + pool, tl.dot(tl.trans(ds_pool.to(q.dtype)), q, input_precision=PRECISION), mask=in_pd)
    tl.atomic_add(DVP + pool, tl.dot(tl.trans(p_pool.to(grad.dtype)), grad, input_precision=PRECISION), mask=in_pd)
    tl.atomic_add(DPB + h * N * P + rows[:, None] * P + cp[None, :], ds_pool, mask=live[:, None] & in_p[None, :])


@_jit
def _backward_keys(Q, DO, DSL, AL, DK, DV, s_qb, s_qh, s_qn,
                   HEADS, N, L, D, HEIGHT, WIDTH,
                   WS: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr):
    bh, b, h, rows, live, y, x = _program(HEADS, N, WIDTH, BLOCK)
    cd = tl.arange(0, BD)
    in_d = cd < D
    first = bh.to(tl.int64) * N
    dk = tl.zeros([BLOCK, BD], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BD], dtype=tl.float32)
    for slot in tl.range(0, WS * WS):  # the query whose window slot ``slot`` is this key
        m, ok = _neighbour(rows, live, y, x, slot, HEIGHT, WIDTH, WS, -1)
        ds = tl.load(DSL + (first + m) * L + slot, mask=ok, other=0.0)
        a = tl.load(AL + (first + m) * L + slot, mask=ok, other=0.0)
        q = tl.load(Q + b * s_qb + h * s_qh + m[:, None] * s_qn + cd[None, :], mask=ok[:, None] & in_d[None, :],
                    other=0.0)
        g = tl.load(DO + (first + m)[:, None] * D + cd[None, :], mask=ok[:, None] & in_d[None, :], other=0.0)
        dk += ds[:, None] * q.to(tl.float32)
        dv += a[:, None] * g.to(tl.float32)
    out = (first + rows)[:, None] * D + cd[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=live[:, None] & in_d[None, :])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=live[:, None] & in_d[None, :])


# ---- Launchers -------------------------------------------------------------------------------
def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _strides(t: Tensor) -> Tuple[int, int, int]:
    """(image, head, token) strides of a ``[B, h, N, d]`` tensor whose rows are contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _config(q: Tensor, pool_len: int) -> dict:
    B, h, N, d = q.shape
    bp = _pow2(pool_len)
    block = max(16, min(64, 8192 // bp))  # the [BLOCK, BP] logits stay in registers
    return dict(grid=(triton.cdiv(N, block), B * h), BLOCK=block, BD=_pow2(d), BP=bp,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def forward(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, size, window) -> Tuple[Tensor, Tensor]:
    q, k, v, k_pool, v_pool = map(_rows, (q, k, v, k_pool, v_pool))
    pool_bias, local_bias, local_weight = (t.contiguous() for t in (pool_bias, local_bias, local_weight))
    B, h, N, d = q.shape
    P, L = k_pool.shape[-2], window * window
    cfg = _config(q, P)
    out = torch.empty(B, h, N, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, h, N, dtype=torch.float32, device=q.device)
    _forward[cfg["grid"]](q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, out, lse,
                          *_strides(q), *_strides(k), *_strides(v), *_strides(k_pool), *_strides(v_pool),
                          h, N, P, L, d, size[0], size[1], WS=window, LP=_pow2(L, 2), BLOCK=cfg["BLOCK"],
                          BD=cfg["BD"], BP=cfg["BP"], PRECISION=cfg["PRECISION"], num_warps=NUM_WARPS)
    return out, lse


def backward(grad, q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, size, window):
    inputs = (q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight)
    q, k, v, k_pool, v_pool = map(_rows, (q, k, v, k_pool, v_pool))
    pool_bias, local_bias, local_weight, grad, lse = (t.contiguous() for t in
                                                      (pool_bias, local_bias, local_weight, grad, lse))
    B, h, N, d = q.shape
    P, L = k_pool.shape[-2], window * window
    cfg = _config(q, P)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.empty(B, h, N, d, dtype=q.dtype, device=q.device)
    d_weight = torch.empty(B, h, N, L, dtype=local_weight.dtype, device=q.device)
    ds_local, weight = torch.empty(B, h, N, L, **f32), torch.empty(B, h, N, L, **f32)
    dk_pool, dv_pool, d_bias = torch.zeros(B, h, P, d, **f32), torch.zeros(B, h, P, d, **f32), torch.zeros(h, N, P, **f32)
    meta = dict(WS=window, LP=_pow2(L, 2), BLOCK=cfg["BLOCK"], BD=cfg["BD"], BP=cfg["BP"], PRECISION=cfg["PRECISION"],
                num_warps=NUM_WARPS)
    _backward_queries[cfg["grid"]](q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, lse, grad, dq,
                                   d_weight, ds_local, weight, dk_pool, dv_pool, d_bias,
                                   *_strides(q), *_strides(k), *_strides(v), *_strides(k_pool), *_strides(v_pool),
                                   h, N, P, L, d, size[0], size[1], **meta)
    dk = torch.empty(B, h, N, d, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, h, N, d, dtype=v.dtype, device=q.device)
    _backward_keys[cfg["grid"]](q, grad, ds_local, weight, dk, dv, *_strides(q), h, N, L, d, size[0], size[1],
                                WS=window, BLOCK=cfg["BLOCK"], BD=cfg["BD"], num_warps=NUM_WARPS)
    grads = (dq, dk, dv, dk_pool, dv_pool, d_bias, ds_local.sum((0, 2)), d_weight)
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))
