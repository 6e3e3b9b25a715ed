"""Attention kernels: complete dense multi-head attentions, split into the steps variants override.

Every kernel follows one pipeline::

    heads = self.heads(x)            # [B, h, N, d] per-head outputs (projections + attention)
    y = self.output(heads, gates)    # optional per-token head gates, then the output projection

``heads`` reads its queries/keys/values through ``project_q`` / ``project_kv`` / ``project_qkv``,
so a variant that owns other projections (MoA) only overrides those; a variant that weights heads
(MoH) only passes ``gates`` to ``output``. Keys and values may have one head that all query heads
share (``k.shape[1] == 1``); kernels broadcast it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moh_vision.errors import ConfigError
from .registry import register_kernel
from .tracing import FUNC_PREFIX, active_tracer

Tensor = torch.Tensor


def resolve_head_dim(dim: int, num_heads: int, head_dim: Optional[int]) -> int:
    if num_heads < 1:
        raise ConfigError(f"num_heads={num_heads} must be at least 1")
    if head_dim is not None:
        if head_dim < 1:
            raise ConfigError(f"head_dim={head_dim} must be at least 1")
        return int(head_dim)
    if dim % num_heads:
        divisors = [h for h in range(1, dim + 1) if dim % h == 0]
        raise ConfigError(
            f"num_heads={num_heads} does not divide dim={dim}; pass head_dim explicitly "
            f"or use one of num_heads={divisors}"
        )
    return dim // num_heads


def custom_functions_opaque() -> bool:
    """Whether a custom autograd Function would hide its work or break the trace: under ``torch.jit.trace``
    and the ONNX exporter built on it (a Function is one opaque op: the FLOP counter cannot see into it,
    ONNX has no such operator), ``torch.compile`` / ``torch.export`` (which cannot trace their ``out=`` writes
    and fuse plain ops themselves) and ``torch.fx`` (a Function cannot run on proxies). Fast paths built as
    Functions run their plain-op twins then. ``torch.func`` transforms run the Functions themselves (they
    define ``setup_context`` and ``vmap``)."""
    tracer = active_tracer()
    return tracer is not None and not tracer.startswith(FUNC_PREFIX)


def functorch_wrapped(*tensors: Optional[Tensor]) -> bool:
    """Whether any of ``tensors`` is a ``torch.func`` transform's tensor (batched by ``vmap``, tracked by
    ``grad``): a custom Function's backward then runs plain ops (no ``out=`` writes into unbatched buffers)."""
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def fold_vmap_dim(info, in_dims, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """For a Function's ``vmap`` rule: every tensor with its vmapped dim (``in_dims``; None: unbatched, expanded)
    moved to the front and folded into its leading batch dim, ``[V, B, ...] -> [V * B, ...]``."""
    folded = []
    for t, dim in zip(tensors, in_dims):
        if t is None:
            folded.append(None)
            continue
        t = t.movedim(dim, 0) if dim is not None else t.unsqueeze(0).expand(info.batch_size, *t.shape)
        folded.append(t.flatten(0, 1))
    return tuple(folded)


class GatedMerge(torch.autograd.Function):
    """``(o * gates) -> [B, N, h * d]`` for ``o`` [B, h, N, d] and ``gates`` [B, N, h], in one pass: the gate
    multiply writes the merged layout directly (multiply, then merge, would read and write ``o`` twice;
    the same for its gradient). The values are those of the two-step form (same elementwise products).

    ``torch.func`` transforms: ``setup_context`` (``grad``, ``vjp``, ``jacrev``), a ``vmap`` rule that folds the
    vmapped dim into the batch, and a plain-op backward for batched or transform-tracked gradients."""

    @staticmethod
    def forward(o: Tensor, gates: Tensor) -> Tensor:
        B, h, N, d = o.shape
        out = torch.empty(B, N, h, d, dtype=o.dtype, device=o.device)
        torch.mul(o.transpose(1, 2), gates.to(o.dtype).unsqueeze(-1), out=out)
        return out.view(B, N, h * d)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        o, gates = inputs
        ctx.save_for_backward(o, gates.to(o.dtype))
        ctx.gates_dtype = gates.dtype

    @staticmethod
    def vmap(info, in_dims, o: Tensor, gates: Tensor):
        V = info.batch_size
        o, gates = fold_vmap_dim(info, in_dims, o, gates)
        return GatedMerge.apply(o, gates).unflatten(0, (V, -1)), 0

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        o, g = ctx.saved_tensors
        B, h, N, d = o.shape
        grad = grad.reshape(B, N, h, d)
        grad_o = grad_gates = None
        if functorch_wrapped(grad, o, g):  # plain ops: the transform batches or tracks them
            if ctx.needs_input_grad[0]:
                grad_o = (grad * g.unsqueeze(-1)).transpose(1, 2)
            if ctx.needs_input_grad[1]:
                grad_gates = (grad * o.transpose(1, 2)).sum(-1).to(ctx.gates_dtype)
            return grad_o, grad_gates
        if ctx.needs_input_grad[0]:  # in o's own layout, so attention's backward gets what it expects
            grad_o = torch.empty_like(o)
            torch.mul(grad.transpose(1, 2), g.transpose(1, 2).unsqueeze(-1), out=grad_o)
        if ctx.needs_input_grad[1]:
            grad_gates = torch.linalg.vecdot(grad, o.transpose(1, 2)).to(ctx.gates_dtype)
        return grad_o, grad_gates


class HeadAttention(nn.Module):
    """Base of every kernel: dims, projections, and the gated output projection."""

    kernel_name = "base"
    is_routed = False
    # FLOPs: which children scale with the heads a token activates (see registry.flops_roles_of)
    flops_roles = {"qkv": "query_rows", "proj": "per_head", "proj_drop": "fixed"}

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: Optional[int] = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ):
        super().__init__()
        self.dim = int(dim)
        self.num_heads = int(num_heads)
        self.head_dim = resolve_head_dim(self.dim, self.num_heads, head_dim)
        self.inner_dim = self.num_heads * self.head_dim
        self.attn_drop = float(attn_drop)
        self.init_projections(qkv_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    # --- projections (overridden by variants that own different ones, e.g. MoA) --------------
    def init_projections(self, qkv_bias: bool) -> None:
        self.qkv = nn.Linear(self.dim, 3 * self.inner_dim, bias=qkv_bias)
        self.proj = nn.Linear(self.inner_dim, self.dim)

    def split_heads(self, t: Tensor, heads: int) -> Tensor:
        """[B, N, heads * d] -> [B, heads, N, d]."""
        B, N, _ = t.shape
        return t.reshape(B, N, heads, self.head_dim).transpose(1, 2)

    def project_qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return self.split_qkv(self.qkv(x))

    def split_qkv(self, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The ``qkv`` projection's output ``[B, N, 3 * h * d]`` (any row stride) -> q, k, v ``[B, h, N, d]``
        (views)."""
        B, N, _ = qkv.shape
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    # --- the kernel ----------------------------------------------------------------------------
    def heads(self, x: Tensor) -> Tensor:
        """Per-head attention outputs ``[B, h, N, d]`` before the output projection."""
        raise NotImplementedError

    # A kernel whose ``heads(x)`` is ``heads_from_qkv(x, self.qkv(x))`` defines this method; MoH then computes
    # ``qkv`` and its routers' logits in one GEMM (:mod:`~moh_vision.attention.fused_projection`). None: it does not.
    heads_from_qkv = None

    # --- output ----------------------------------------------------------------------------------
    def merge_heads(self, o: Tensor, gates: Optional[Tensor] = None) -> Tensor:
        """[B, h, N, d] (times per-token gates [B, N, h]) -> [B, N, h * d]."""
        B, h, N, d = o.shape
        if gates is None:
            return o.transpose(1, 2).reshape(B, N, h * d)
        if isinstance(o, torch.fx.Proxy) or (o.stride(1) == d and o.stride(2) == h * d and o.stride(3) == 1) \
                or custom_functions_opaque():
            # heads already laid out [B, N, h, d] (SDPA's output): the plain multiply writes the merged layout
            # itself, and autograd's nodes cost less than a Function's (1-1.5% of a 196-token MoH layer's
            # fwd+bwd, `git show 57504dd:docs/performance-log.md`); the same products, so the same values and
            # gradients as GatedMerge
            gates = gates.unsqueeze(-1)
            if isinstance(o, torch.fx.Proxy) or gates.dtype != o.dtype:  # eagerly, a cast only where one is due
                gates = gates.to(o.dtype)
            return (o.transpose(1, 2) * gates).reshape(B, N, h * d)
        return GatedMerge.apply(o, gates)

    def output(self, o: Tensor, gates: Optional[Tensor] = None) -> Tensor:
        return self.project_merged(self.merge_heads(o, gates))

    def project_merged(self, merged: Tensor) -> Tensor:
        """The output projection (and its dropout) of the merged heads ``[B, N, h * d]``."""
        return self.proj_drop(self.proj(merged))

    def forward(self, x: Tensor) -> Tensor:
        return self.output(self.heads(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"


def broadcast_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``k``/``v`` with a single shared head broadcast to ``q``'s heads. Eagerly only where the head counts
    differ (two operators fewer per dense layer call: a launch each on a GPU); under torch.fx always, as a
    no-op view where they match (a comparison of traced shapes cannot steer Python)."""
    if isinstance(q, torch.fx.Proxy) or k.shape[1] != q.shape[1]:
        return k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
    return k, v


def dot_product_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, fused: bool = True,
                          scale: Optional[float] = None) -> Tensor:
    """softmax(q k^T * scale) v over the last two dims; k/v may have a single shared head."""
    k, v = broadcast_kv_heads(q, k, v)
    if fused:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = (q * scale) @ k.transpose(-2, -1)
    attn = attn.softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v


@register_kernel("sdpa")
class DotProductAttention(HeadAttention):
    """Scaled dot-product multi-head attention in timm's ``Attention`` layout (``qkv``, ``proj``).

    ``fused_attn=True`` calls ``F.scaled_dot_product_attention`` (flash/memory-efficient kernels
    where available); ``False`` runs the explicit softmax, which some analysis tools need.
    """

    flops_roles = {"q_norm": "per_head", "k_norm": "fixed"}

    def __init__(self, dim: int, num_heads: int, head_dim: Optional[int] = None, qkv_bias: bool = True,
                 qk_norm: bool = False, attn_drop: float = 0.0, proj_drop: float = 0.0, fused_attn: bool = True):
        super().__init__(dim, num_heads, head_dim=head_dim, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        self.fused_attn = fused_attn
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = self.q_norm(q), self.k_norm(k)
        return dot_product_attention(q, k, v, self.attn_drop if self.training else 0.0, self.fused_attn)

    def heads(self, x: Tensor) -> Tensor:
        return self.attend(*self.project_qkv(x))

    def heads_from_qkv(self, x: Tensor, qkv: Tensor) -> Tensor:
        """:meth:`heads` from the ``qkv`` projection's output (``[B, N, 3 * h * d]``, any row stride)."""
        return self.attend(*self.split_qkv(qkv))
