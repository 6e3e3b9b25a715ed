"""MoH's routing as one Triton kernel each way: the CUDA twin of ``csrc/moh_routing.cpp``.

The same computation as the C++ kernel (:mod:`~moh_vision.attention.fused_routing`): from the stacked
routers' logits ``[T, L]`` (``wg`` R routed, ``wg_0`` 2 when ``h_s > 0``, ``wg_1`` h_s when ``h_s > 1``), per
block of tokens, the routed softmax, the top-k (ties: the lower head), the renormalised routed gates, the
two-stage mix and the shared softmax, written as the gates ``[T, h]``; per routed head, the sums over tokens
of the probabilities and of the selection (atomics), from which the load-balance loss is two more operators.
Backward: the logits' gradient from the gates' and the loss's, one more kernel. Layers that route (``topk >
0``) only; a dense-weighted layer (every head shared) runs the formulas.

Where it runs: eager calls on CUDA tensors when Triton is installed (``MOH_VISION_FUSED_ROUTING=0`` turns it
off), or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before Python
starts), which is how ``tests/test_fused_routing.py`` checks it against the formulas. ``tools/gpu_checks.sh``
runs those checks compiled and times it on a GPU: on an H100 in bf16 it took MoH's time over dense's from
1.42x to 1.24x (DiT-B/2 inference) and 1.48x to 1.26x (training), and lowered it for DiT-S/2 and
TransNeXt-Base too (``docs/performance.md``).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .triton_moh import tl, triton

Tensor = torch.Tensor
BLOCK_TOKENS = 64


def _jit(fn):
    """``triton.jit`` (which gives Triton's interpreter under ``TRITON_INTERPRET=1``); the bare function without
    triton."""
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
def _route_forward(Z, G, P, M, I, SUMS, T, stride_z,
                   R: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, RP: tl.constexpr, HSP: tl.constexpr,
                   BLOCK: tl.constexpr, EPS: tl.constexpr):
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
    tl.store(M + rows.to(tl.int64)[:, None] * R + cr[None, :], chosen.to(M.dtype.element_ty),
             mask=live[:, None] & in_r)
    if HS > 1:
        cs = tl.arange(0, HSP)
        in_s = cs[None, :] < HS
        s = _shared_gates(z_row, live, R, HS, HSP)
        tl.store(g_row + cs[None, :], (s * mu0[:, None]).to(G.dtype.element_ty), mask=live[:, None] & in_s)
    elif HS == 1:
        tl.store(G + rows.to(tl.int64) * (HS + R), mu0.to(G.dtype.element_ty), mask=live)
    keep = live[:, None] & in_r  # per-head sums over tokens: the load-balance loss's me and ce (times T)
    tl.atomic_add(SUMS + cr, tl.sum(tl.where(keep, p, 0.0), 0), mask=cr < R)
    tl.atomic_add(SUMS + R + cr, tl.sum(tl.where(keep & chosen, 1.0, 0.0), 0), mask=cr < R)


@_jit
def _route_backward(GG, Z, P, M, SUMS, GL, DZ, T, stride_z, loss_scale,
                    R: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, RP: tl.constexpr, HSP: tl.constexpr,
                    BLOCK: tl.constexpr, EPS: tl.constexpr, AUX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < T
    r64 = rows.to(tl.int64)
    z_base = Z + r64 * stride_z
    z_row = z_base[:, None]
    d_row = DZ + r64[:, None] * stride_z
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
        gs = tl.load(gg_row + cs[None, :], mask=live[:, None] & in_s, other=0.0).to(tl.float32)
        g_mu0 = tl.sum(s * gs, 1)
        dot = tl.sum(s / HS * mu0[:, None] * gs, 1)
        tl.store(d_row + R + 2 + cs[None, :], (s * (mu0[:, None] * gs - dot[:, None])).to(DZ.dtype.element_ty),
                 mask=live[:, None] & in_s)
    elif HS == 1:
        g_mu0 = tl.load(GG + r64 * (HS + R), mask=live, other=0.0).to(tl.float32)
    p = tl.load(P + r64[:, None] * R + cr[None, :], mask=keep, other=0.0).to(tl.float32)
    m = tl.load(M + r64[:, None] * R + cr[None, :], mask=keep, other=0.0).to(tl.float32)
    g = tl.load(gg_row + HS + cr[None, :], mask=keep, other=0.0).to(tl.float32)
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
        tl.store(DZ + r64 * stride_z + R, (mu0 * (g_mu0 - centre)).to(DZ.dtype.element_ty), mask=live)
        tl.store(DZ + r64 * stride_z + R + 1, (mu1 * (g_mu1 - centre)).to(DZ.dtype.element_ty), mask=live)


def _meta(routed: int, shared: int, topk: int, dtype: torch.dtype) -> dict:
    return dict(R=routed, HS=shared, K=topk, RP=max(2, triton.next_power_of_2(routed)),
                HSP=max(2, triton.next_power_of_2(max(shared, 1))), BLOCK=BLOCK_TOKENS,
                EPS=float(torch.finfo(dtype).eps))


class TritonRoute(torch.autograd.Function):
    """:func:`~moh_vision.attention.fused_routing.fused_route` on the Triton kernels (``topk > 0``)."""

    @staticmethod
    def forward(ctx, logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool, out_dtype: torch.dtype):
        lead = logits.shape[:-1]
        z = logits.reshape(-1, logits.shape[-1]).contiguous()
        T = z.shape[0]
        gates = z.new_empty(T, shared + routed, dtype=out_dtype)
        probs, mask = z.new_empty(T, routed, dtype=out_dtype), z.new_empty(T, routed, dtype=out_dtype)
        index = torch.empty(T, topk, dtype=torch.long, device=z.device)
        sums = torch.zeros(2 * routed, dtype=torch.float32, device=z.device)
        _route_forward[(triton.cdiv(T, BLOCK_TOKENS),)](z, gates, probs, mask, index, sums, T, z.stride(0),
                                             **_meta(routed, shared, topk, out_dtype))
        loss = (sums[:routed] * sums[routed:]).sum() * (routed / (T * T)) if with_loss else sums[:0]
        ctx.save_for_backward(z, probs, mask, sums)
        ctx.layout, ctx.lead = (routed, shared, topk), lead
        ctx.mark_non_differentiable(probs, mask, index)
        ctx.set_materialize_grads(False)
        return (gates.view(*lead, -1), probs.view(*lead, -1), mask.view(*lead, -1), index.view(*lead, -1), loss)

    @staticmethod
    def backward(ctx, grad_gates, _probs, _mask, _index, grad_loss):
        z, probs, mask, sums = ctx.saved_tensors
        routed, shared, topk = ctx.layout
        T = z.shape[0]
        if grad_gates is None:
            grad_gates = z.new_zeros(T, shared + routed)
        grad_gates = grad_gates.reshape(T, shared + routed).contiguous()
        dtype = probs.dtype
        aux = grad_loss is not None and grad_loss.dim() == 0
        grad = torch.empty_like(z)
        _route_backward[(triton.cdiv(T, BLOCK_TOKENS),)](grad_gates, z, probs, mask, sums, grad_loss if aux else sums, grad, T,
                                             z.stride(0), float(routed) / T, AUX=aux,
                                             **_meta(routed, shared, topk, dtype))
        return grad.view(*ctx.lead, -1), None, None, None, None, None


def triton_route(logits: Tensor, routed: int, shared: int, topk: int, with_loss: bool) -> Tuple[Tensor, ...]:
    """(gates, probs, mask, index, loss or an empty tensor), as ``torch.ops.moh_routing.route`` returns them.
    Under autocast (low-precision logits) the gates and probabilities are float32, as autocast's softmax gives
    them to the formulas."""
    autocast = torch.is_autocast_enabled(logits.device.type)
    return TritonRoute.apply(logits, routed, shared, topk, with_loss, torch.float32 if autocast else logits.dtype)
