"""Exact sparse execution of MoH: compute only what the gates keep.

The official MoH code (and ``impl="masked"``) computes every head for every token and multiplies
the unselected ones by zero, so the activation ratio saves nothing. Here a token's query, its
attention and its share of the output projection are computed only for the heads it uses:

=====================  =========================  ============================================
stage                  masked (official)          sparse (this file)
=====================  =========================  ============================================
keys / values          all heads, all tokens      all heads, all tokens (any query may need
                                                  any key, so nothing can be skipped)
queries                all heads, all tokens      shared heads: all tokens (one GEMM);
                                                  routed head e: only the tokens that chose e
attention core         all heads, all tokens      shared: one dense SDPA call; routed: per
                                                  head, over the tokens that chose it
output projection      all heads, all tokens      shared: one GEMM; routed: per head, only the
                                                  tokens that chose it, added to their rows
=====================  =========================  ============================================

At 1024 tokens, dim 768, 12 heads the projections are ~60% of the dense FLOPs, so sparsifying
only the attention core could not pay; queries and the output projection are sparse too.

Packing (:func:`build_dispatch`): every selected (token, routed head) pair is one row of a flat
``[R, d]`` buffer, ``R = B * N * topk``, ordered by head, then image, then token. Projections
work on these rows exactly. Only the routed SDPA needs a rectangular batch: it pads each head's
rows to ``[B, L_e]`` (``L_e``: the longest list of that head over the batch; or, in one call
for all heads, to the longest list of any head, see :func:`one_call_for_all_heads`) with a cheap
``d``-wide gather and drops the padding again afterwards (:func:`padded_layout`).

Gradients are ordinary autograd except for two small ``autograd.Function``\\ s that gather
inputs / scatter outputs head by head, a chunk of rows at a time, through one reused scratch buffer
(:class:`GatheredHeadProjection`, :class:`ScatteredHeadProjection`): the packed copies of ``x``
and of the output rows are ``topk`` times the size of ``x``, and keeping them for backward would
cost memory and time. The scatter also applies the routed gates (so no gated copy of the rows is
kept for backward) and adds into the shared heads' output in place.
Outputs and gradients (router weights and input included) are those of the masked path up to
float summation order.

``routed_attention`` is the one step a faster kernel can replace: it receives the packed queries, the
routed heads' keys/values and the :class:`Dispatch` (a Triton kernel did, on CUDA, until it measured slower
than the masked path everywhere on an H100 and was removed: ``moh_vision/attention/triton_moh.py``).

Which kernels can run sparse (:func:`sparse_support`)
-----------------------------------------------------
A kernel declares it with a class attribute ``sparse_moh = SparseSupport(...)`` in its own class
body; it is not inherited by a subclass registered as another kernel (whose math may differ).
``sdpa`` runs the driver above (:func:`sparse_moh_forward`, over its ``qkv``/``proj`` layout). Any other kernel that declares support runs the generic driver
:func:`sparse_kernel_forward` and owns its math through three methods:

* ``sparse_context(x) -> (query_weight [h*d, C], query_bias, keys)``: its query projection (rows
  head-major) and everything every query attends to, computed for every head and token (keys,
  values, pooled keys, position biases);
* ``attend_heads(q [B, n, N, d], keys, heads) -> [B, n, N, d]``: the heads ``heads`` (a slice or
  index tensor) for every token, from raw queries (the shared heads);
* ``attend_rows(q [R, d], keys, rows: PackedRows) -> [R, d]``: packed (token, routed head) query
  rows; :class:`PackedRows` says which image, token and head each row is and pads rows to
  per-head batches for the steps that need them.

The driver projects the queries (shared heads: one GEMM; routed heads: :class:`GatheredHeadProjection`),
gates and projects the outputs (:class:`ScatteredHeadProjection`) exactly as for ``sdpa``; learned
shared heads are passed as a head order (no permuted copy of the module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .auto_table import AutoTable, auto_table
from .kernels import DotProductAttention, custom_functions_opaque, dot_product_attention, functorch_wrapped

Tensor = torch.Tensor


@dataclass
class Dispatch:
    """Which token each packed row reads: rows are grouped by routed head, then image.

    ``rows[r]``: the row of ``x.reshape(B * N, C)`` that packed row ``r`` reads; ``heads[r]``: its
    routed head. ``counts[e, b]``: tokens of image b that chose head e; their rows start at
    ``offsets[e, b]``. Head e owns rows ``segments[e] = (start, stop)``; ``lengths[e]`` is its
    longest list over the batch (python ints: the layout's shape).
    """

    rows: Tensor  # [R] int64
    heads: Tensor  # [R] int64
    counts: Tensor  # [E, B] int64
    offsets: Tensor  # [E, B] int64
    segments: Tuple[Tuple[int, int], ...]
    lengths: Tuple[int, ...]
    tokens: int  # N

    @property
    def batch(self) -> int:
        return self.counts.shape[1]

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def sparse_flops_ratio(dim: int, num_heads: int, head_dim: int, tokens: int, shared_heads: int, topk: int) -> float:
    """Analytic lower bound of the sparse path: its multiply-adds per token over dense attention's.

    Dense: q/k/v and output projections plus ``QK^T`` and ``AV`` for every head. Sparse: the router,
    keys and values for every head, and queries, attention and output projection only for the
    ``shared_heads + topk`` active heads. The ratio holds for forward and backward alike.
    """
    inner = num_heads * head_dim
    per_head = 2 * dim * head_dim + 2 * tokens * head_dim  # query + output projection, QK^T + AV
    dense = 2 * dim * inner + num_heads * per_head  # + keys and values
    routed = num_heads - shared_heads
    router = dim * ((routed if topk else 0) + (2 if shared_heads and topk else 0) + (shared_heads if shared_heads > 1 else 0))
    sparse = 2 * dim * inner + (shared_heads + topk) * per_head + router
    return sparse / dense


# ----------------------------------------------------------------------------------------------
# Stage 1: from the router's top-k indices to per-head token lists
# ----------------------------------------------------------------------------------------------
def build_dispatch(index: Tensor, num_routed: int) -> Dispatch:
    """Per routed head and image, the ordered list of tokens that selected it (see :class:`Dispatch`).

    ``index``: ``[B, N, k]`` routed heads each token selected (relative to the routed pool).
    Linear time: a running count gives every selected (token, head) pair its slot in its list,
    one scatter writes the pairs to their rows. One host sync reads the per-head sizes.
    """
    B, N, k = index.shape
    E, device = num_routed, index.device
    num_rows = B * N * k  # every token selects exactly k distinct heads
    chosen = torch.zeros(B, N, E, dtype=torch.bool, device=device).scatter_(-1, index, 1)
    chosen = chosen.permute(2, 0, 1)  # [E, B, N]
    slot = chosen.cumsum(-1) - 1  # slot of a selected token within its (head, image) list
    counts = slot[..., -1] + 1
    offsets = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(E, B)
    dest = torch.where(chosen, offsets.unsqueeze(-1) + slot, num_rows)  # unselected -> a dump row
    source = (torch.arange(B, device=device).view(1, B, 1) * N + torch.arange(N, device=device)).expand(E, B, N)
    rows = torch.empty(num_rows + 1, dtype=torch.long, device=device).scatter_(0, dest.reshape(-1), source.reshape(-1))

    per_head = counts.sum(1)
    heads = torch.repeat_interleave(torch.arange(E, device=device), per_head, output_size=num_rows)
    sizes, lengths = torch.stack([per_head, counts.amax(1)]).tolist()
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    segments = tuple(zip(bounds[:-1], bounds[1:]))
    return Dispatch(rows[:num_rows], heads, counts, offsets, segments, tuple(lengths), N)


def padded_layout(dispatch: Dispatch, lengths: Optional[Tuple[int, ...]] = None) -> Tuple[Tensor, Tensor]:
    """Indices between packed rows and a padded layout where head e's rows form ``[B, L_e]``.

    ``lengths``: the ``L_e`` (default: each head's longest list, ``dispatch.lengths``; each must be
    at least that). Returns ``(source, position)``: padded row ``p`` reads packed row
    ``source[p]`` (padding reads row 0 and is dropped again), packed row ``r`` sits at padded row
    ``position[r]``.
    """
    lengths = dispatch.lengths if lengths is None else lengths
    B, device = dispatch.batch, dispatch.rows.device
    lengths_t = torch.tensor(lengths, device=device)
    head_start = B * (lengths_t.cumsum(0) - lengths_t)  # first padded row of each head
    image = dispatch.rows // dispatch.tokens
    slot = torch.arange(dispatch.num_rows, device=device) - dispatch.offsets[dispatch.heads, image]
    position = head_start[dispatch.heads] + image * lengths_t[dispatch.heads] + slot
    source = torch.zeros(B * sum(lengths), dtype=torch.long, device=device)
    source.scatter_(0, position, torch.arange(dispatch.num_rows, device=device))
    return source, position


# ----------------------------------------------------------------------------------------------
# Head-by-head gather/scatter projections (autograd Functions)
#
# Both work through scratch buffers of at most ``SCRATCH_ELEMENTS`` elements (4 MiB in fp32): a
# head's rows are processed in chunks, so a ``[rows, C]`` gather or product is never ``topk`` times the
# size of ``x`` at once, only up to one head's rows (2.2 MB at 196 tokens x 10, dim 384, top-3 of 4
# routed heads). Chunks must not be much smaller than a head's rows: each costs a GEMM, a gather and an
# ``index_add_`` of its own. With 1 MiB chunks (341 rows at dim 768) the scatter's forward and backward
# took 36% and 33% longer than with whole head segments (~700 rows at 2 x 1024 tokens, dim 768, top-3 of
# 9 routed heads; 2 CPU threads), and whole sparse layers up to 8% longer (`git show 57504dd:docs/performance-log.md`).
# ----------------------------------------------------------------------------------------------
SCRATCH_ELEMENTS = 1 << 20


def _chunks(segments, width: int):
    """``(head, start, stop)`` for every head segment cut into pieces of at most
    ``SCRATCH_ELEMENTS // width`` rows, and that piece size (the scratch buffers' row count)."""
    step = max(1, SCRATCH_ELEMENTS // width)
    pieces = [(e, s, min(s + step, stop)) for e, (start, stop) in enumerate(segments) for s in range(start, stop, step)]
    return pieces, max([stop - start for _, start, stop in pieces], default=0)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def vmap_by_slices(fn, info, in_dims, *args):
    """A Function's ``vmap`` rule that applies it once per vmapped slice and stacks the results (dim 0). The
    head-projection Functions gather rows by a data-dependent dispatch: there is no batched kernel to fold
    into, and MoH runs them under ``vmap`` only when called directly (the layer refuses sparse under vmap)."""
    results = [fn.apply(*(a.select(d, i) if isinstance(a, Tensor) and d is not None else a
                          for a, d in zip(args, in_dims)))
               for i in range(info.batch_size)]
    if isinstance(results[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*results)), (0,) * len(results[0])
    return torch.stack(results), 0


class GatheredHeadProjection(torch.autograd.Function):
    """``out[r] = x[rows[r]] @ weight_e^T + bias_e`` for the rows ``r`` of each head segment ``e``.

    ``x``: [T, C]; ``weight``: [E * d, C] (head e = rows ``e*d:(e+1)*d``); ``bias``: [E * d] or
    None. The gathered inputs are never stored: backward gathers again, chunk by chunk.
    ``torch.func``: ``setup_context``, a per-slice ``vmap`` rule, a plain-op backward for transform tensors.
    """

    @staticmethod
    def forward(x, weight, bias, rows, segments):
        E = len(segments)
        d, C = weight.shape[0] // E, x.shape[1]
        out = x.new_empty(rows.shape[0], d)
        pieces, size = _chunks(segments, C)
        buf = x.new_empty(size, C)
        for e, start, stop in pieces:
            gathered = torch.index_select(x, 0, rows[start:stop], out=buf[:stop - start])
            w = weight[e * d:(e + 1) * d]
            if bias is None:
                torch.mm(gathered, w.t(), out=out[start:stop])
            else:
                torch.addmm(bias[e * d:(e + 1) * d], gathered, w.t(), out=out[start:stop])
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, rows, segments = inputs
        ctx.save_for_backward(x, weight, rows)
        ctx.segments, ctx.has_bias = segments, bias is not None

    @staticmethod
    def vmap(info, in_dims, *args):
        return vmap_by_slices(GatheredHeadProjection, info, in_dims, *args)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rows = ctx.saved_tensors
        segments = ctx.segments
        d = weight.shape[0] // len(segments)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if functorch_wrapped(grad_out, x, weight):
            return _gathered_backward_plain(grad_out, x, weight, rows, segments, need_x, need_w,
                                            need_b and ctx.has_bias) + (None, None)
        grad_out = grad_out.contiguous()
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None  # chunks of a head accumulate
        grad_b = weight.new_zeros(weight.shape[0]) if need_b and ctx.has_bias else None
        pieces, size = _chunks(segments, x.shape[1])
        buf = x.new_empty(size, x.shape[1])
        for e, start, stop in pieces:
            g, heads, chunk = grad_out[start:stop], slice(e * d, (e + 1) * d), buf[:stop - start]
            if grad_w is not None:
                grad_w[heads].addmm_(g.t(), torch.index_select(x, 0, rows[start:stop], out=chunk))
            if grad_b is not None:
                grad_b[heads] += g.sum(0)
            if grad_x is not None:
                grad_x.index_add_(0, rows[start:stop], torch.mm(g, weight[heads], out=chunk))
        return grad_x, grad_w, grad_b, None, None


def _gathered_backward_plain(grad_out, x, weight, rows, segments, need_x, need_w, need_b):
    """:class:`GatheredHeadProjection`'s gradients in plain out-of-place ops (``torch.func`` transforms batch
    or track them; no writes into buffers)."""
    d = weight.shape[0] // len(segments)
    parts = [(grad_out[start:stop], rows[start:stop], weight[e * d:(e + 1) * d]) for e, (start, stop) in
             enumerate(segments)]
    grad_x = torch.zeros_like(x).index_add(0, rows, torch.cat([g @ w for g, _, w in parts])) if need_x else None
    grad_w = torch.cat([g.t() @ x.index_select(0, r) for g, r, _ in parts]) if need_w else None
    grad_b = torch.cat([g.sum(0) for g, _, _ in parts]) if need_b else None
    return grad_x, grad_w, grad_b


class ScatteredHeadProjection(torch.autograd.Function):
    """``y[rows[r]] += (gate[r] * o[r]) @ weight_e^T`` for the rows ``r`` of each head segment ``e``.

    ``y``: [T, C], updated **in place** and returned when ``in_place`` (callers pass a fresh tensor nobody else
    reads: the shared heads' output projection, or the bias); else on a copy (under ``torch.jit.trace``, where
    adds into the traced input would stay in the graph beside this op and be counted twice, and under
    ``torch.func`` transforms, which do not track a Function's in-place writes). ``o``: [R, d] ungated head
    outputs; ``gate``: [R]; ``weight``: [C, E * d] (head e = columns ``e*d:(e+1)*d``). Rows repeat across
    heads (a token uses several), so outputs are accumulated with ``index_add_``.

    Memory: the gated rows are formed chunk by chunk in a scratch buffer and again in backward, so
    only ``o`` and ``gate`` are saved (not a gated ``[R, d]`` copy as well), and ``y`` is not copied.
    Gradients are the masked path's: the gated rows get ``grad[rows] @ W_e``; times ``gate`` that
    is ``o``'s gradient, dotted with ``o`` row by row it is ``gate``'s.
    """

    @staticmethod
    def forward(y, o, gate, weight, rows, segments, in_place: bool = True):
        d, C = o.shape[1], y.shape[-1]
        result = y if in_place else y.clone()
        out = result.view(-1, C)
        pieces, size = _chunks(segments, C)
        buf, gated = o.new_empty(size, C), o.new_empty(size, d)
        for e, start, stop in pieces:
            g = torch.mul(o[start:stop], gate[start:stop, None], out=gated[:stop - start])
            contrib = torch.mm(g, weight[:, e * d:(e + 1) * d].t(), out=buf[:stop - start])
            out.index_add_(0, rows[start:stop], contrib)
        return result

    @staticmethod
    def setup_context(ctx, inputs, output):
        y, o, gate, weight, rows, segments = inputs[:6]
        if inputs[6] if len(inputs) > 6 else True:  # in_place (its default when left out)
            ctx.mark_dirty(y)
        ctx.save_for_backward(o, gate, weight, rows)
        ctx.segments = segments

    @staticmethod
    def vmap(info, in_dims, y, o, gate, weight, rows, segments, in_place=True):
        # on copies: a batched y cannot be written slice by slice through a Function
        return vmap_by_slices(ScatteredHeadProjection, info, tuple(in_dims[:6]) + (None,), y, o, gate, weight,
                              rows, segments, False)

    @staticmethod
    def backward(ctx, grad_out):
        o, gate, weight, rows = ctx.saved_tensors
        d, C = o.shape[1], grad_out.shape[-1]
        need_y, need_o, need_gate, need_w = ctx.needs_input_grad[:4]
        if functorch_wrapped(grad_out, o, gate, weight):
            return (grad_out if need_y else None, *_scattered_backward_plain(
                grad_out.reshape(-1, C), o, gate, weight, rows, ctx.segments, need_o, need_gate, need_w),
                None, None, None)
        flat = grad_out.contiguous().view(-1, C)
        grad_o = torch.empty_like(o) if need_o else None
        grad_gate = torch.empty_like(gate) if need_gate else None
        grad_w = torch.zeros_like(weight) if need_w else None  # chunks of a head accumulate
        pieces, size = _chunks(ctx.segments, C)
        buf, small = flat.new_empty(size, C), o.new_empty(size, d)
        for e, start, stop in pieces:
            heads, n = slice(e * d, (e + 1) * d), stop - start
            g = torch.index_select(flat, 0, rows[start:stop], out=buf[:n])
            if need_o or need_gate:
                g_gated = torch.mm(g, weight[:, heads], out=small[:n])  # gradient of the gated rows
                if need_gate:
                    torch.sum(g_gated * o[start:stop], dim=1, out=grad_gate[start:stop])
                if need_o:
                    torch.mul(g_gated, gate[start:stop, None], out=grad_o[start:stop])
            if need_w:
                gated = torch.mul(o[start:stop], gate[start:stop, None], out=small[:n])
                grad_w[:, heads].addmm_(g.t(), gated)
        return grad_out if need_y else None, grad_o, grad_gate, grad_w, None, None, None


def _scattered_backward_plain(flat, o, gate, weight, rows, segments, need_o, need_gate, need_w):
    """:class:`ScatteredHeadProjection`'s gradients of ``o``, ``gate`` and ``weight`` in plain out-of-place ops
    (``torch.func`` transforms batch or track them)."""
    d = o.shape[1]
    g_rows = flat.index_select(0, rows)  # [R, C]: the output gradient of every packed row's token
    parts = [(g_rows[start:stop], o[start:stop], gate[start:stop], weight[:, e * d:(e + 1) * d])
             for e, (start, stop) in enumerate(segments)]
    g_gated = torch.cat([g @ w for g, _, _, w in parts]) if need_o or need_gate else None  # [R, d]
    grad_o = g_gated * gate[:, None] if need_o else None
    grad_gate = (g_gated * o).sum(1) if need_gate else None
    grad_w = torch.cat([g.t() @ (o_e * gate_e[:, None]) for g, o_e, gate_e, _ in parts], dim=1) if need_w else None
    return grad_o, grad_gate, grad_w


def _run_projection(fn, *args):
    """Apply a head-projection Function under autocast the way ``F.linear`` would: cast the
    floating inputs to the autocast dtype, then run with autocast off (the ``out=`` buffers
    must match)."""
    device_type = args[0].device.type
    dtype = _autocast_dtype(device_type)
    if dtype is not None:
        args = [a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
    with torch.autocast(device_type=device_type, enabled=False):
        return fn.apply(*args)


# ----------------------------------------------------------------------------------------------
# Stage 2: projections. Rows of ``qkv.weight`` are laid out (q|k|v, head, d), so shared queries,
# routed queries and keys+values are three contiguous row blocks. They are taken with one
# ``split`` (not three slices) so that backward assembles the weight gradient with one ``cat``
# instead of zero-filling a full-size gradient per slice.
# ----------------------------------------------------------------------------------------------
@dataclass
class QKVWeights:
    shared_q: Tensor  # [h_s*d, C]
    routed_q: Tensor  # [E*d, C]
    kv: Tensor  # [2*h*d, C]
    shared_q_bias: Optional[Tensor]
    routed_q_bias: Optional[Tensor]
    kv_bias: Optional[Tensor]


def split_qkv(m) -> QKVWeights:
    sizes = [m.shared_heads * m.head_dim, (m.num_heads - m.shared_heads) * m.head_dim, 2 * m.inner_dim]
    weights = m.qkv.weight.split(sizes)
    biases = m.qkv.bias.split(sizes) if m.qkv.bias is not None else (None, None, None)
    return QKVWeights(*weights, *biases)


def _key_value_groups(kv: Tensor, groups: Tuple[int, ...]) -> Tuple[Tensor, ...]:
    """``[2, B, h, N, d]`` keys and values -> ``(k, v)`` of each head group, each ``[B, heads, N, d]``."""
    out = []
    for part in kv.split(groups, dim=2):
        out += part.unbind(0)
    return tuple(out)


def _heads_first(kv: Tensor) -> Tensor:
    """``[B, N, 2, h, d]`` (the GEMM's layout) -> ``[2, B, h, N, d]`` (a view)."""
    return kv.permute(2, 0, 3, 1, 4)


def _projected_keys_values(x: Tensor, weight: Tensor, bias: Optional[Tensor], shape) -> Tensor:
    """Keys and values of every head, ``[2, B, h, N, d]``: a view of one GEMM's ``[B, N, 2, h, d]`` result."""
    return _heads_first(F.linear(x, weight, bias).view(*shape))


class KeyValueHeads(torch.autograd.Function):
    """Keys and values of every head for every token from one GEMM, as ``(k, v)`` per head group
    (``groups``: head counts), copied out of the GEMM's ``[B, N, 2, h, d]`` result into one
    ``[2, B, h, N, d]`` tensor: each head's keys and values then lie in contiguous ``[N, d]`` blocks. As views
    of the GEMM's result one row of a head is ``2 h d`` elements from the next, and SDPA over a routed
    head's few hundred queries ran ~17% slower on them (fwd+bwd, 345 of 1,024 queries, d = 64, 2 CPU
    threads); with the copy, the sparse layer at 1,024 tokens x 2, dim 768, ratio 0.5 went from 0.832 to
    0.790x dense forward and from 0.803 to 0.775x fwd+bwd (`git show 57504dd:docs/performance-log.md`). The
    GEMM's result is freed, so memory stays as it was.

    Backward writes the groups' gradients straight into one ``[B, N, 2, h, d]`` buffer (one pass) and
    runs the input and weight GEMMs on it. Through autograd the same gradient would be assembled by a
    stack, a cat and a copy (the unbind, split and view/permute chain): three passes over it.
    """

    @staticmethod
    def forward(x, weight, bias, shape, groups):
        kv = _projected_keys_values(x, weight, bias, shape).contiguous()
        return _key_value_groups(kv, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, shape, groups = inputs
        ctx.save_for_backward(x, weight)
        ctx.shape, ctx.groups, ctx.has_bias = shape, groups, bias is not None

    @staticmethod
    def vmap(info, in_dims, *args):
        return vmap_by_slices(KeyValueHeads, info, in_dims, *args)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        if functorch_wrapped(x, weight, *grads):  # plain ops: stack the groups' gradients back
            return _key_value_backward_plain(grads, x, weight, ctx)
        dtype = next((g.dtype for g in grads if g is not None), x.dtype)
        buf = torch.empty(ctx.shape, dtype=dtype, device=x.device)
        for dst, grad in zip(_key_value_groups(_heads_first(buf), ctx.groups), grads):
            if grad is None:  # a head group nobody read (e.g. a routed head no token chose)
                dst.zero_()
            else:
                dst.copy_(grad)
        flat = buf.view(-1, weight.shape[0])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = (flat @ weight).view(x.shape) if need_x else None
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if need_w else None
        grad_b = flat.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def _key_value_backward_plain(grads, x: Tensor, weight: Tensor, ctx):
    """:class:`KeyValueHeads`' gradients in plain out-of-place ops (``torch.func`` transforms batch or track them)."""
    B, N, two, h, d = ctx.shape
    zeros = x.new_zeros(())
    grads = [g if g is not None else zeros.expand(B, n, N, d) for g, n in
             zip(grads, [n for n in ctx.groups for _ in range(2)])]
    kv = torch.cat([torch.stack(grads[2 * i:2 * i + 2]) for i in range(len(ctx.groups))], dim=2)  # [2, B, h, N, d]
    flat = kv.permute(1, 3, 0, 2, 4).reshape(-1, weight.shape[0])  # the GEMM's [B, N, 2, h, d] layout
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = (flat @ weight).reshape(x.shape) if need_x else None
    grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if need_w else None
    grad_b = flat.sum(0) if need_b and ctx.has_bias else None
    return grad_x, grad_w, grad_b, None, None


def project_keys_values(m, x: Tensor, w: QKVWeights):
    """Keys and values of every head for every token (one GEMM), split into shared and routed
    heads: ``(k_shared, v_shared), (k_routed, v_routed)``, each ``[B, heads, N, d]``."""
    B, N, _ = x.shape
    shape, groups = (B, N, 2, m.num_heads, m.head_dim), (m.shared_heads, m.num_heads - m.shared_heads)
    if custom_functions_opaque():
        k_shared, v_shared, k_routed, v_routed = _key_value_groups(_projected_keys_values(x, w.kv, w.kv_bias, shape),
                                                                   groups)
    else:
        k_shared, v_shared, k_routed, v_routed = _run_projection(KeyValueHeads, x, w.kv, w.kv_bias, shape, groups)
    return (k_shared, v_shared), (k_routed, v_routed)


def project_shared_queries(m, x: Tensor, w: QKVWeights) -> Tensor:
    """Queries of the shared heads for every token: ``[B, h_s, N, d]``."""
    B, N, _ = x.shape
    return F.linear(x, w.shared_q, w.shared_q_bias).view(B, N, m.shared_heads, m.head_dim).transpose(1, 2)


def project_routed_queries(x: Tensor, w: QKVWeights, dispatch: Dispatch) -> Tensor:
    """Queries of routed head e only for the tokens that chose it: packed ``[R, d]``."""
    B, N, C = x.shape
    return _run_projection(GatheredHeadProjection, x.reshape(B * N, C), w.routed_q, w.routed_q_bias,
                           dispatch.rows, dispatch.segments)


# ----------------------------------------------------------------------------------------------
# Stage 3: attention. Shared heads: one SDPA call. Routed heads: ``routed_attention``.
# ----------------------------------------------------------------------------------------------
# (packed queries [R, d], keys [B, E, N, d], values [B, E, N, d], dispatch) -> packed outputs [R, d];
# queries and keys arrive already through the kernel's q/k norms.
RoutedAttention = Callable[[Tensor, Tensor, Tensor, Dispatch], Tensor]


def one_call_for_all_heads(q: Tensor, batch: int) -> bool:
    """Whether to attend for all routed heads in one SDPA call (padded to the longest list of any
    head) instead of one call per head (padded per head: less padding). PyTorch's CPU flash
    attention parallelises its backward over batch x heads only, so per-head calls keep every
    thread busy only when the batch divides evenly among the threads; on GPUs one launch is
    better anyway."""
    return q.device.type != "cpu" or batch % torch.get_num_threads() != 0


def sdpa_routed_attention(m) -> RoutedAttention:
    """Scaled dot-product attention as the kernel runs it (dropout, fused flag) over the routed
    heads' queries, padded to rectangles with cheap ``d``-wide gathers; the padding is dropped
    after. The packed queries are let go once padded (the padded copy is what SDPA keeps for
    backward): callers pass them as a temporary, so they are freed before the attention runs."""

    def attend(q: Tensor, k: Tensor, v: Tensor, dispatch: Dispatch) -> Tensor:
        B, E, d = dispatch.batch, k.shape[1], q.shape[-1]
        dropout = m.attn_drop if m.training else 0.0
        if one_call_for_all_heads(q, B):
            L = max(dispatch.lengths)
            source, position = padded_layout(dispatch, (L,) * E)
            q_padded = q.index_select(0, source).view(E, B, L, d).transpose(0, 1)
            del q
            o = dot_product_attention(q_padded, k, v, dropout, m.fused_attn)
            return o.transpose(0, 1).reshape(-1, d).index_select(0, position)
        source, position = padded_layout(dispatch)
        # split, not slicing: backward then assembles dq/dk/dv with one cat, not a zero-fill per head
        qs = q.index_select(0, source).split([B * length for length in dispatch.lengths])
        del q
        ks, vs = k.split(1, dim=1), v.split(1, dim=1)
        outputs = [dot_product_attention(q_e.view(B, 1, length, d), k_e, v_e, dropout, m.fused_attn).reshape(-1, d)
                   if length else q_e  # a head no token chose: nothing to attend
                   for q_e, k_e, v_e, length in zip(qs, ks, vs, dispatch.lengths)]
        return torch.cat(outputs).index_select(0, position)

    return attend


# ----------------------------------------------------------------------------------------------
# Stage 4: gates and the output projection
# ----------------------------------------------------------------------------------------------
def split_proj(m) -> Tuple[Tensor, Tensor]:
    """Columns of ``proj.weight`` that read the shared heads and the routed heads (one ``split``)."""
    h_s, d = m.shared_heads, m.head_dim
    return m.proj.weight.split([h_s * d, (m.num_heads - h_s) * d], dim=1)


def shared_output(m, o_shared: Tensor, gates: Tensor, w_shared: Tensor) -> Tensor:
    """``sum over shared heads of g_i H_i W_O^i`` plus the projection bias: ``[B * N, C]``, a tensor
    of its own (a 2-d GEMM's output, not a view) that :func:`add_routed_output` adds to in place."""
    h_s, d = m.shared_heads, m.head_dim
    B, _, N, _ = o_shared.shape
    o = o_shared * gates[..., :h_s].transpose(1, 2).unsqueeze(-1).to(o_shared.dtype)
    return F.linear(o.transpose(1, 2).reshape(B * N, h_s * d), w_shared, m.proj.bias)


def bias_output(m, rows: int, dtype: torch.dtype, device) -> Tensor:
    """Without shared heads the routed heads start from the projection bias alone: ``[rows, C]``
    (zeros without a bias), a tensor of its own like :func:`shared_output`'s."""
    y = torch.zeros(rows, m.proj.weight.shape[0], dtype=dtype, device=device)
    return y + m.proj.bias.to(dtype) if m.proj.bias is not None else y


def packed_gates(m, gates: Tensor, dispatch: Dispatch) -> Tensor:
    """The routed gate of every packed row, ``[R]``."""
    routed = gates[..., m.shared_heads:]
    flat = routed.reshape(-1)  # [(b * N + token) * E + e]
    return flat.gather(0, dispatch.rows * routed.shape[-1] + dispatch.heads)


def add_routed_output(m, y: Tensor, o_routed: Tensor, gates: Tensor, w_routed: Tensor, dispatch: Dispatch) -> Tensor:
    """``y + sum over chosen routed heads of g_i H_i W_O^i`` as ``[B, N, C]``: each head's packed rows
    are gated, projected with that head's columns of ``proj`` and added to the rows of their tokens.
    ``y`` [B * N, C] (:func:`shared_output` or :func:`bias_output`) is updated in place: it must not
    be a view, or autograd would copy it whole (``CopySlices``) to rebase the view's history."""
    gate = packed_gates(m, gates, dispatch).to(o_routed.dtype)
    # in place except under jit.trace (FLOP counting) and torch.func transforms (see ScatteredHeadProjection)
    in_place = not torch.jit.is_tracing() and not functorch_wrapped(y, o_routed, gate, w_routed)
    out = _run_projection(ScatteredHeadProjection, y, o_routed, gate, w_routed, dispatch.rows, dispatch.segments,
                          in_place)
    return out.view(*gates.shape[:2], out.shape[-1])


# ----------------------------------------------------------------------------------------------
# Learned shared heads: the module seen with its heads reordered, shared ones first
# ----------------------------------------------------------------------------------------------
class _Weights:
    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        self.weight, self.bias = weight, bias


class HeadPermutedView:
    """``m`` with its heads in the order ``order`` (``[h]``: head ``order[j]`` becomes head ``j``).

    An MoH layer that learns its shared heads (``shared_heads="learned"``) passes the order "shared
    heads first, then routed heads" (each ascending), so every function above, which assumes the
    shared heads are ``0..h_s-1``, runs it exactly. Only ``qkv`` and ``proj`` are replaced: their
    rows / columns are gathered per call (differentiably, one ``index_select`` each); every other
    attribute (head-shared q/k norms, dropout, ``attend``) is the module's own.
    """

    def __init__(self, m, order: Tensor):
        self._module = m
        d, inner = m.head_dim, m.inner_dim
        rows = (order.view(-1, 1) * d + torch.arange(d, device=order.device)).reshape(-1)  # [h * d]
        qkv_rows = torch.cat([rows + part * inner for part in range(3)])
        self.qkv = _Weights(m.qkv.weight.index_select(0, qkv_rows),
                            m.qkv.bias.index_select(0, qkv_rows) if m.qkv.bias is not None else None)
        self.proj = _Weights(m.proj.weight.index_select(1, rows), m.proj.bias)

    def __getattr__(self, name):
        return getattr(self._module, name)


# ----------------------------------------------------------------------------------------------
# The whole forward
# ----------------------------------------------------------------------------------------------
def sparse_moh_forward(m, x: Tensor, gates: Tensor, index: Tensor,
                       routed_attention: Optional[RoutedAttention] = None) -> Tensor:
    """MoH output for ``x`` given the router's ``gates`` [B, N, h] and ``index`` [B, N, k].

    ``m`` is an MoH module over the ``sdpa`` kernel with ``topk > 0``. Equals
    ``m.output(m.heads(x), gates)`` (the masked path) in value and gradient.
    """
    B, N, _ = x.shape
    h_s = m.shared_heads
    w_qkv = split_qkv(m)
    w_out_shared, w_out_routed = split_proj(m)
    (k_shared, v_shared), (k_routed, v_routed) = project_keys_values(m, x, w_qkv)

    if h_s > 0:
        o_shared = m.attend(project_shared_queries(m, x, w_qkv), k_shared, v_shared)
        y = shared_output(m, o_shared, gates, w_out_shared)
    else:  # no shared head: the routed heads start from the bias alone
        y = bias_output(m, B * N, k_routed.dtype, x.device)

    dispatch = build_dispatch(index, m.num_heads - h_s)
    attend = routed_attention or sdpa_routed_attention(m)
    # the packed queries as a temporary: ``attend`` may free them once it has laid them out
    o_routed = attend(m.q_norm(project_routed_queries(x, w_qkv, dispatch)), m.k_norm(k_routed), v_routed, dispatch)
    y = add_routed_output(m, y, o_routed, gates, w_out_routed, dispatch)
    return m.proj_drop(y)


# ----------------------------------------------------------------------------------------------
# Kernels that run sparse: the capability and the generic driver
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SparseSupport:
    """What a kernel declares (class attribute ``sparse_moh``) to run MoH sparse.

    ``impls``: the MoH impls it supports besides ``masked``. ``forward``: the driver
    ``(m, x, gates, index, order, routed_attention) -> y``; None: :func:`sparse_kernel_forward`
    over the kernel's ``sparse_context`` / ``attend_heads`` / ``attend_rows``. ``auto``: what
    ``impl="auto"`` runs, ``(m, x) -> "sparse" | "masked"`` for a layer with ``topk > 0`` and its
    input ``x`` [B, N, C] (a rule from the kernel's measurements, e.g. :func:`table_auto`);
    None: always masked.
    """

    impls: Tuple[str, ...] = ("sparse",)
    forward: Optional[Callable] = None
    auto: Optional[Callable[..., str]] = None


def table_auto(kernel: str) -> Callable[..., str]:
    """An ``auto`` rule for a kernel with its own sparse driver: the ``kernels.<kernel>`` entry of the
    measured thresholds for the input's device (:mod:`moh_vision.attention.auto_table`); masked where
    that device has none. A training call is a module in train mode with autograd on."""

    def auto(m, x: Tensor) -> str:
        table = auto_table(x.device.type)
        rule = table.kernels.get(kernel) if table is not None else None
        active = (m.shared_heads + m.topk) / m.num_heads
        training = m.training and torch.is_grad_enabled()
        return "sparse" if rule is not None and rule.pays(x.shape[1], x.shape[0], active, training) else "masked"

    return auto


def kernel_class(module_or_class) -> type:
    """The registered kernel class a (composed) attention module or class runs on."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    for klass in cls.__mro__:
        if "kernel_name" in vars(klass):  # set by register_kernel on the registered class itself
            return klass
    raise TypeError(f"{cls.__qualname__} is not an attention kernel")


def sparse_support(module_or_class) -> Optional[SparseSupport]:
    """The kernel's own declaration (never a parent kernel's), or None: masked only."""
    kernel = kernel_class(module_or_class)
    return vars(kernel).get("sparse_moh", BUILTIN_SPARSE_SUPPORT.get(kernel))


def kernels_supporting(impl: str) -> List[str]:
    """Names of the registered kernels that run MoH ``impl`` (registration order)."""
    from .registry import _KERNELS
    return [name for name, cls in _KERNELS.items()
            if (support := sparse_support(cls)) is not None and impl in support.impls]


class PackedRows:
    """The packed (token, routed head) rows of a :class:`Dispatch`, as a kernel's ``attend_rows`` sees them.

    ``image``, ``token``, ``head`` ([R] each): the image, the token position and the head (the
    module's own head index) of each row. ``heads``: the routed heads in routed-pool order (a slice,
    or an index tensor for learned shared heads); :meth:`heads_of` takes them from ``[B, h, ...]``;
    :meth:`head_matmul` multiplies each row by its head's matrix (rows are grouped by head).
    :meth:`pad` lays rows out as ``[B, E, L, ...]`` (head e's rows of image b first, then padding up to
    ``L``, the longest list of any head) for batched products against per-(image, head) keys;
    :meth:`unpad` drops the padding again (padded rows read row 0 and get no gradient).
    """

    def __init__(self, dispatch: Dispatch, heads: Union[slice, Tensor]):
        self.dispatch, self.heads = dispatch, heads
        self.image = dispatch.rows // dispatch.tokens
        self.token = dispatch.rows - self.image * dispatch.tokens
        self.head = dispatch.heads + heads.start if isinstance(heads, slice) else heads[dispatch.heads]
        self._layout = None

    def heads_of(self, t: Tensor) -> Tensor:
        return t if t.shape[1] == 1 else t[:, self.heads]

    def head_matmul(self, t: Tensor, weight: Tensor) -> Tensor:
        """Row r of ``t`` [R, a] times ``weight[head[r]]`` (``weight``: [h, a, b]) -> [R, b]: one GEMM per
        routed head over its contiguous rows."""
        sizes = [stop - start for start, stop in self.dispatch.segments]
        per_head = weight[self.heads].unbind(0)
        return torch.cat([part @ w for part, w in zip(t.split(sizes), per_head)])

    def _padded(self) -> Tuple[Tensor, Tensor, int]:
        if self._layout is None:
            E, L = len(self.dispatch.lengths), max(self.dispatch.lengths)
            self._layout = (*padded_layout(self.dispatch, (L,) * E), L)
        return self._layout

    def pad(self, t: Tensor) -> Tensor:
        """``[R, ...]`` -> ``[B, E, L, ...]``."""
        source, _, L = self._padded()
        E, B = len(self.dispatch.lengths), self.dispatch.batch
        return t.index_select(0, source).view(E, B, L, *t.shape[1:]).transpose(0, 1)

    def unpad(self, t: Tensor) -> Tensor:
        """``[B, E, L, ...]`` -> ``[R, ...]``."""
        _, position, _ = self._padded()
        return t.transpose(0, 1).reshape(-1, *t.shape[3:]).index_select(0, position)


def _head_rows(heads: Tensor, d: int) -> Tensor:
    """Indices of the ``d`` rows of each head in ``heads`` in a head-major ``[h * d, ...]`` weight."""
    return (heads.view(-1, 1) * d + torch.arange(d, device=heads.device)).reshape(-1)


def sparse_kernel_forward(m, x: Tensor, gates: Tensor, index: Tensor, order: Optional[Tensor] = None,
                          routed_attention: Optional[RoutedAttention] = None) -> Tensor:
    """MoH output over a kernel that declares :class:`SparseSupport` without a driver of its own.

    ``gates`` [B, N, h] and ``index`` [B, N, k] as :meth:`MoH.route` returns them; ``order``: for
    learned shared heads, the head order "shared first" (gates in head order; ``index`` relative to
    ``order[h_s:]``). Equals the masked path in value and gradient.
    """
    if routed_attention is not None:
        raise ValueError(f"kernel '{m.kernel_name}' attends its routed rows itself; no routed_attention")
    B, N, C = x.shape
    h, h_s, d = m.num_heads, m.shared_heads, m.head_dim
    E = h - h_s
    w_q, b_q, keys = m.sparse_context(x)
    if order is None:
        shared, routed = slice(0, h_s), slice(h_s, h)
        w_q_shared, w_q_routed = w_q.split([h_s * d, E * d])
        b_q_shared, b_q_routed = b_q.split([h_s * d, E * d]) if b_q is not None else (None, None)
        w_out_shared, w_out_routed = m.proj.weight.split([h_s * d, E * d], dim=1)
    else:
        shared, routed = order[:h_s], order[h_s:]
        rows_shared, rows_routed = _head_rows(shared, d), _head_rows(routed, d)
        w_q_shared, w_q_routed = w_q.index_select(0, rows_shared), w_q.index_select(0, rows_routed)
        if b_q is not None:
            b_q_shared, b_q_routed = b_q.index_select(0, rows_shared), b_q.index_select(0, rows_routed)
        else:
            b_q_shared = b_q_routed = None
        w_out_shared = m.proj.weight.index_select(1, rows_shared)
        w_out_routed = m.proj.weight.index_select(1, rows_routed)
        gates = gates.index_select(-1, order)

    if h_s > 0:
        q_shared = F.linear(x, w_q_shared, b_q_shared).view(B, N, h_s, d).transpose(1, 2)
        y = shared_output(m, m.attend_heads(q_shared, keys, shared), gates, w_out_shared)
    else:  # no shared head: the routed heads start from the bias alone
        y = bias_output(m, B * N, x.dtype, x.device)  # cast to the autocast dtype by the projection

    dispatch = build_dispatch(index, E)
    q_routed = _run_projection(GatheredHeadProjection, x.reshape(B * N, C), w_q_routed, b_q_routed,
                               dispatch.rows, dispatch.segments)
    o_routed = m.attend_rows(q_routed, keys, PackedRows(dispatch, routed))
    y = add_routed_output(m, y, o_routed, gates, w_out_routed, dispatch)
    return m.proj_drop(y)


# ----------------------------------------------------------------------------------------------
# impl="auto" over the ``sdpa`` kernel: when the sparse path pays (other kernels declare their own rule
# with their sparse path, e.g. TransNeXt's in moh_vision/models/transnext.py)
#
# Sparse MoH costs about its FLOP bound (``sparse_flops_ratio``: keys/values for every head plus
# queries, attention and output projection of the active heads, over dense) plus an overhead
# (gathers, scatters, one call per routed head) that shrinks as sequences grow; masked MoH costs
# ~1.00-1.16x dense (it depends on the processor). The measured overheads and limits are data, per device
# type and kind of machine: moh_vision/attention/auto_cpu*.json and auto_cuda.json (how they were measured:
# their provenance), read by moh_vision/attention/auto_table.py and refitted by ``tools/bench_attention.py
# fit=...``. On CUDA (one H100 measured) the sparse path lost everywhere, so its table keeps masked. A device
# type with no table runs the reference path.
# ----------------------------------------------------------------------------------------------
def choose_impl(device: str, tokens: int, dim: int, num_heads: int, head_dim: int, shared_heads: int,
                topk: int, *, batch: int, table: Optional[AutoTable] = None, training: bool = False) -> str:
    """``"sparse"`` or ``"masked"`` for an MoH layer over ``sdpa`` (what ``impl="auto"`` runs) on a call
    of ``batch`` x ``tokens``, a training call (forward and backward) or an inference one; ``table``:
    the thresholds (default: the measured ones for ``device``)."""
    table = auto_table(device) if table is None else table
    if topk == 0 or table is None or table.sdpa is None:
        return "masked"
    bound = sparse_flops_ratio(dim, num_heads, head_dim, tokens, shared_heads, topk)
    return "sparse" if table.sdpa.pays(tokens, batch, dim, head_dim, bound, training) else "masked"


def _sdpa_forward(m, x: Tensor, gates: Tensor, index: Tensor, order: Optional[Tensor] = None,
                  routed_attention: Optional[RoutedAttention] = None) -> Tensor:
    if order is not None:  # the qkv driver wants the shared heads first: permute the heads
        m, gates = HeadPermutedView(m, order), gates.index_select(-1, order)
    return sparse_moh_forward(m, x, gates, index, routed_attention)


def _sdpa_auto(m, x: Tensor) -> str:
    return choose_impl(x.device.type, x.shape[1], m.dim, m.num_heads, m.head_dim, m.shared_heads, m.topk,
                       batch=x.shape[0], training=m.training and torch.is_grad_enabled())


# ``sdpa``'s declaration lives here because this module is its driver (kernels.py cannot import it)
BUILTIN_SPARSE_SUPPORT = {DotProductAttention: SparseSupport(forward=_sdpa_forward, auto=_sdpa_auto)}


def sparse_forward(m, x: Tensor, gates: Tensor, index: Tensor, order: Optional[Tensor] = None,
                   routed_attention: Optional[RoutedAttention] = None) -> Tensor:
    """The sparse MoH output of ``m`` (any kernel with :func:`sparse_support`) for the router's
    ``gates``/``index`` (and head ``order`` for learned shared heads)."""
    support = sparse_support(m)
    if support is None:
        raise ValueError(f"kernel '{m.kernel_name}' has no sparse MoH path")
    driver = support.forward or sparse_kernel_forward
    return driver(m, x, gates, index, order, routed_attention)
