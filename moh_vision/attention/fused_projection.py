"""MoH's routers inside the query/key/value projection: one GEMM gives ``qkv`` and the routers' logits.

A MoH layer keeps its official parameters, ``qkv.weight`` ``[3hd, C]``, ``qkv.bias``, ``wg.weight``,
``wg_0.weight``, ``wg_1.weight`` (the official checkpoints' keys and shapes), but :func:`pack_rows` lays their
values out in one storage: the weights as consecutive rows of one ``[3hd + L, C]`` tensor (each parameter a view
of its rows, in the order of ``MoH.routers``; zero rows after them up to a multiple of 16, :data:`ROW_ALIGN`),
``qkv.bias`` as the first ``3hd`` entries of a tensor as long whose other entries are zeros (the routers have no
bias) and that nothing else refers to. One ``addmm`` over those two tensors is then the ``qkv`` projection with
the logits as the ``L`` columns after it: no weight is copied per call and nothing derived is cached, the
parameters are the storage. Its backward writes the gradients of ``qkv`` and of the logits into one buffer and
runs the two GEMMs of a linear layer once, for all of them (a weight's gradient is a view of its rows).

The layout is made when the layer is built, after every ``Module._apply`` (``.to()``, ``.double()``,
``.cuda()`` give each parameter a storage of its own), after ``copy.deepcopy`` (which clones each parameter apart:
EMA copies) and after ``load_state_dict(assign=True)``; copying into the parameters (``load_state_dict``,
optimizers, EMA updates) keeps it, and ``pickle`` and ``torch.save`` keep shared storages shared. Whatever else
replaces a parameter (``torch.func.functional_call``, ``vector_to_parameters``, a parametrization) leaves the layer
unpacked, and a tensor subclass (FSDP's DTensor) is never packed: :func:`packed_width` checks the layout on every
call from pointers and sizes (no operator), and an unpacked layer runs its ``qkv`` and router GEMMs apart as
before, with the same values. What users see: in a state dict a layer's ``qkv`` and router weights are views of one
storage. ``torch.save`` writes it once and ``safetensors.torch.save_file`` (what timm's ``push_to_hub`` calls) writes
each tensor apart, as before (tests); ``safetensors.torch.save_model`` refuses a view that does not cover its
storage: save ``{k: v.clone() for k, v in model.state_dict().items()}`` with it instead.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor
# the packed rows are padded with zero rows to a multiple of this: a GEMM whose output width is not a multiple of 8
# took 1.3x as long on the CPU (MKL, float32: [2048, 768] x [768, 2318] 94 ms, x [768, 2320] 73 ms, one thread), and
# cuBLAS wants rows of 16 bytes for its tensor-core kernels
ROW_ALIGN = 16


def aligned(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`ROW_ALIGN`."""
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def pack_rows(first: nn.Linear, others: Sequence[nn.Linear]) -> None:
    """Give ``first``'s and ``others``' weights one storage, as consecutive rows in that order followed by zero rows up
    to a multiple of :data:`ROW_ALIGN`, and ``first``'s bias a storage of its own followed by zeros to the same length
    (values and parameter objects unchanged; optimizers keep referring to the same parameters). A no-op where it
    holds already, where the weights differ in dtype, device or input width, or where a parameter is not a plain
    dense tensor."""
    weights = [first.weight, *(o.weight for o in others)]
    if packed_width(weights[0], first.bias, weights[1:]) is not None:
        return
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return
    for t in (*weights, first.bias):  # plain dense tensors only: a subclass (FSDP's DTensor shards) manages its own
        if t is not None and (type(t.data) is not torch.Tensor or t.layout != torch.strided):
            return
    rows = sum(w.shape[0] for w in weights)
    with torch.no_grad():
        fused = weights[0].new_zeros(aligned(rows), weights[0].shape[1])
        start = 0
        for w in weights:
            view = fused[start:start + w.shape[0]]
            view.copy_(w)
            w.data = view
            start += w.shape[0]
        if first.bias is not None:
            bias = first.bias.new_zeros(aligned(rows))
            bias[:first.bias.shape[0]].copy_(first.bias)
            first.bias.data = bias[:first.bias.shape[0]]


def packed_width(weight: Tensor, bias: Optional[Tensor], others: Sequence[Tensor]) -> Optional[int]:
    """The rows of the fused weight (``weight``'s, then each of ``others``') where :func:`pack_rows`'s layout holds,
    else None. Reads pointers and sizes only: ``others`` follow ``weight`` in memory inside its storage, which holds
    the padding rows after them, and ``bias`` (if any) starts a storage of exactly ``aligned(rows)`` entries."""
    if not weight.is_contiguous():
        return None
    cols, step = weight.shape[1], weight.shape[1] * weight.element_size()
    rows, end = weight.shape[0], weight.data_ptr() + weight.shape[0] * step
    for w in others:
        if w.data_ptr() != end or w.dtype != weight.dtype or w.shape[1] != cols or not w.is_contiguous():
            return None
        rows, end = rows + w.shape[0], end + w.shape[0] * step
    storage = weight.untyped_storage()
    if storage.data_ptr() + storage.nbytes() < end + (aligned(rows) - rows) * step:
        return None
    if bias is not None and (bias.storage_offset() != 0 or bias.dtype != weight.dtype
                             or bias.untyped_storage().nbytes() != aligned(rows) * bias.element_size()):
        return None
    return rows


