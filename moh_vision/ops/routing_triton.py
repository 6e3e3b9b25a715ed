"""MoH's routing and gated merge as one Triton kernel each way (``kernels.routing=fused``, the CUDA default).

:func:`~moh_vision.ops.routing.route_merge_reference` per block of tokens: from the stacked logits ``[T, L]`` the routed
softmax, the top-k (ties: the lower head), the renormalised routed gates, the mix and the shared softmax, written as the
gates ``[T, h]``; the heads times their gates in the merged layout ``[T, h d]``; per routed head the sums over tokens
of the probabilities and the selection (atomics: the load-balance loss). Backward: from the merged output's gradient
the heads' and the logits', one more kernel. Layers that route (``topk > 0``) only; CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1`` (``tests/test_fused_routing.py``). On an H100 (bf16) it took MoH-DiT-B/2's training step from
1.48x to 1.26x dense's."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .dispatch import RUNS
from .triton import tl, triton

Tensor = torch.Tensor
BLOCK_TOKENS, MERGE_COLUMNS = 32, 8  # tokens a block, a head's columns a step of the gated merge


def _jit(fn):
    """``triton.jit`` (Triton's interpreter under ``TRITON_INTERPRET=1``); the bare function without triton."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _mix_weights(z_base, live, R: tl.constexpr, BLOCK: tl.constexpr):
    """The two-stage mix ``2 softmax(wg_0 x)`` of a block of tokens: ``(mu0, mu1)``, each ``[BLOCK]``."""
    m0 = tl.load(z_base + R, mask=live, other=0.0).to(tl.float32)
    m1 = tl.load(z_base + R + 1, mask=live, other=0.0).to(tl.float32)
    top = tl.maximum(m0, m1)
    e0 = tl.exp(m0 - top)
    e1 = tl.exp(m1 - top)
    return 2.0 * e0 / (e0 + e1), 2.0 * e1 / (e0 + e1)


@_jit
def _shared_gates(z_row, live, R: tl.constexpr, HS: tl.constexpr, HSP: tl.constexpr):
    """``h_s softmax(wg_1 x)`` of a block of tokens, ``[BLOCK, HSP]`` (columns past ``h_s``: 0)."""
    cs = tl.arange(0, HSP)
    in_s = cs[None, :] < HS
    zs = tl.load(z_row + R + 2 + cs[None, :], mask=live[:, None] & in_s, other=float("-inf")).to(tl.float32)
    es = tl.where(in_s, tl.exp(zs - tl.max(zs, 1)[:, None]), 0.0)
    return es / tl.sum(es, 1)[:, None] * HS


@_jit
def _column(t, j):
    """Column ``j`` of a ``[BLOCK, C]`` block held in registers, ``[BLOCK]``."""
    cols = tl.arange(0, t.shape[1])
    return tl.sum(tl.where(cols[None, :] == j, t, 0.0), 1)


@_jit
def _head_tile(O, rows, live, head, c0, N, sob, soh, son, sod, D: tl.constexpr, DC: tl.constexpr):
    """Pointers to columns ``c0 .. c0 + DC`` of head ``head``'s outputs ``o[b, head, n, :]`` for a block of tokens
    (``t = b N + n``), ``[BLOCK, DC]``, and their mask."""
    cd = c0 + tl.arange(0, DC)
    r64 = rows.to(tl.int64)
    base = O + (r64 // N) * sob + head * soh + (r64 % N) * son
    return base[:, None] + cd[None, :] * sod, live[:, None] & (cd[None, :] < D)


@_jit
def _merge_head(O, OUT, rows, live, head, gate, N, sob, soh, son, sod, H: tl.constexpr, D: tl.constexpr,
                DC: tl.constexpr):
    """``merged[t, head d : (head + 1) d] = o[b, head, n, :] * gate_t`` (the gate cast to o's dtype first, as
    ``merge_heads`` multiplies), ``DC`` columns at a time (a ``[BLOCK, d]`` tile of 64-bit pointers would not fit
    in registers)."""
    g = gate.to(O.dtype.element_ty)[:, None]
    out_row = OUT + rows.to(tl.int64)[:, None] * (H * D) + head * D
    for c0 in range(0, D, DC):
        ptrs, ok = _head_tile(O, rows, live, head, c0, N, sob, soh, son, sod, D, DC)
        o = tl.load(ptrs, mask=ok, other=0.0)
        tl.store(out_row + c0 + tl.arange(0, DC)[None, :], o * g, mask=ok)


@_jit
def _merge_head_backward(O, GM, DO, rows, live, head, gate, N, sob, soh, son, sod, sdb, sdh, sdn, sdd,
                         H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
    """The merge's backward for one head of a block of tokens: writes o's gradient (the merged output's times the
    gate) and returns the gate's (the sum over d of the merged output's gradient times o, float32), ``[BLOCK]``."""
    g = gate.to(O.dtype.element_ty)[:, None]
    dy_row = GM + rows.to(tl.int64)[:, None] * (H * D) + head * D
    dot = tl.zeros(gate.shape, tl.float32)
    for c0 in range(0, D, DC):
        ptrs, ok = _head_tile(O, rows, live, head, c0, N, sob, soh, son, sod, D, DC)
        o = tl.load(ptrs, mask=ok, other=0.0)
        dy = tl.load(dy_row + c0 + tl.arange(0, DC)[None, :], mask=ok, other=0.0)
        dptrs, _ = _head_tile(DO, rows, live, head, c0, N, sdb, sdh, sdn, sdd, D, DC)
        tl.store(dptrs, dy * g, mask=ok)
        dot += tl.sum(dy.to(tl.float32) * o.to(tl.float32), 1)
    return dot


@_jit
def _route_forward(Z, G, P, M, I, SUMS, T, stride_z, O, OUT, N, sob, soh, son, sod,
                   R: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, RP: tl.constexpr, HSP: tl.constexpr,
                   BLOCK: tl.constexpr, EPS: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < T
    z_base = Z + rows.to(tl.int64) * stride_z
    z_row = z_base[:, None]
    cr = tl.arange(0, RP)
    in_r = cr[None, :] < R
    zr = tl.load(z_row + cr[None, :], mask=live[:, None] & in_r, other=float("-inf")).to(tl.float32)
    e = tl.exp(zr - tl.max(zr, 1)[:, None])
    e = tl.where(in_r, e, 0.0)
    p = e / tl.sum(e, 1)[:, None]
    p_ptrs = P + rows.to(tl.int64)[:, None] * R + cr[None, :]
    tl.store(p_ptrs, p.to(P.dtype.element_ty), mask=live[:, None] & in_r)
    p = p.to(P.dtype.element_ty).to(tl.float32)  # top-k compares the stored (rounded) probabilities
    chosen = tl.zeros([BLOCK, RP], dtype=tl.int1)
    for slot in tl.static_range(K):  # K passes of an argmax; the lower head on ties
        candidates = tl.where(chosen | (cr[None, :] >= R), -1.0, p)
        best = tl.max(candidates, 1)
        first = tl.min(tl.where(candidates == best[:, None], cr[None, :], RP), 1)
        tl.store(I + rows.to(tl.int64) * K + slot, first.to(tl.int64), mask=live)
        chosen = chosen | (cr[None, :] == first[:, None])
    kept = tl.maximum(tl.sum(tl.where(chosen, p, 0.0), 1), EPS)
    mu0 = tl.full([BLOCK], 1.0, tl.float32)
    mu1 = tl.full([BLOCK], 1.0, tl.float32)
    if HS > 0:
        mu0, mu1 = _mix_weights(z_base, live, R, BLOCK)
    g_row = G + rows.to(tl.int64)[:, None] * (HS + R)
    routed = tl.where(chosen, p * (K / kept * mu1)[:, None], 0.0)
    tl.store(g_row + HS + cr[None, :], routed.to(G.dtype.element_ty), mask=live[:, None] & in_r)
    tl.store(M + rows.to(tl.int64)[:, None] * R + cr[None, :], chosen.to(M.dtype.element_ty), mask=live[:, None] & in_r)
    if HS > 1:
        cs = tl.arange(0, HSP)
        in_s = cs[None, :] < HS
        shared = (_shared_gates(z_row, live, R, HS, HSP) * mu0[:, None]).to(G.dtype.element_ty)
        tl.store(g_row + cs[None, :], shared, mask=live[:, None] & in_s)
        for i in range(HS):  # a loop, not unrolled: one head's tile live at a time
            _merge_head(O, OUT, rows, live, i, _column(shared.to(tl.float32), i).to(G.dtype.element_ty), N,
                        sob, soh, son, sod, HS + R, D, DC)
    elif HS == 1:
        tl.store(G + rows.to(tl.int64) * (HS + R), mu0.to(G.dtype.element_ty), mask=live)
        _merge_head(O, OUT, rows, live, 0, mu0.to(G.dtype.element_ty), N, sob, soh, son, sod, HS + R, D, DC)
    stored = routed.to(G.dtype.element_ty).to(tl.float32)  # the gated merge of the routed heads, from the gates as stored
    for j in range(R):  # a loop, not unrolled: one head's tile live at a time
        _merge_head(O, OUT, rows, live, HS + j, _column(stored, j).to(G.dtype.element_ty), N, sob, soh, son, sod,
                    HS + R, D, DC)
    keep = live[:, None] & in_r  # per-head sums over tokens: the load-balance loss's me and ce (times T)
    tl.atomic_add(SUMS + cr, tl.sum(tl.where(keep, p, 0.0), 0), mask=cr < R)
    tl.atomic_add(SUMS + R + cr, tl.sum(tl.where(keep & chosen, 1.0, 0.0), 0), mask=cr < R)


@_jit
def _route_backward(GG, Z, P, M, SUMS, GL, DZ, T, stride_z, loss_scale, O, GM, DO, N, sob, soh, son, sod, sdb, sdh, sdn,
                    sdd, R: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, RP: tl.constexpr, HSP: tl.constexpr,
                    BLOCK: tl.constexpr, EPS: tl.constexpr, AUX: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
    # GG holds the gates; their gradient comes from the merged output's (GM), o's gradient (DO) on the way
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < T
    r64 = rows.to(tl.int64)
    z_base = Z + r64 * stride_z
    z_row = z_base[:, None]
    # DZ is contiguous, rows as wide as the logits (wg, then wg_0 where heads are shared, wg_1 where more than one)
    stride_dz = R + 2 * (HS > 0) + HS * (HS > 1)
    d_row = DZ + r64[:, None] * stride_dz
    gg_row = GG + r64[:, None] * (HS + R)
    cr = tl.arange(0, RP)
    in_r = cr[None, :] < R
    keep = live[:, None] & in_r
    mu0 = tl.full([BLOCK], 1.0, tl.float32)
    mu1 = tl.full([BLOCK], 1.0, tl.float32)
    if HS > 0:
        mu0, mu1 = _mix_weights(z_base, live, R, BLOCK)
    g_mu0 = tl.zeros([BLOCK], tl.float32)
    if HS > 1:
        cs = tl.arange(0, HSP)
        in_s = cs[None, :] < HS
        s = _shared_gates(z_row, live, R, HS, HSP)
        gates = tl.load(gg_row + cs[None, :], mask=live[:, None] & in_s, other=0.0).to(tl.float32)
        gs = tl.zeros([BLOCK, HSP], tl.float32)  # the gates' gradient, from the merge's
        for i in range(HS):  # a loop, not unrolled: one head's tile live at a time
            gi = _merge_head_backward(O, GM, DO, rows, live, i, _column(gates, i), N, sob, soh, son, sod, sdb, sdh,
                                      sdn, sdd, HS + R, D, DC)
            gs = tl.where(cs[None, :] == i, gi[:, None], gs)
        g_mu0 = tl.sum(s * gs, 1)
        dot = tl.sum(s / HS * mu0[:, None] * gs, 1)
        tl.store(d_row + R + 2 + cs[None, :], (s * (mu0[:, None] * gs - dot[:, None])).to(DZ.dtype.element_ty),
                 mask=live[:, None] & in_s)
    elif HS == 1:
        g_mu0 = tl.load(GG + r64 * (HS + R), mask=live, other=0.0).to(tl.float32)
        g_mu0 = _merge_head_backward(O, GM, DO, rows, live, 0, g_mu0, N, sob, soh, son, sod, sdb, sdh, sdn, sdd,
                                     HS + R, D, DC)
    p = tl.load(P + r64[:, None] * R + cr[None, :], mask=keep, other=0.0).to(tl.float32)
    m = tl.load(M + r64[:, None] * R + cr[None, :], mask=keep, other=0.0).to(tl.float32)
    gates = tl.load(gg_row + HS + cr[None, :], mask=keep, other=0.0).to(tl.float32)
    g = tl.zeros([BLOCK, RP], tl.float32)
    for j in range(R):  # a loop, not unrolled: one head's tile live at a time
        gj = _merge_head_backward(O, GM, DO, rows, live, HS + j, _column(gates, j), N, sob, soh, son, sod, sdb, sdh,
                                  sdn, sdd, HS + R, D, DC)
        g = tl.where(cr[None, :] == j, gj[:, None], g)
    kept = tl.maximum(tl.sum(m * p, 1), EPS)
    q = p / kept[:, None]
    gr = g * mu1[:, None]
    weighted = tl.sum(m * q * gr, 1)
    g_mu1 = tl.sum(m * q * K * g, 1)
    dz = m * q * K * (gr - weighted[:, None])
    if AUX:  # the loss R * sum_j me_j ce_j: dL/dp_tj = R * ce_j / T * dL
        ce = tl.load(SUMS + R + cr, mask=cr < R, other=0.0) / T
        a = tl.where(in_r, (ce * loss_scale)[None, :] * tl.load(GL).to(tl.float32), 0.0)
        dz += p * (a - tl.sum(p * a, 1)[:, None])
    tl.store(d_row + cr[None, :], dz.to(DZ.dtype.element_ty), mask=keep)
    if HS > 0:
        centre = mu0 / 2 * g_mu0 + mu1 / 2 * g_mu1
        tl.store(DZ + r64 * stride_dz + R, (mu0 * (g_mu0 - centre)).to(DZ.dtype.element_ty), mask=live)
        tl.store(DZ + r64 * stride_dz + R + 1, (mu1 * (g_mu1 - centre)).to(DZ.dtype.element_ty), mask=live)


def _meta(routed: int, shared: int, topk: int, dtype: torch.dtype, head_dim: int) -> dict:
    """The kernels' compile-time arguments and warps: blocks of 32 tokens, 8 columns of a head at a time, 8 warps
    (compiled for sm_90, bf16 or float32, the two kernels then need at most 64 registers a thread and spill nothing,
    ``tests/test_fused_routing.py``; with 16 columns they needed up to 100 and the float32 forward spilled)."""
    return dict(R=routed, HS=shared, K=topk, RP=max(2, triton.next_power_of_2(routed)),
                HSP=max(2, triton.next_power_of_2(max(shared, 1))), BLOCK=BLOCK_TOKENS,
                EPS=float(torch.finfo(dtype).eps), D=head_dim,
                DC=min(triton.next_power_of_2(head_dim), MERGE_COLUMNS), num_warps=8)


def token_rows(logits: Tensor) -> Tensor:
    """The logits as rows ``[T, L]`` with a unit column stride: a view where the layout allows it (e.g. the routers'
    columns of a wider GEMM output, e.g. a slice of a wider GEMM output), else a contiguous copy."""
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _forward_outputs(z: Tensor, routed: int, shared: int, topk: int, out_dtype: torch.dtype) -> Tuple[Tensor, ...]:
    """What the forward kernel writes for the logits' rows ``z`` ``[T, L]``: gates, probabilities, selection,
    selected heads, and the per-head sums over tokens (zeroed: the kernel adds into them)."""
    T = z.shape[0]
    return (z.new_empty(T, shared + routed, dtype=out_dtype), z.new_empty(T, routed, dtype=out_dtype),
            z.new_empty(T, routed, dtype=out_dtype), torch.empty(T, topk, dtype=torch.long, device=z.device),
            torch.zeros(2 * routed, dtype=torch.float32, device=z.device))


def _balance_loss(sums: Tensor, routed: int, tokens: int, with_loss: bool) -> Tensor:
    """The load-balance loss from the kernel's per-head sums (an empty tensor without it)."""
    return (sums[:routed] * sums[routed:]).sum() * (routed / (tokens * tokens)) if with_loss else sums[:0]


def _gates_dtype(logits: Tensor) -> torch.dtype:
    """float32 under autocast (low-precision logits), as autocast's softmax gives it; else the logits' dtype."""
    return torch.float32 if torch.is_autocast_enabled(logits.device.type) else logits.dtype


class TritonRouteMerge(torch.autograd.Function):
    """:func:`~moh_vision.ops.routing.route_merge_fused` on the Triton kernels (``topk > 0``): the routing
    and the gated merge of the heads ``[B, h, N, d]`` (any strides) in one kernel each way."""

    @staticmethod
    def forward(ctx, heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool,
                out_dtype: torch.dtype, formula: Optional[Callable] = None):
        B, h, N, d = heads.shape
        lead = logits.shape[:-1]
        z = token_rows(logits)
        T = z.shape[0]
        merged = heads.new_empty(B, N, h * d)
        gates, probs, mask, index, sums = _forward_outputs(z, routed, shared, topk, out_dtype)
        _route_forward[(triton.cdiv(T, BLOCK_TOKENS),)](z, gates, probs, mask, index, sums, T, z.stride(0), heads,
                                                        merged, N, *heads.stride(),
                                                        **_meta(routed, shared, topk, out_dtype, d))
        loss = _balance_loss(sums, routed, T, with_loss)
        ctx.save_for_backward(z, heads, gates, probs, mask, sums)
        ctx.layout, ctx.lead, ctx.formula = (routed, shared, topk), lead, formula
        ctx.mark_non_differentiable(gates, probs, mask, index)  # the gates act through the merged output
        ctx.set_materialize_grads(False)
        return (merged, gates.view(*lead, -1), probs.view(*lead, -1), mask.view(*lead, -1), index.view(*lead, -1), loss)

    @staticmethod
    def backward(ctx, grad_merged, _gates, _probs, _mask, _index, grad_loss):
        heads = ctx.saved_tensors[1]
        aux = grad_loss is not None and grad_loss.dim() == 0
        args = (ctx, grad_merged, grad_loss if aux else None)
        if ctx.formula is None:
            grad_heads, grad = _backward_kernel(*args)
        else:  # the formulas' gradients where the kernel fails on its first call on this device (ops.dispatch)
            grad_heads, grad = RUNS.guarded("moh_routing", "fused backward kernel", heads.device.type,
                                            _backward_kernel, _backward_formulas, args)
        return grad_heads, grad.view(*ctx.lead, -1), None, None, None, None, None, None


def _backward_kernel(ctx, grad_merged: Optional[Tensor], grad_loss: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The heads' gradient and the logits' rows' ``[T, L]``, by the backward kernel."""
    z, heads, gates, probs, mask, sums = ctx.saved_tensors
    routed, shared, topk = ctx.layout
    B, h, N, d = heads.shape
    T = z.shape[0]
    if grad_merged is None:  # only the loss was used
        grad_merged = heads.new_zeros(B, N, h * d)
    grad_merged = grad_merged.contiguous()
    aux = grad_loss is not None
    grad = z.new_empty(z.shape)  # contiguous, whatever the logits' row stride
    grad_heads = torch.empty_like(heads)  # o's own layout, as attention's backward expects
    _route_backward[(triton.cdiv(T, BLOCK_TOKENS),)](gates, z, probs, mask, sums, grad_loss if aux else sums, grad,
                                                     T, z.stride(0), float(routed) / T, heads, grad_merged,
                                                     grad_heads, N, *heads.stride(), *grad_heads.stride(),
                                                     AUX=aux, **_meta(routed, shared, topk, probs.dtype, d))
    return grad_heads, grad


def _backward_formulas(ctx, grad_merged: Optional[Tensor], grad_loss: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The same gradients through the formulas the forward was given
    (:func:`~moh_vision.ops.routing.route_merge_reference`; the logits read in the gates' dtype, as the kernels compute
    them), recomputed from the saved heads and logits."""
    z, heads, gates = ctx.saved_tensors[:3]
    routed, shared, topk = ctx.layout
    with torch.enable_grad():
        heads_, z_ = heads.detach().requires_grad_(), z.detach().requires_grad_()
        logits = z_.view(*ctx.lead, -1).to(gates.dtype)
        merged, routing = ctx.formula(heads_, logits, routed, shared, topk, grad_loss is not None)
        pairs = [(out, g) for out, g in ((merged, grad_merged), (routing.loss, grad_loss)) if g is not None]
        grads = torch.autograd.grad([out for out, _ in pairs], (heads_, z_), [g for _, g in pairs],
                                    allow_unused=True) if pairs else (None, None)
    grad_heads, grad = (torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, (heads, z)))
    return grad_heads, grad


def triton_route_merge(heads: Tensor, logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool,
                       formula: Optional[Callable] = None) -> Tuple[Tensor, ...]:
    """(merged, gates, probs, mask, index, loss or an empty tensor); float32 gates under autocast, as autocast's
    softmax gives them to the formulas. ``formula``: the routing's formulas, whose gradients backward takes where its
    kernel fails on its first call (none: the kernel's error is raised)."""
    return TritonRouteMerge.apply(heads, logits, routed, shared, topk, with_loss, _gates_dtype(logits), formula)
