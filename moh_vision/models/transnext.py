"""TransNeXt (Shi, CVPR 2024) and MoH-ViT (Jin et al., ICML 2025): a four-stage hierarchical ViT.

Every stage is an overlapping patch embedding followed by blocks of ``norm1 -> attention`` and
``norm2 -> convolutional GLU``. Stages 1-3 use *aggregated attention*: each query attends to its
3x3 neighbourhood and to a pooled summary of the whole map under one softmax. Stage 4 (stride 32)
uses full cosine attention with a continuous position bias.

The attention is pluggable: this file registers two attention *kernels* (``transnext_aggregated``
and ``transnext_full``) and every block asks the registry for ``build_attention(name, ...)`` over
the right kernel, so ``attention="mha" | "moh" | "moa"`` works in all four stages. MoH-ViT is
TransNeXt with ``attention="moh"`` in every stage and the official per-stage ``shared_heads`` and
``topk``.

Parameter names follow the official TransNeXt / MoH-ViT checkpoints (``patch_embed{i}``,
``block{i}.{j}.attn.qkv`` ...), so their weights load with ``strict=True``. Every buffer (position
indices, padding mask, length scale) is non-persistent and derived from the construction-time
resolution, as in the official code; the model therefore runs at exactly ``img_size``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, to_2tuple, trunc_normal_
from timm.models import register_model

from moh_vision.attention import HeadAttention, attention_options, build_attention, layer_options, register_kernel
from moh_vision.errors import ConfigError
from .factory import preset_arguments

Tensor = torch.Tensor
Size2 = Tuple[int, int]

__all__ = ["TransNeXt", "TransNeXtFullAttention", "TransNeXtAggregatedAttention"]

NUM_STAGES = 4
STAGE_STRIDES = (4, 8, 16, 32)
INIT_TEMPERATURE = 1.0 / 0.24  # softplus(temperature) starts here
CPB_HIDDEN = 512


# ----------------------------------------------------------------------------------------------
# Position tables (computed once at construction, on the CPU, never saved in checkpoints)
# ----------------------------------------------------------------------------------------------
def _axis_offsets(query_len: int, key_len: int, pretrain_len: int) -> Tensor:
    """Offsets ``[query_len, key_len]`` between query positions and (average-pooled) key positions
    along one axis, in units of the pretraining grid scaled to span 8."""
    q = torch.arange(query_len, dtype=torch.float32, device="cpu")
    k = F.adaptive_avg_pool1d(q[None], key_len)[0]
    # A one-cell pretraining grid has no extent; the official 0/0 would give NaN, so divide by 1.
    return (q[:, None] - k[None, :]) / max(pretrain_len - 1, 1) * 8


def _log_spaced(offset: Tensor) -> Tensor:
    """``sign(d) * log2(|d| + 1) / log2(8)``: fine near zero, compressed far away."""
    return torch.sign(offset) * torch.log2(offset.abs() + 1.0) / math.log2(8)


@functools.lru_cache(maxsize=64)  # every block of a stage asks for the same tables; callers get copies
@torch.no_grad()
def _cached_coordinate_table(query_size: Size2, key_size: Size2, pretrain_size: Size2) -> Tuple[Tensor, Tensor, Tensor]:
    values_h, index_h = torch.unique(_axis_offsets(query_size[0], key_size[0], pretrain_size[0]), return_inverse=True)
    values_w, index_w = torch.unique(_axis_offsets(query_size[1], key_size[1], pretrain_size[1]), return_inverse=True)
    grid_h, grid_w = torch.meshgrid(values_h, values_w, indexing="ij")
    table = _log_spaced(torch.stack([grid_h, grid_w], dim=-1).reshape(-1, 2))
    return table, index_h, index_w


def relative_coordinate_table(query_size: Size2, key_size: Size2,
                              pretrain_size: Size2) -> Tuple[Tensor, Tensor, Tensor]:
    """Log-spaced relative coordinates for the continuous position bias.

    Returns ``table [Uh * Uw, 2]`` (every distinct (row offset, column offset) pair) and
    ``index_h [Hq, Hk]``, ``index_w [Wq, Wk]`` into its rows and columns. Offsets along the two axes
    are independent, so the table is the product of the distinct per-axis offsets and the
    ``N x M`` index the official code stores is never materialised (it reaches gigabytes at large
    inputs): :meth:`_TransNeXtAttention.position_bias` gathers with the two small indices instead.
    """
    key = (tuple(query_size), tuple(key_size), tuple(pretrain_size))
    return tuple(t.clone() for t in _cached_coordinate_table(*key))


@functools.lru_cache(maxsize=64)
@torch.no_grad()
def _cached_window_mask(resolution: Size2, window_size: int) -> Tuple[Tensor, Tensor]:
    ones = torch.ones(1, 1, *resolution, device="cpu")
    inside = F.unfold(ones, window_size, padding=window_size // 2)[0].transpose(0, 1)  # [N, ws^2]
    return inside.sum(dim=-1, keepdim=True), inside == 0


def local_window_mask(resolution: Size2, window_size: int) -> Tuple[Tensor, Tensor]:
    """For a ``window_size`` neighbourhood with zero padding: the number of in-image neighbours of
    each position ``[N, 1]`` and the mask of out-of-image slots ``[N, window_size ** 2]``."""
    return tuple(t.clone() for t in _cached_window_mask(tuple(resolution), window_size))


def _inverse_softplus(value: float, shape: Sequence[int]) -> Tensor:
    return torch.log(torch.full(tuple(shape), value).exp() - 1)


# ----------------------------------------------------------------------------------------------
# Attention kernels
# ----------------------------------------------------------------------------------------------
class _TransNeXtAttention(HeadAttention):
    """What both TransNeXt kernels share: length-scaled cosine queries and the position-bias MLP.

    Queries are L2-normalised, shifted by a learnable ``query_embedding`` and multiplied by
    ``softplus(temperature) * seq_length_scale`` (log of the number of keys a query sees), so the
    attention sharpness does not drift with the input size; keys are L2-normalised.
    """

    def __init__(self, dim: int, num_heads: int, input_resolution: Union[int, Size2],
                 pretrain_size: Optional[Union[int, Size2]] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__(dim, num_heads, head_dim=head_dim, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        self.input_resolution = to_2tuple(input_resolution)
        self.pretrain_size = to_2tuple(pretrain_size or self.input_resolution)
        if min(self.input_resolution) < 1 or min(self.pretrain_size) < 1:
            raise ConfigError(f"{type(self).__name__}: input_resolution={self.input_resolution} and "
                              f"pretrain_size={self.pretrain_size} must be positive")
        self.num_tokens = self.input_resolution[0] * self.input_resolution[1]
        self.temperature = nn.Parameter(_inverse_softplus(INIT_TEMPERATURE, (self.num_heads, 1, 1)))
        self.query_embedding = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(self.num_heads, 1, self.head_dim), std=0.02))

    def init_position_mlp(self, key_size: Size2) -> None:
        """The continuous position bias: an MLP over log-spaced (query - key) offsets."""
        self.cpb_fc1 = nn.Linear(2, CPB_HIDDEN)
        self.cpb_act = nn.ReLU()
        self.cpb_fc2 = nn.Linear(CPB_HIDDEN, self.num_heads)
        table, index_h, index_w = relative_coordinate_table(self.input_resolution, key_size, self.pretrain_size)
        self.bias_grid = (int(index_h.max()) + 1, int(index_w.max()) + 1)  # distinct row / column offsets
        self.register_buffer("relative_coords_table", table, persistent=False)
        self.register_buffer("relative_index_h", index_h, persistent=False)
        self.register_buffer("relative_index_w", index_w, persistent=False)

    def position_bias(self) -> Tensor:
        """``[h, N, M]`` bias from every query position to every key position."""
        table = self.cpb_fc2(self.cpb_act(self.cpb_fc1(self.relative_coords_table)))  # [Uh * Uw, h]
        table = table.transpose(0, 1).reshape(self.num_heads, *self.bias_grid)
        index_h, index_w = self.relative_index_h, self.relative_index_w  # [Hq, Hk], [Wq, Wk]
        bias = table[:, index_h[:, None, :, None], index_w[None, :, None, :]]  # [h, Hq, Wq, Hk, Wk]
        return bias.reshape(self.num_heads, self.num_tokens, -1)

    def scale_queries(self, q_norm: Tensor) -> Tensor:
        scaled = (q_norm + self.query_embedding) * F.softplus(self.temperature) * self.seq_length_scale
        return scaled.to(q_norm.dtype)  # fp32 parameters must not promote bf16/fp16 activations

    def check_tokens(self, x: Tensor) -> None:
        if x.shape[1] != self.num_tokens:
            H, W = self.input_resolution
            raise ConfigError(
                f"{type(self).__name__} was built for a {H}x{W} token grid ({self.num_tokens} tokens) but got "
                f"{x.shape[1]} tokens; build the model with the img_size of its inputs")

    @staticmethod
    def check_kv_heads(q: Tensor, k: Tensor) -> None:
        if k.shape[1] not in (1, q.shape[1]):
            raise ValueError(f"keys have {k.shape[1]} heads; expected 1 (shared) or {q.shape[1]}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, input_resolution={self.input_resolution}, pretrain_size={self.pretrain_size}"


@register_kernel("transnext_full")
class TransNeXtFullAttention(_TransNeXtAttention):
    """Stage-4 attention: every token attends to every token, ``softmax(q_s k_n^T + B) v`` with
    length-scaled cosine queries ``q_s``, normalised keys ``k_n`` and the continuous position bias
    ``B``. Fused ``qkv`` projection and ``proj`` output, as in the official checkpoints.

    ``fused_attn=True`` runs ``F.scaled_dot_product_attention`` with the bias as an additive mask
    (scale 1, since the queries already carry the temperature); ``False`` runs the explicit softmax.
    """

    def __init__(self, dim: int, num_heads: int, input_resolution: Union[int, Size2],
                 pretrain_size: Optional[Union[int, Size2]] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0, fused_attn: bool = True):
        super().__init__(dim, num_heads, input_resolution, pretrain_size=pretrain_size, head_dim=head_dim,
                         qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.fused_attn = fused_attn
        self.register_buffer("seq_length_scale", torch.tensor(math.log(self.num_tokens)), persistent=False)
        self.init_position_mlp(self.input_resolution)

    def heads(self, x: Tensor) -> Tensor:
        self.check_tokens(x)
        q, k, v = self.project_qkv(x)
        self.check_kv_heads(q, k)
        q = self.scale_queries(F.normalize(q, dim=-1))
        k = F.normalize(k, dim=-1)
        bias = self.position_bias().to(q.dtype)
        dropout = self.attn_drop if self.training else 0.0
        if self.fused_attn:
            if k.shape[1] != q.shape[1]:
                k, v = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        attn = (q @ k.transpose(-2, -1) + bias).softmax(dim=-1)
        attn = F.dropout(attn, dropout) if dropout else attn
        return attn @ v


@register_kernel("transnext_aggregated")
class TransNeXtAggregatedAttention(_TransNeXtAttention):
    """Stages 1-3: pixel-focused local attention and pooled global attention under ONE softmax.

    Each query sees (a) its ``window_size x window_size`` neighbourhood (zero-padded at the border,
    padded slots masked, plus a learned per-head ``relative_pos_bias_local``) and (b) ``P`` pooled
    tokens, ``LayerNorm(AdaptiveAvgPool(GELU(sr(x))))`` with the continuous position bias, where the
    pool side is ``resolution // sr_ratio`` (or ``fixed_pool_size``). The length scale is
    ``log(in-image neighbours + P)`` per position. The local value sum gets an extra, query-dependent
    weight ``q_norm @ learnable_tokens + learnable_bias`` (not softmaxed).

    Queries come from ``project_q(x)``, keys/values from ``project_kv`` applied to the tokens (local)
    and to the pooled tokens; projections are ``q`` and ``kv`` as in the official checkpoints.
    """

    def __init__(self, dim: int, num_heads: int, input_resolution: Union[int, Size2], sr_ratio: int,
                 window_size: int = 3, fixed_pool_size: Optional[int] = None,
                 pretrain_size: Optional[Union[int, Size2]] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__(dim, num_heads, input_resolution, pretrain_size=pretrain_size, head_dim=head_dim,
                         qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        H, W = self.input_resolution
        if window_size < 1 or window_size % 2 == 0:
            raise ConfigError(f"aggregated attention window_size={window_size} must be a positive odd number")
        if fixed_pool_size is None:
            self.pool_size = (H // sr_ratio, W // sr_ratio)
        else:
            if not 0 < fixed_pool_size < min(H, W):
                raise ConfigError(f"fixed_pool_size={fixed_pool_size} must be in 1..{min(H, W) - 1} "
                                  f"(below the shorter side of the {H}x{W} token grid)")
            self.pool_size = (fixed_pool_size, fixed_pool_size)
        if min(self.pool_size) < 1:
            raise ConfigError(f"sr_ratio={sr_ratio} pools the {H}x{W} token grid to nothing; "
                              f"use sr_ratio <= {min(H, W)}")
        self.sr_ratio, self.window_size = sr_ratio, window_size
        self.local_len = window_size ** 2
        self.pool_len = self.pool_size[0] * self.pool_size[1]

        self.relative_pos_bias_local = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(self.num_heads, self.local_len), std=0.0004))
        self.learnable_tokens = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(self.num_heads, self.head_dim, self.local_len), std=0.02))
        self.learnable_bias = nn.Parameter(torch.zeros(self.num_heads, 1, self.local_len))
        self.sr = nn.Conv2d(dim, dim, kernel_size=1)
        self.norm = nn.LayerNorm(dim)
        self.act = nn.GELU()
        self.init_position_mlp(self.pool_size)

        neighbours, padding_mask = local_window_mask(self.input_resolution, window_size)
        self.register_buffer("seq_length_scale", torch.log(neighbours + self.pool_len), persistent=False)
        self.register_buffer("padding_mask", padding_mask, persistent=False)

    def init_projections(self, qkv_bias: bool) -> None:
        self.q = nn.Linear(self.dim, self.inner_dim, bias=qkv_bias)
        self.kv = nn.Linear(self.dim, 2 * self.inner_dim, bias=qkv_bias)
        self.proj = nn.Linear(self.inner_dim, self.dim)

    def project_q(self, x: Tensor) -> Tensor:
        return self.split_heads(self.q(x), self.num_heads)

    def project_kv(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.split_heads(k, self.num_heads), self.split_heads(v, self.num_heads)

    def pooled_tokens(self, x: Tensor) -> Tensor:
        """``[B, N, C]`` -> ``[B, P, C]``: 1x1 conv, GELU, adaptive average pool, LayerNorm."""
        B, N, C = x.shape
        image = x.transpose(1, 2).reshape(B, C, *self.input_resolution)
        pooled = F.adaptive_avg_pool2d(self.act(self.sr(image)), self.pool_size)
        return self.norm(pooled.flatten(2).transpose(1, 2))

    def unfold_heads(self, t: Tensor) -> Tensor:
        """``[B, h, N, d]`` -> ``[B, h, N, d, window ** 2]``: each position's zero-padded neighbourhood."""
        B, h, N, d = t.shape
        image = t.transpose(-2, -1).reshape(B, h * d, *self.input_resolution)
        windows = F.unfold(image, self.window_size, padding=self.window_size // 2)  # [B, h*d*ws^2, N]
        return windows.reshape(B, h, d, self.local_len, N).permute(0, 1, 4, 2, 3)

    def heads(self, x: Tensor) -> Tensor:
        self.check_tokens(x)
        q_norm = F.normalize(self.project_q(x), dim=-1)
        q = self.scale_queries(q_norm)  # [B, h, N, d]

        k_local, v_local = self.project_kv(x)  # [B, hk, N, d], hk in (1, h)
        self.check_kv_heads(q, k_local)
        k_local = self.unfold_heads(F.normalize(k_local, dim=-1))  # [B, hk, N, d, L]
        v_local = self.unfold_heads(v_local)
        logits_local = (q.unsqueeze(-2) @ k_local).squeeze(-2) + self.relative_pos_bias_local.unsqueeze(1)
        logits_local = logits_local.masked_fill(self.padding_mask, float("-inf"))  # [B, h, N, L]

        k_pool, v_pool = self.project_kv(self.pooled_tokens(x))  # [B, hk, P, d]
        logits_pool = q @ F.normalize(k_pool, dim=-1).transpose(-2, -1) + self.position_bias().to(q.dtype)

        attn = torch.cat([logits_local, logits_pool], dim=-1).softmax(dim=-1)
        if self.training and self.attn_drop:
            attn = F.dropout(attn, self.attn_drop)
        attn_local, attn_pool = attn.split([self.local_len, self.pool_len], dim=-1)
        # Padded slots hold zero values, so the unmasked dynamic weight adds nothing there.
        weight_local = q_norm @ self.learnable_tokens + self.learnable_bias + attn_local  # [B, h, N, L]
        out_local = (weight_local.unsqueeze(-2) @ v_local.transpose(-2, -1)).squeeze(-2)
        return out_local + attn_pool @ v_pool

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window_size={self.window_size}, pool_size={self.pool_size}"


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------
class DWConv(nn.Module):
    """3x3 depthwise convolution over a token sequence laid out as an ``H x W`` image."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        B, N, C = x.shape
        x = self.dwconv(x.transpose(1, 2).reshape(B, C, H, W))
        return x.flatten(2).transpose(1, 2)


class ConvolutionalGLU(nn.Module):
    """``fc2(GELU(dwconv(a)) * b)`` with ``(a, b) = fc1(x)``; the gate branch sees its 3x3
    neighbourhood, which is what gives TransNeXt position information without embeddings.
    ``hidden_features`` is scaled by 2/3 so the two-branch ``fc1`` costs what a plain MLP would."""

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0):
        super().__init__()
        hidden = int(2 * hidden_features / 3)
        self.fc1 = nn.Linear(in_features, 2 * hidden)
        self.dwconv = DWConv(hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, in_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        x, gate = self.fc1(x).chunk(2, dim=-1)
        x = self.drop(self.act(self.dwconv(x, H, W)) * gate)
        return self.drop(self.fc2(x))


class OverlapPatchEmbed(nn.Module):
    """Strided convolution with overlapping windows (``kernel > stride``), then LayerNorm.

    The LayerNorm keeps PyTorch's default eps (1e-5), as the official code does here.
    """

    def __init__(self, patch_size: int, stride: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=stride, padding=patch_size // 2)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: Tensor) -> Tuple[Tensor, int, int]:
        x = self.proj(x)
        H, W = x.shape[-2:]
        return self.norm(x.flatten(2).transpose(1, 2)), H, W


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm1(x))``, then ``x + ConvGLU(norm2(x))``."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float, drop: float = 0.0, drop_path: float = 0.0,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = ConvolutionalGLU(dim, int(dim * mlp_ratio), drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x), H, W))


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
# Kernel arguments the model derives per stage; an attention option may not set them.
_STAGE_ARGUMENTS = ("input_resolution", "pretrain_size", "sr_ratio", "window_size", "fixed_pool_size", "qkv_bias",
                    "attn_drop", "proj_drop")


def _per_stage(value: Any, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * NUM_STAGES
    if len(values) != NUM_STAGES:
        raise ConfigError(f"TransNeXt {name} needs {NUM_STAGES} per-stage values, got {len(values)}: {value}")
    return values


def _image_size(value: Union[int, Sequence[int]], name: str) -> Size2:
    size = to_2tuple(value)
    if len(size) != 2 or any(int(s) != s or s < 32 or s % 32 for s in size):
        raise ConfigError(f"TransNeXt {name}={value} must be a positive multiple of 32 (the stage-4 stride), "
                          f"e.g. 32, 64, 224 or 256")
    return int(size[0]), int(size[1])


class TransNeXt(nn.Module):
    """TransNeXt with pluggable attention; ``attention="moh"`` gives MoH-ViT.

    Args:
        img_size: input side (or ``(H, W)``), a multiple of 32. The position tables are built for
            it, so inputs must have exactly this size.
        pretrain_size: the size the weights were trained at (default ``img_size``); the position-bias
            coordinates are scaled by it, so fine-tuning a 224 model at 384 keeps ``pretrain_size=224``.
        embed_dims, num_heads, mlp_ratios, depths, sr_ratios: per-stage values (4 each).
        window_size: local window of the aggregated stages (int or per-stage list).
        fixed_pool_size: pooled grid side of the aggregated stages (default ``resolution // sr_ratio``).
        attention: a registered attention name (``mha``, ``moh``, ``moa``, ...) or one per stage.
        **attention_options: passed to ``build_attention`` in every stage; a list/tuple of 4 gives one
            value per stage, and a per-stage ``None`` means "that attention's default".

    A stage with ``sr_ratio == 1`` uses full attention, the others aggregated attention.
    """

    def __init__(
        self,
        img_size: Union[int, Sequence[int]] = 224,
        pretrain_size: Optional[Union[int, Sequence[int]]] = None,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: Sequence[int] = (72, 144, 288, 576),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        mlp_ratios: Sequence[float] = (8, 8, 4, 4),
        depths: Sequence[int] = (2, 2, 15, 2),
        sr_ratios: Sequence[int] = (8, 4, 2, 1),
        window_size: Union[int, Sequence[Optional[int]]] = 3,
        fixed_pool_size: Optional[int] = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        qkv_bias: bool = True,
        attention: Union[str, Sequence[str]] = "mha",
        **attention_options: Any,
    ):
        super().__init__()
        self.img_size = _image_size(img_size, "img_size")
        self.pretrain_size = _image_size(pretrain_size or self.img_size, "pretrain_size")
        embed_dims, num_heads = _per_stage(embed_dims, "embed_dims"), _per_stage(num_heads, "num_heads")
        mlp_ratios, depths = _per_stage(mlp_ratios, "mlp_ratios"), _per_stage(depths, "depths")
        sr_ratios, window_sizes = _per_stage(sr_ratios, "sr_ratios"), _per_stage(window_size, "window_size")
        attention_names = _per_stage(attention, "attention")
        clashes = sorted(set(attention_options) & set(_STAGE_ARGUMENTS))
        if clashes:
            raise ConfigError(f"TransNeXt sets the attention argument(s) {', '.join(clashes)} itself per stage; "
                              f"use the model arguments (img_size, pretrain_size, sr_ratios, window_size, "
                              f"fixed_pool_size, qkv_bias, attn_drop_rate, drop_rate) instead")

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.embed_dims, self.depths, self.num_stages = embed_dims, depths, NUM_STAGES
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.attention = attention_names

        drop_path = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()
        for i in range(NUM_STAGES):
            stride = STAGE_STRIDES[i]
            resolution = (self.img_size[0] // stride, self.img_size[1] // stride)
            kernel_args: Dict[str, Any] = dict(
                input_resolution=resolution,
                pretrain_size=(self.pretrain_size[0] // stride, self.pretrain_size[1] // stride),
                qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate)
            if sr_ratios[i] == 1:
                kernel = "transnext_full"
            else:
                kernel = "transnext_aggregated"
                kernel_args.update(sr_ratio=sr_ratios[i], window_size=window_sizes[i] or 3,
                                   fixed_pool_size=fixed_pool_size)
            options = {k: v for k, v in layer_options(attention_options, i, NUM_STAGES).items() if v is not None}
            self._check_options(attention_names[i], kernel, options)

            first = i == 0
            patch_embed = OverlapPatchEmbed(patch_size=7 if first else 3, stride=4 if first else 2,
                                            in_chans=in_chans if first else embed_dims[i - 1], embed_dim=embed_dims[i])
            start = sum(depths[:i])
            blocks = nn.ModuleList([
                Block(embed_dims[i],
                      build_attention(attention_names[i], embed_dims[i], num_heads[i], kernel=kernel,
                                      **kernel_args, **options),
                      mlp_ratio=mlp_ratios[i], drop=drop_rate, drop_path=drop_path[start + j])
                for j in range(depths[i])])
            setattr(self, f"patch_embed{i + 1}", patch_embed)
            setattr(self, f"block{i + 1}", blocks)
            setattr(self, f"norm{i + 1}", nn.LayerNorm(embed_dims[i], eps=1e-6))

        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()
        self.pretrained_cfg = self.default_cfg = self._default_cfg()

    @staticmethod
    def _check_options(name: str, kernel: str, options: Dict[str, Any]) -> None:
        allowed = [o for o in attention_options(name, kernel) if o not in _STAGE_ARGUMENTS]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(f"TransNeXt got unknown argument(s) {', '.join(unknown)}: neither a model argument nor "
                              f"an option of attention '{name}' (it takes: {', '.join(allowed) or 'nothing'})")

    def _default_cfg(self) -> Dict[str, Any]:
        if self.in_chans == 3:
            mean, std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
        else:  # grey or multi-band input: the average ImageNet statistics per channel
            mean, std = (0.449,) * self.in_chans, (0.226,) * self.in_chans
        return dict(url="", num_classes=self.num_classes, input_size=(self.in_chans, *self.img_size), pool_size=None,
                    crop_pct=0.875, interpolation="bicubic", fixed_input_size=True, mean=mean, std=std,
                    first_conv="patch_embed1.proj", classifier="head")

    # --- initialisation (as the official code: every Linear, routers included) ----------------
    def init_weights(self) -> None:
        if next(self.parameters()).is_meta:
            return  # a shape-only model (``torch.device("meta")``): nothing to initialise
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels // module.groups
                nn.init.normal_(module.weight, 0.0, math.sqrt(2.0 / fan_out))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # Variants with their own router start (MoA: a uniform, zero router) get it back.
        for module in self.modules():
            if hasattr(module, "reset_router") and hasattr(module, "attention_name"):
                module.reset_router()

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set()

    @torch.jit.ignore
    def no_weight_decay_keywords(self) -> set:
        return {"query_embedding", "relative_pos_bias_local", "cpb", "temperature"}

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool not in (None, "", "avg"):
            raise ConfigError(f"TransNeXt pools by averaging tokens; global_pool='{global_pool}' is not supported")
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.pretrained_cfg["num_classes"] = num_classes

    # --- forward ----------------------------------------------------------------------------------
    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` image -> ``[B, N, C4]`` normalised stage-4 tokens (``N = H/32 * W/32``)."""
        if tuple(x.shape[-2:]) != self.img_size:
            raise ConfigError(
                f"TransNeXt was built for {self.img_size[0]}x{self.img_size[1]} inputs but got "
                f"{x.shape[-2]}x{x.shape[-1]}; rebuild it with img_size={x.shape[-2]} (its position tables "
                f"depend on the size; keep pretrain_size at the training size when loading weights)")
        B = x.shape[0]
        for i in range(1, NUM_STAGES + 1):
            x, H, W = getattr(self, f"patch_embed{i}")(x)
            for block in getattr(self, f"block{i}"):
                x = block(x, H, W)
            x = getattr(self, f"norm{i}")(x)
            if i < NUM_STAGES:
                x = x.transpose(1, 2).reshape(B, -1, H, W)
        return x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x.mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


# ----------------------------------------------------------------------------------------------
# Registered models (timm): entry points only assemble arguments
# ----------------------------------------------------------------------------------------------
def _create(name: str, pretrained: bool, preset: Dict[str, Any], kwargs: Dict[str, Any]) -> TransNeXt:
    model = TransNeXt(**preset_arguments(name, pretrained, preset, kwargs))
    model.pretrained_cfg["architecture"] = name
    return model


_MICRO = dict(embed_dims=(48, 96, 192, 384), num_heads=(2, 4, 8, 16), depths=(2, 2, 15, 2))
_TINY = dict(embed_dims=(72, 144, 288, 576), num_heads=(3, 6, 12, 24), depths=(2, 2, 15, 2))
_SMALL = dict(embed_dims=(72, 144, 288, 576), num_heads=(3, 6, 12, 24), depths=(5, 5, 22, 5))
_BASE = dict(embed_dims=(96, 192, 384, 768), num_heads=(4, 8, 16, 32), depths=(5, 5, 23, 5))


@register_model
def transnext_nano(pretrained: bool = False, **kwargs) -> TransNeXt:
    """CPU-sized TransNeXt (1.0M parameters at 10 classes) for the embedded digits default and
    tests; head_dim 24 like the paper models. Built for 32x32 inputs (token grids 8/4/2/1)."""
    preset = dict(embed_dims=(24, 48, 96, 192), num_heads=(1, 2, 4, 8), depths=(1, 1, 2, 1), img_size=32,
                  num_classes=10)
    return _create("transnext_nano", pretrained, preset, kwargs)


@register_model
def transnext_micro(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("transnext_micro", pretrained, _MICRO, kwargs)


@register_model
def transnext_tiny(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("transnext_tiny", pretrained, _TINY, kwargs)


@register_model
def transnext_small(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("transnext_small", pretrained, _SMALL, kwargs)


@register_model
def transnext_base(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("transnext_base", pretrained, _BASE, kwargs)


# MoH-ViT: the official per-stage shared heads and top-k (``routed_head``). Passing ``attention``
# other than "moh", or an ``activation_ratio``, replaces them.
def _moh(shared_heads: Sequence[int], topk: Sequence[int]) -> Dict[str, Any]:
    return dict(attention="moh", shared_heads=list(shared_heads), topk=list(topk))


@register_model
def moh_transnext_small_80(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("moh_transnext_small_80", pretrained, {**_SMALL, **_moh((3, 6, 3, 8), (0, 0, 6, 12))}, kwargs)


@register_model
def moh_transnext_small_75(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("moh_transnext_small_75", pretrained, {**_SMALL, **_moh((3, 6, 3, 4), (0, 0, 6, 12))}, kwargs)


@register_model
def moh_transnext_base_75(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("moh_transnext_base_75", pretrained, {**_BASE, **_moh((4, 8, 4, 5), (0, 0, 8, 16))}, kwargs)


@register_model
def moh_transnext_base_50(pretrained: bool = False, **kwargs) -> TransNeXt:
    return _create("moh_transnext_base_50", pretrained, {**_BASE, **_moh((2, 2, 2, 4), (2, 4, 6, 8))}, kwargs)
