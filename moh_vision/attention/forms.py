"""Attention forms: complete dense multi-head attentions, split into the steps variants override.

Every form follows one pipeline::

    heads = self.heads(x)            # [B, h, N, d] per-head outputs (projections + attention)
    y = self.output(heads, gates)    # optional per-token head gates, then the output projection

``heads`` reads its queries/keys/values through ``project_q`` / ``project_kv`` / ``project_qkv``, so a variant that owns
other projections (MoA) only overrides those; a variant that weights heads (MoH) only passes ``gates`` to ``output``.
Keys and values may have one head that all query heads share (``k.shape[1] == 1``); forms broadcast it."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels, merge_heads
from .registry import register_form

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


class HeadAttention(nn.Module):
    """Base of every kernel: dims, projections, and the gated output projection. ``kernels``: the ``kernels``
    config (:class:`~moh_vision.ops.Kernels`, plain configuration) that picks each op's implementation."""

    form_name = "base"
    is_routed = False
    # FLOPs: which children scale with the heads a token activates (see registry.flops_roles_of)
    flops_roles = {"qkv": "query_rows", "proj": "per_head", "proj_drop": "fixed"}

    def __init__(self, dim: int, num_heads: int, head_dim: Optional[int] = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, kernels: Optional[Kernels] = None):
        super().__init__()
        self.kernels = Kernels.of(kernels)
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
        """The ``qkv`` projection's output ``[B, N, 3 * h * d]`` (any row stride) -> views q, k, v ``[B, h, N, d]``."""
        B, N, _ = qkv.shape
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    # --- the form ------------------------------------------------------------------------------
    def heads(self, x: Tensor) -> Tensor:
        """Per-head attention outputs ``[B, h, N, d]`` before the output projection."""
        raise NotImplementedError

    # --- output ----------------------------------------------------------------------------------
    def output(self, o: Tensor, gates: Optional[Tensor] = None) -> Tensor:
        return self.project_merged(merge_heads(o, gates))

    def project_merged(self, merged: Tensor) -> Tensor:
        """The output projection (and its dropout) of the merged heads ``[B, N, h * d]``."""
        return self.proj_drop(self.proj(merged))

    def forward(self, x: Tensor) -> Tensor:
        return self.output(self.heads(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"


def broadcast_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``k``/``v`` with a single shared head (MoA) broadcast to ``q``'s heads (views; a no-op where they match)."""
    return k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)


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


@register_form("sdpa")
class DotProductAttention(HeadAttention):
    """Scaled dot-product multi-head attention in timm's ``Attention`` layout (``qkv``, ``proj``). ``fused_attn=True``
    calls ``F.scaled_dot_product_attention`` (flash/memory-efficient kernels where available); ``False`` runs the
    explicit softmax, which some analysis tools need."""

    flops_roles = {"q_norm": "per_head", "k_norm": "fixed"}

    def __init__(self, dim: int, num_heads: int, head_dim: Optional[int] = None, qkv_bias: bool = True,
                 qk_norm: bool = False, attn_drop: float = 0.0, proj_drop: float = 0.0, fused_attn: bool = True,
                 kernels: Optional[Kernels] = None):
        super().__init__(dim, num_heads, head_dim=head_dim, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, kernels=kernels)
        self.fused_attn = fused_attn
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = self.q_norm(q), self.k_norm(k)
        return dot_product_attention(q, k, v, self.attn_drop if self.training else 0.0, self.fused_attn)

    def heads(self, x: Tensor) -> Tensor:
        return self.attend(*self.project_qkv(x))