def _packed_operands(weight: Tensor, bias: Optional[Tensor], rows: int) -> Tuple[Tensor, Optional[Tensor]]:
    """The packed storage as the fused GEMM's weight ``[aligned(rows), C]`` and bias ``[aligned(rows)]`` (views)."""
    cols, padded = weight.shape[1], aligned(rows)
    return weight.as_strided((padded, cols), (cols, 1)), None if bias is None else bias.as_strided((padded,), (1,))


def _split_columns(out: Tensor, qkv_rows: int, rows: int) -> Tuple[Tensor, Tensor]:
    """The fused GEMM's output as its ``qkv`` columns and the routers' logits (views; the padding left out)."""
    return out[..., :qkv_rows], out[..., qkv_rows:rows]


def _fused_gemm(x: Tensor, rows: int, weight: Tensor, bias: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """``x @ [W_qkv; W_routers; 0]^T + [b; 0]`` over the packed storage (``rows`` rows from ``weight``'s and the zero
    rows after them), as ``[..., aligned(rows)]``; under autocast cast as ``F.linear`` casts (input, weight and bias
    to the autocast dtype). Also returns the GEMM's operands for the backward: the input as rows and the weight's
    ``rows`` rows (the padding has no gradient)."""
    fused, full_bias = _packed_operands(weight, bias, rows)
    padded, cols = fused.shape
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if fused.dtype != dtype:  # what F.linear's autocast does: everything in the low-precision dtype
            fused = fused.to(dtype)
            full_bias = None if full_bias is None else full_bias.to(dtype)
    flat = x.reshape(-1, cols)
    flat = flat if flat.dtype == fused.dtype else flat.to(fused.dtype)
    out = torch.mm(flat, fused.t()) if full_bias is None else torch.addmm(full_bias, flat, fused.t())
    return out.view(*x.shape[:-1], padded), flat, fused[:rows]


class _ProjectWithRouters(torch.autograd.Function):
    """:func:`_fused_gemm` with the ``qkv`` columns and the logits as its outputs (views of the one output); the
    backward returns every gradient in its parameter's dtype."""

    # forward(ctx, ...), not setup_context: runs eagerly only (never under torch.func), as _FusedRoute
    @staticmethod
    def forward(ctx, x: Tensor, rows: int, weight: Tensor, bias: Optional[Tensor], *others: Tensor):
        out, flat, fused = _fused_gemm(x, rows, weight, bias)
        ctx.save_for_backward(flat, fused, *others)  # the routers too: autograd checks each one's version
        ctx.layout = (weight.shape[0], [w.shape[0] for w in others], weight.dtype, bias is not None)
        return _split_columns(out, weight.shape[0], rows)

    @staticmethod
    def backward(ctx, grad_qkv: Tensor, grad_logits: Tensor):
        flat, fused = ctx.saved_tensors[:2]
        qkv_rows, other_rows, dtype, has_bias = ctx.layout
        needs = ctx.needs_input_grad
        grad = torch.cat([grad_qkv, grad_logits.to(grad_qkv.dtype)], dim=-1).view(-1, fused.shape[0])
        grad_x = grad.mm(fused).view(grad_qkv.shape[:-1] + (fused.shape[1],)) if needs[0] else None
        grads_w = [None] * (1 + len(other_rows))
        if needs[2] or any(needs[4:]):
            grad_w = grad.t().mm(flat)
            grad_w = grad_w if grad_w.dtype == dtype else grad_w.to(dtype)  # one cast, not one per parameter
            grads_w = list(grad_w.split([qkv_rows, *other_rows]))
        grad_b = None
        if has_bias and needs[3]:
            grad_b = grad_qkv.reshape(-1, qkv_rows).sum(0)
            grad_b = grad_b if grad_b.dtype == dtype else grad_b.to(dtype)
        return (grad_x, None, grads_w[0], grad_b, *grads_w[1:])


def project_with_routers(x: Tensor, qkv: nn.Linear, others: Sequence[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
    """``(qkv(x), x @ cat(others)^T)`` from one GEMM where :func:`pack_rows`'s layout holds (else None): the
    ``qkv`` columns ``[..., 3hd]`` and the logits ``[..., L]`` are column ranges of one output (row stride
    ``aligned(3hd + L)``). Eager calls only: a tracer or exporter sees the separate modules."""
    weight, bias = qkv._parameters["weight"], qkv._parameters["bias"]
    rows = packed_width(weight, bias, others)
    if rows is None:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or differentiable(bias, others)):
        return _ProjectWithRouters.apply(x, rows, weight, bias, *others)
    # nothing to differentiate: the GEMM alone (F.linear casts under autocast as _fused_gemm does)
    return _split_columns(F.linear(x, *_packed_operands(weight, bias, rows)), weight.shape[0], rows)


def differentiable(bias: Optional[Tensor], others: Sequence[Tensor]) -> bool:
    """Whether ``bias`` or any of ``others`` requires a gradient."""
    for t in (bias, *others):
        if t is not None and t.requires_grad:
            return True
    return False
