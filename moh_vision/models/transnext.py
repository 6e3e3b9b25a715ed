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

timm: ``forward_features`` returns the stage-4 map ``[B, C4, H/32, W/32]``; ``features_only=True`` /
``forward_intermediates`` give the four normalised stage maps (strides 4, 8, 16, 32), as the official
detection and segmentation backbones use them; ``pretrained=True`` with
``pretrained_cfg_overlay=dict(file=...)`` loads the released TransNeXt / MoH-ViT checkpoints.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, register_notrace_function, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch.utils.checkpoint import checkpoint

from moh_vision.attention import HeadAttention, attention_options, build_attention, layer_options, register_kernel
from moh_vision.attention.kernels import broadcast_kv_heads
from moh_vision.attention.sparse import PackedRows, SparseSupport, table_auto
from moh_vision.attention.tracing import COMPILE, active_tracer, eager_autograd, plain_module
from moh_vision.errors import ConfigError
from .aggregated_attention import aggregated_attention, aggregated_queries, local_window_index, local_window_mask
from .cuda_candidates import candidate_on
from .depthwise_grad import depthwise_param_grads
from .flex_aggregated import aggregated_attention_flex
from .position_mlp import position_mlp
from .triton_depthwise import depthwise_conv_triton
from .factory import build_from_preset, instance_cfg
from .families import register_family

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


def _inverse_softplus(value: float, shape: Sequence[int]) -> Tensor:
    return torch.log(torch.full(tuple(shape), value).exp() - 1)


# ----------------------------------------------------------------------------------------------
# Attention kernels
# ----------------------------------------------------------------------------------------------
HeadIndex = Union[None, slice, Tensor]  # which heads a per-head step computes: None = all, in order

# MoH over these kernels runs sparse (moh_vision.attention.sparse) under impl="auto" where it was
# measured faster than masked: the thresholds are data, the ``kernels`` entries of
# moh_vision/attention/auto_<device>.json (CPU measured; on GPUs, masked).


def _take(t: Tensor, heads: HeadIndex) -> Tensor:
    """The rows of per-head tensor ``t`` (heads on dim 0) of the heads ``heads``."""
    return t if heads is None else t[heads]


def _take_heads(t: Tensor, heads: HeadIndex) -> Tensor:
    """``[B, h, ...]`` -> the heads ``heads`` (a single shared key/value head is kept as it is)."""
    return t if heads is None or t.shape[1] == 1 else t[:, heads]


class FullKeys(NamedTuple):
    k: Tensor     # [B, hk, N, d] normalised keys
    v: Tensor     # [B, hk, N, d]
    bias: Tensor  # [h, N, N] position bias


class AggregatedKeys(NamedTuple):
    k_local: Tensor  # [B, hk, N, d] normalised keys of every token
    v_local: Tensor  # [B, hk, N, d]
    k_pool: Tensor   # [B, hk, P, d] normalised pooled keys
    v_pool: Tensor   # [B, hk, P, d]
    bias: Tensor     # [h, N, P] position bias to the pooled tokens


# Input checks on shapes: module-level and wrapped for torch.fx, so that any fx tracer (torchvision's
# create_feature_extractor as well as timm's) records them as one call, run on the real input.
@torch.fx.wrap
def check_token_count(x: Tensor, num_tokens: int, resolution: Size2, kernel: str) -> None:
    if x.shape[1] != num_tokens:
        raise ConfigError(f"{kernel} was built for a {resolution[0]}x{resolution[1]} token grid ({num_tokens} tokens) "
                          f"but got {x.shape[1]} tokens; build the model with the img_size of its inputs")


@torch.fx.wrap
def check_key_heads(q: Tensor, k: Tensor) -> None:
    if k.shape[1] not in (1, q.shape[1]):
        raise ValueError(f"keys have {k.shape[1]} heads; expected 1 (shared) or {q.shape[1]}")


class _TransNeXtAttention(HeadAttention):
    """What both TransNeXt kernels share: length-scaled cosine queries and the position-bias MLP.

    Queries are L2-normalised, shifted by a learnable ``query_embedding`` and multiplied by
    ``softplus(temperature) * seq_length_scale`` (log of the number of keys a query sees), so the
    attention sharpness does not drift with the input size; keys are L2-normalised.
    """

    # FLOPs: the position-bias MLP is per layer, not per (token, head)
    flops_roles = {"cpb_fc1": "fixed", "cpb_act": "fixed", "cpb_fc2": "fixed"}

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

    def position_mlp(self, table: Tensor) -> Tensor:
        return self.cpb_fc2(self.cpb_act(self.cpb_fc1(table)))

    def fused_position_mlp(self, table: Tensor) -> bool:
        """Whether :meth:`position_mlp` runs as one operator each way on ``table``
        (:mod:`~moh_vision.models.position_mlp`: no hidden layer in memory): on the CPU, float32 / float64 without
        autocast, eager or under ``torch.compile``, plain ``Linear``/``ReLU`` modules without hooks. Tracers and
        exporters (the FLOP counter among them) see the modules."""
        if active_tracer(table) not in (None, COMPILE):  # first: a traced proxy answers nothing below
            return False
        if not table.is_cpu or table.dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled("cpu"):
            return False
        fc1, fc2 = self.cpb_fc1, self.cpb_fc2
        if not (plain_module(fc1, nn.Linear) and plain_module(self.cpb_act, nn.ReLU) and plain_module(fc2, nn.Linear)):
            return False
        return fc1.bias is not None and fc2.bias is not None and fc1.weight.dtype == fc2.weight.dtype == table.dtype

    def position_bias(self) -> Tensor:
        """``[h, N, M]`` bias from every query position to every key position. The MLP's hidden layer (``[Uh *
        Uw, 512]``, tens of MiB at stage 1, whatever the batch) is never held on the CPU
        (:meth:`fused_position_mlp`); elsewhere in eager training it is recomputed in backward rather than kept."""
        table = self.relative_coords_table
        if self.fused_position_mlp(table):
            table = position_mlp(table, self.cpb_fc1.weight, self.cpb_fc1.bias, self.cpb_fc2.weight,
                                 self.cpb_fc2.bias)
        elif eager_autograd(table):
            table = checkpoint(self.position_mlp, table, use_reentrant=False)  # [Uh * Uw, h]
        else:
            table = self.position_mlp(table)
        table = table.transpose(0, 1).reshape(self.num_heads, *self.bias_grid)
        index_h, index_w = self.relative_index_h, self.relative_index_w  # [Hq, Hk], [Wq, Wk]
        # the two axes one after the other: index_select's backward adds whole slices (index_add), where one
        # gather over both would accumulate element by element
        rows = table.index_select(1, index_h.reshape(-1))  # [h, Hq * Hk, Uw]
        bias = rows.index_select(2, index_w.reshape(-1))  # [h, Hq * Hk, Wq * Wk]
        bias = bias.view(self.num_heads, *index_h.shape, *index_w.shape).permute(0, 1, 3, 2, 4)  # [h, Hq, Wq, Hk, Wk]
        return bias.reshape(self.num_heads, self.num_tokens, -1)

    def scale_queries(self, q_norm: Tensor, heads: HeadIndex = None) -> Tensor:
        """Length-scaled cosine queries ``[B, n, N, d]`` of the heads ``heads`` (None: all, in order;
        else a slice or index tensor of the ``n`` heads ``q_norm`` holds)."""
        embedding, temperature = _take(self.query_embedding, heads), _take(self.temperature, heads)
        scaled = (q_norm + embedding) * F.softplus(temperature) * self.seq_length_scale
        return scaled.to(q_norm.dtype)  # fp32 parameters must not promote bf16/fp16 activations

    def scale_query_rows(self, q_norm: Tensor, rows: PackedRows) -> Tensor:
        """:meth:`scale_queries` for packed query rows ``[R, d]``: row r is token ``rows.token[r]``
        of head ``rows.head[r]``."""
        length = self.seq_length_scale
        length = length[rows.token] if length.dim() else length  # aggregated: per position [N, 1]
        scaled = (q_norm + self.query_embedding[rows.head, 0]) * F.softplus(self.temperature[rows.head, 0]) * length
        return scaled.to(q_norm.dtype)

    def check_tokens(self, x: Tensor) -> None:
        check_token_count(x, self.num_tokens, self.input_resolution, type(self).__name__)

    @staticmethod
    def check_kv_heads(q: Tensor, k: Tensor) -> None:
        check_key_heads(q, k)

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

    # MoH may run this kernel sparse (moh_vision.attention.sparse): queries, attention and output
    # projection only for the selected (token, head) pairs, through the three methods below.
    sparse_moh = SparseSupport(auto=table_auto("transnext_full"))

    def heads(self, x: Tensor) -> Tensor:
        self.check_tokens(x)
        q, k, v = self.project_qkv(x)
        return self.attend_heads(q, self.key_context(k, v))

    def key_context(self, k: Tensor, v: Tensor) -> "FullKeys":
        """What every query attends to: normalised keys, values ``[B, hk, N, d]``, bias ``[h, N, N]``."""
        k = F.normalize(k, dim=-1)
        return FullKeys(k, v, self.position_bias().to(k.dtype))  # the queries' dtype (both normalised)

    def cosine_attention(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """``softmax(q k^T + bias) v`` (with attention dropout) for scaled queries ``q``."""
        dropout = self.attn_drop if self.training else 0.0
        if self.fused_attn:
            k, v = broadcast_kv_heads(q, k, v)  # a shared key/value head to every query head
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        attn = (q @ k.transpose(-2, -1) + bias).softmax(dim=-1)
        attn = F.dropout(attn, dropout) if dropout else attn
        return attn @ v

    def attend_heads(self, q: Tensor, keys: "FullKeys", heads: HeadIndex = None) -> Tensor:
        """Outputs ``[B, n, N, d]`` of the heads ``heads`` (None: all) for every token, from their raw
        queries ``q`` ``[B, n, N, d]``."""
        if heads is None:
            self.check_kv_heads(q, keys.k)
        q = self.scale_queries(F.normalize(q, dim=-1), heads)
        return self.cosine_attention(q, _take_heads(keys.k, heads), _take_heads(keys.v, heads),
                                     _take(keys.bias, heads))

    # --- sparse MoH (see moh_vision.attention.sparse) --------------------------------------------
    def sparse_context(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor], "FullKeys"]:
        """The query projection (``qkv``'s query rows, head-major) and the keys of every head."""
        self.check_tokens(x)
        B, N, _ = x.shape
        inner = self.inner_dim
        w_q, w_kv = self.qkv.weight.split([inner, 2 * inner])
        b_q, b_kv = self.qkv.bias.split([inner, 2 * inner]) if self.qkv.bias is not None else (None, None)
        k, v = F.linear(x, w_kv, b_kv).view(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return w_q, b_q, self.key_context(k, v)

    def attend_rows(self, q: Tensor, keys: "FullKeys", rows: PackedRows) -> Tensor:
        """Outputs ``[R, d]`` of packed query rows ``q`` ``[R, d]`` (token ``rows.token[r]`` of image
        ``rows.image[r]``, head ``rows.head[r]``): every key of that image and head, that token's bias row."""
        q = self.scale_query_rows(F.normalize(q, dim=-1), rows)
        bias = keys.bias[rows.head, rows.token]  # [R, N]
        o = self.cosine_attention(rows.pad(q), rows.heads_of(keys.k), rows.heads_of(keys.v), rows.pad(bias))
        return rows.unpad(o)


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

    # FLOPs: queries and the output projection are per (token, head); keys/values and the pooled
    # branch (sr, norm, act) are computed for every token whatever the routing
    flops_roles = {"q": "per_head", "kv": "fixed", "sr": "fixed", "norm": "fixed", "act": "fixed"}

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
        self.sr = TokenConv1x1(dim)
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
        image = self.act(self.sr(x)).transpose(1, 2).reshape(B, C, *self.input_resolution)
        pooled = average_pool(image, self.pool_size)
        return self.norm(pooled.flatten(2).transpose(1, 2))

    # MoH may run this kernel sparse (moh_vision.attention.sparse): queries, attention and output
    # projection only for the selected (token, head) pairs, through the three methods below.
    sparse_moh = SparseSupport(auto=table_auto("transnext_aggregated"))

    def heads(self, x: Tensor) -> Tensor:
        self.check_tokens(x)
        return self.attend_heads(self.project_q(x), self.key_context(x))

    def key_context(self, x: Tensor) -> "AggregatedKeys":
        """What every query attends to, for every head: normalised local keys and values of every
        token ``[B, hk, N, d]`` (hk in (1, h)), normalised pooled keys and values ``[B, hk, P, d]``,
        and the pooled position bias ``[h, N, P]``."""
        k_local, v_local = self.project_kv(x)
        k_pool, v_pool = self.project_kv(self.pooled_tokens(x))
        k_local, k_pool = F.normalize(k_local, dim=-1), F.normalize(k_pool, dim=-1)
        return AggregatedKeys(k_local, v_local, k_pool, v_pool,
                              self.position_bias().to(k_local.dtype))  # the queries' dtype (both normalised)

    def attend_heads(self, q: Tensor, keys: "AggregatedKeys", heads: HeadIndex = None) -> Tensor:
        """Outputs ``[B, n, N, d]`` of the heads ``heads`` (None: all) for every token, from their raw
        queries ``q`` ``[B, n, N, d]``."""
        if heads is None:
            self.check_kv_heads(q, keys.k_local)
        scale = F.softplus(_take(self.temperature, heads)) * self.seq_length_scale  # [n, N, 1]
        q, local_weight = aggregated_queries(q, _take(self.query_embedding, heads), scale,  # [B, n, N, d | L]
                                             _take(self.learnable_tokens, heads), _take(self.learnable_bias, heads))
        args = (q, _take_heads(keys.k_local, heads), _take_heads(keys.v_local, heads), _take_heads(keys.k_pool, heads),
                _take_heads(keys.v_pool, heads), _take(keys.bias, heads), _take(self.relative_pos_bias_local, heads),
                local_weight, self.input_resolution, self.window_size)
        dropout = self.attn_drop if self.training else 0.0
        if candidate_on("flex", q) and not dropout and self.padding_mask is None:
            return aggregated_attention_flex(*args)  # MOH_VISION_TRANSNEXT_CUDA=flex: the FlexAttention candidate
        return aggregated_attention(*args, dropout, self.padding_mask)

    # --- sparse MoH (see moh_vision.attention.sparse) --------------------------------------------
    def sparse_context(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor], "AggregatedKeys"]:
        """The query projection (``q``, head-major rows) and the keys of every head."""
        self.check_tokens(x)
        return self.q.weight, self.q.bias, self.key_context(x)

    def attend_rows(self, q: Tensor, keys: "AggregatedKeys", rows: PackedRows) -> Tensor:
        """Outputs ``[R, d]`` of packed query rows ``q`` ``[R, d]`` (token ``rows.token[r]`` of image
        ``rows.image[r]``, head ``rows.head[r]``): each row's 3x3 neighbourhood keys/values are gathered
        (padded slots read a zero row and are masked), the pooled keys of its image and head are shared
        by all its head's rows (a padded per-head batch, see :class:`PackedRows`)."""
        B, hk, N, d = keys.v_local.shape
        if hk != self.num_heads:
            raise ValueError(f"sparse rows need keys for every head ({self.num_heads}), got {hk}")
        q_norm = F.normalize(q, dim=-1)
        q = self.scale_query_rows(q_norm, rows)  # [R, d]

        window = local_window_index(self.input_resolution, self.window_size, q.device)[rows.token]  # [R, L]
        first = (rows.image * self.num_heads + rows.head) * N  # row of (image, head, token 0) in [B * h * N]
        slot = torch.where(window >= 0, first.unsqueeze(-1) + window, B * self.num_heads * N)  # padding: zero row
        k_local = torch.cat([keys.k_local.reshape(-1, d), keys.k_local.new_zeros(1, d)])[slot]  # [R, L, d]
        v_local = torch.cat([keys.v_local.reshape(-1, d), keys.v_local.new_zeros(1, d)])[slot]
        # per-row products of a handful of d-vectors: multiply-and-sum (a batched matmul of 1-row
        # matrices is ~2.5x slower on CPU, forward + backward)
        logits_local = (k_local * q.unsqueeze(1)).sum(-1) + self.relative_pos_bias_local[rows.head]
        logits_local = logits_local.masked_fill(self.padding_mask[rows.token], float("-inf"))  # [R, L]
        logits_pool = rows.unpad(rows.pad(q) @ rows.heads_of(keys.k_pool).transpose(-2, -1))
        logits_pool = logits_pool + keys.bias[rows.head, rows.token]  # [R, P]

        attn = torch.cat([logits_local, logits_pool], dim=-1).softmax(dim=-1)
        if self.training and self.attn_drop:
            attn = F.dropout(attn, self.attn_drop)
        attn_local, attn_pool = attn.split([self.local_len, self.pool_len], dim=-1)
        weight_local = (rows.head_matmul(q_norm, self.learnable_tokens) + self.learnable_bias[rows.head, 0]
                        + attn_local)  # [R, L]
        out_local = (weight_local.unsqueeze(-1) * v_local).sum(1)
        return out_local + rows.unpad(rows.pad(attn_pool) @ rows.heads_of(keys.v_pool))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window_size={self.window_size}, pool_size={self.pool_size}"


class TokenConv1x1(nn.Conv2d):
    """The pooled branch's 1x1 convolution (the official ``sr``: its parameters, keys and FLOPs) applied to tokens
    ``[B, N, C]`` as the linear map it is: one GEMM, where a convolution of the token sequence viewed as an image
    takes PyTorch's slow path on the CPU, forward and backward."""

    def __init__(self, dim: int):
        super().__init__(dim, dim, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.flatten(1), self.bias)


def average_pool(x: Tensor, size: Size2) -> Tensor:
    """``F.adaptive_avg_pool2d``; in eager training as :class:`_AveragePool`, which keeps nothing for backward."""
    return _AveragePool.apply(x, size) if eager_autograd(x) else F.adaptive_avg_pool2d(x, size)


class _AveragePool(torch.autograd.Function):
    """Adaptive average pooling whose backward reads only the input's shape: autograd would keep the whole
    input (the pooled branch's ``[B, C, H, W]`` activation, per aggregated-attention layer)."""

    @staticmethod
    def forward(ctx, x: Tensor, size: Size2) -> Tensor:
        ctx.shape = x.shape
        return F.adaptive_avg_pool2d(x, size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return torch.ops.aten._adaptive_avg_pool2d_backward(grad, grad.new_empty(ctx.shape)), None


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------
class DWConv(nn.Module):
    """3x3 depthwise convolution over a token sequence laid out as an ``H x W`` image."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        return _depthwise(x, self.dwconv.weight, self.dwconv.bias, H, W)


def _depthwise(x: Tensor, weight: Tensor, bias: Optional[Tensor], H: int, W: int) -> Tensor:
    """3x3 depthwise convolution of tokens ``[B, N, C]`` laid out as an ``H x W`` image (zero padding). Compiled on
    the CPU (and on CUDA with the candidate ``compiled_dwgrad``), with its backward written out
    (:class:`_DepthwiseTokens`; ``MOH_VISION_DWCONV_GRAD=0``: oneDNN's).
    (Under ``torch.compile``, the forward too as nine shifted multiply-adds that the compiler fuses was tried: a
    faster ConvGLU alone, a slower TransNeXt-T step, 2854 against 2534 ms on the CPU.) On CUDA with
    ``MOH_VISION_TRANSNEXT_CUDA=triton_dwconv``, the Triton candidate (:mod:`~moh_vision.models.cuda_candidates`)."""
    if candidate_on("triton_dwconv", x):
        return depthwise_conv_triton(x, weight, bias, H, W)
    if torch.compiler.is_compiling() and (x.is_cpu or candidate_on("compiled_dwgrad", x)) \
            and os.environ.get("MOH_VISION_DWCONV_GRAD", "1") != "0":
        return _DepthwiseTokens.apply(x, weight, bias, H, W)
    return _conv_tokens(x, weight, bias, H, W)


def _conv_tokens(x: Tensor, weight: Tensor, bias: Optional[Tensor], H: int, W: int) -> Tensor:
    """``F.conv2d`` (3x3, zero padding, one group per channel) of tokens ``[B, N, C]`` read as an ``H x W`` image."""
    B, N, C = x.shape
    return F.conv2d(x.transpose(1, 2).reshape(B, C, H, W), weight, bias, padding=1, groups=C).flatten(2).transpose(1, 2)


class _DepthwiseTokens(torch.autograd.Function):
    """:func:`_conv_tokens` with its backward written out for ``torch.compile`` on the CPU: the input's gradient is the
    convolution of the output's with the flipped kernel (oneDNN's forward kernel), the weight's
    :func:`~moh_vision.models.depthwise_grad.depthwise_param_grads` with the bias's (one pass; a C++ kernel on the CPU).
    oneDNN's own depthwise backward took 4-8x its forward in a compiled TransNeXt-T step."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], H: int, W: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.size, ctx.has_bias = (H, W), bias is not None
        return _conv_tokens(x, weight, bias, H, W)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        H, W = ctx.size
        needs = ctx.needs_input_grad
        grad_x = _conv_tokens(grad, weight.flip(-1, -2), None, H, W) if needs[0] else None
        grad_weight, grad_bias = depthwise_param_grads(x, grad, H, W) if needs[1] or needs[2] else (None, None)
        return grad_x, grad_weight if needs[1] else None, grad_bias if ctx.has_bias and needs[2] else None, None, None


class _GatedTail(torch.autograd.Function):
    """The ConvGLU after ``fc1``: ``linear(GELU(dwconv(x)) * gate, weight, bias)``, keeping only ``x`` and
    ``gate`` (halves of ``fc1``'s output, which stays whole anyway) for backward. The depthwise convolution,
    the GELU and the product are recomputed there (the convolution is a few operations per element): three
    ``[B, N, hidden]`` tensors fewer held per block than autograd keeps, where the hidden width is 2.7-5.3x the
    block's."""

    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], weight: Tensor,
                bias: Optional[Tensor], H: int, W: int) -> Tensor:
        ctx.save_for_backward(x, gate, conv_weight, conv_bias, weight)
        ctx.size, ctx.has_bias = (H, W), bias is not None
        return F.linear(F.gelu(_depthwise(x, conv_weight, conv_bias, H, W)) * gate, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, gate, conv_weight, conv_bias, weight = ctx.saved_tensors
        with torch.enable_grad():  # the convolution's own backward, on its recomputed output
            conv_inputs = [t.detach().requires_grad_() if t is not None else None for t in (x, conv_weight, conv_bias)]
            a_ = _depthwise(*conv_inputs, *ctx.size)
        a = a_.detach()
        activated = F.gelu(a)
        grad_hidden = grad @ weight
        grad_a = torch.ops.aten.gelu_backward(grad_hidden * gate, a)  # GELU's derivative in one pass
        wanted = [t for t in conv_inputs if t is not None]
        grad_x, grad_conv_weight, *grad_conv_bias = torch.autograd.grad(a_, wanted, grad_a)
        grad_weight = grad.flatten(0, -2).t() @ (activated * gate).flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return (grad_x, grad_hidden * activated, grad_conv_weight, grad_conv_bias[0] if grad_conv_bias else None,
                grad_weight, grad_bias, None, None)


def gated_tail(x: Tensor, gate: Tensor, dwconv: nn.Conv2d, fc: nn.Linear, H: int, W: int) -> Tensor:
    """``fc(GELU(dwconv(x)) * gate)``: :class:`_GatedTail` in eager training, the plain operators elsewhere:
    ``torch.compile`` (whose partitioner chooses what to recompute itself), tracers (the FLOP counter counts
    those), ``torch.func``, and where no gradient is needed. Under autocast the Function runs in the autocast
    dtype (its backward runs outside autocast)."""
    if not eager_autograd(x):
        return fc(F.gelu(_depthwise(x, dwconv.weight, dwconv.bias, H, W)) * gate)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    tensors = [None if t is None else t.to(dtype) for t in (x, gate, dwconv.weight, dwconv.bias, fc.weight, fc.bias)]
    with torch.autocast(device, enabled=False):
        return _GatedTail.apply(*tensors, H, W)


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
        x, gate = self.fc1_halves(x)
        if self.drop.p and self.training:
            return self.drop(self.fc2(self.drop(self.act(self.dwconv(x, H, W)) * gate)))
        return gated_tail(x, gate, self.dwconv.dwconv, self.fc2, H, W)

    def fc1_halves(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``fc1(x).chunk(2, dim=-1)`` (the convolution's half, the gate) as two GEMMs over ``fc1``'s weight rows,
        each half contiguous: the depthwise convolution then reads its input in place as a channels-last image,
        where one GEMM's strided half was copied first, forward and backward. Tracers and exporters (the FLOP
        counter among them), a hooked or replaced ``fc1`` see the module."""
        fc1 = self.fc1
        if not plain_module(fc1, nn.Linear) or active_tracer(x) not in (None, COMPILE):
            return fc1(x).chunk(2, dim=-1)
        hidden, weight, bias = fc1.out_features // 2, fc1.weight, fc1.bias
        return (F.linear(x, weight[:hidden], None if bias is None else bias[:hidden]),
                F.linear(x, weight[hidden:], None if bias is None else bias[hidden:]))


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


# torch.fx (any tracer: torchvision's create_feature_extractor, timm's) records the call as one node and runs it on
# the real input; timm's registry alone would reach timm's own tracer only
@torch.fx.wrap
@register_notrace_function
def check_input_size(x: Tensor, img_size: Size2) -> None:
    if tuple(x.shape[-2:]) != tuple(img_size):
        raise ConfigError(
            f"TransNeXt was built for {img_size[0]}x{img_size[1]} inputs but got {x.shape[-2]}x{x.shape[-1]}; "
            f"rebuild it with img_size={x.shape[-2]} (its position tables depend on the size; keep "
            f"pretrain_size at the training size when loading weights)")


GLOBAL_POOLS = ("avg", "")
# Keywords of the parameters the official recipe keeps out of weight decay (besides 1-D weights and biases).
NO_WEIGHT_DECAY_KEYWORDS = ("query_embedding", "relative_pos_bias_local", "cpb", "temperature")


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
    ``global_pool``: ``"avg"`` (mean over the stage-4 map) or ``""`` (unpooled, needs ``num_classes=0``).
    """

    family = "transnext"

    def __init__(
        self,
        img_size: Union[int, Sequence[int]] = 224,
        pretrain_size: Optional[Union[int, Sequence[int]]] = None,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
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

        self._check_pool(global_pool, num_classes)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.in_chans = in_chans
        self.embed_dims, self.depths, self.num_stages = embed_dims, depths, NUM_STAGES
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.attention = attention_names
        self.grad_checkpointing = False
        # timm's feature extraction: the normalised output of every stage
        self.feature_info = [dict(module=f"norm{i + 1}", num_chs=embed_dims[i], reduction=STAGE_STRIDES[i])
                             for i in range(NUM_STAGES)]

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
        # built directly (not through timm): the data settings of the paper models, for this input
        self.pretrained_cfg = self.default_cfg = instance_cfg(_cfg(), self.instance_cfg())

    @staticmethod
    def _check_options(name: str, kernel: str, options: Dict[str, Any]) -> None:
        allowed = [o for o in attention_options(name, kernel) if o not in _STAGE_ARGUMENTS]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(f"TransNeXt got unknown argument(s) {', '.join(unknown)}: neither a model argument nor "
                              f"an option of attention '{name}' (it takes: {', '.join(allowed) or 'nothing'})")

    @staticmethod
    def _check_pool(global_pool: str, num_classes: int) -> None:
        if global_pool not in GLOBAL_POOLS:
            raise ConfigError(f"TransNeXt global_pool='{global_pool}' is unknown; allowed: avg, '' (unpooled)")
        if not global_pool and num_classes > 0:
            raise ConfigError(f"TransNeXt global_pool='' gives unpooled maps, which its Linear head cannot take; "
                              f"use num_classes=0 (features) or global_pool='avg' (got num_classes={num_classes})")

    def instance_cfg(self) -> Dict[str, Any]:
        """The data settings this very model takes (what its ``pretrained_cfg`` reports)."""
        size = self.img_size
        return dict(input_size=(self.in_chans, *size), num_classes=self.num_classes,
                    pool_size=(size[0] // STAGE_STRIDES[-1], size[1] // STAGE_STRIDES[-1]))

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

    # --- timm conventions ------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """The parameters the official TransNeXt / MoH-ViT recipe keeps out of weight decay, by name:
        query embeddings, temperatures, local position biases and the position-bias MLPs (1-D weights
        and biases are excluded by the optimizers anyway)."""
        return {n for n, _ in self.named_parameters() if any(k in n for k in NO_WEIGHT_DECAY_KEYWORDS)}

    @torch.jit.ignore
    def no_weight_decay_keywords(self) -> set:
        """The official code's form of :meth:`no_weight_decay` (substrings of parameter names)."""
        return set(NO_WEIGHT_DECAY_KEYWORDS)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Parameter groups for layer-wise lr decay: the stem, then per stage (``coarse``) or per block,
        each stage's patch embedding before its blocks and its norm with its last block; the head last."""
        if coarse:
            return dict(stem=r"^patch_embed1\.", blocks=r"^(?:patch_embed|block|norm)(\d+)")
        return dict(stem=r"^patch_embed1\.", blocks=[(r"^block(\d+)\.(\d+)\.", None), (r"^patch_embed(\d+)\.", (-1,)),
                                                      (r"^norm(\d+)\.", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass (less memory, more compute)."""
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """timm's semantics: a new head (``0``: none) and, if given, a new pooling (``""``: unpooled maps)."""
        global_pool = self.global_pool if global_pool is None else global_pool
        self._check_pool(global_pool, num_classes)
        self.num_classes, self.global_pool = num_classes, global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.pretrained_cfg["num_classes"] = num_classes

    # --- forward ----------------------------------------------------------------------------------
    def forward_stage(self, index: int, x: Tensor) -> Tensor:
        """Stage ``index`` (0-3): ``[B, C_in, H, W]`` -> its normalised map ``[B, C_i, H / s_i, W / s_i]``."""
        x, H, W = getattr(self, f"patch_embed{index + 1}")(x)
        for block in getattr(self, f"block{index + 1}"):
            if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
                x = checkpoint(block, x, H, W, use_reentrant=False)
            else:
                x = block(x, H, W)
        x = getattr(self, f"norm{index + 1}")(x)
        return x.transpose(1, 2).reshape(x.shape[0], -1, H, W)

    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` image -> ``[B, C4, H/32, W/32]`` normalised stage-4 map."""
        check_input_size(x, self.img_size)
        for i in range(self.num_stages):
            x = self.forward_stage(i, x)
        return x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(2, 3))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    # --- dense prediction (timm's forward_intermediates API) -----------------------------------
    def forward_intermediates(self, x: Tensor, indices: Optional[Union[int, List[int]]] = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False):
        """The normalised maps of stages ``indices`` (int: the last n; ``None``: all four) and the final
        features. ``output_fmt="NCHW"`` gives ``[B, C_i, H / s_i, W / s_i]`` (``"NLC"``: tokens). ``norm`` is
        accepted for timm's API: every stage output is already normalised (each stage ends in its norm).
        Returns ``(forward_features output, intermediates)`` or, with ``intermediates_only``, the list."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ConfigError(f"output_fmt='{output_fmt}' is unknown; allowed: NCHW, NLC")
        take, max_index = feature_take_indices(self.num_stages, indices)
        check_input_size(x, self.img_size)
        intermediates = []
        for i in range(max_index + 1 if stop_early else self.num_stages):
            x = self.forward_stage(i, x)
            if i in take:
                intermediates.append(x if output_fmt == "NCHW" else x.flatten(2).transpose(1, 2))
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the stages after the last of ``indices`` (and the head); returns the kept indices. The stage
        norms stay: the next stage and the features both read the normalised map."""
        take, max_index = feature_take_indices(self.num_stages, indices)
        for i in range(max_index + 1, self.num_stages):
            for part in ("patch_embed", "block", "norm"):
                delattr(self, f"{part}{i + 1}")
        if max_index + 1 < self.num_stages:
            self.num_stages = max_index + 1
            self.num_features = self.head_hidden_size = self.embed_dims[max_index]
            prune_head = True
        if prune_head:
            self.reset_classifier(0, "")
        return take


# ----------------------------------------------------------------------------------------------
# Presets, pretrained configs and timm registration: entry points only assemble arguments
# ----------------------------------------------------------------------------------------------
_MICRO = dict(embed_dims=(48, 96, 192, 384), num_heads=(2, 4, 8, 16), depths=(2, 2, 15, 2))
_TINY = dict(embed_dims=(72, 144, 288, 576), num_heads=(3, 6, 12, 24), depths=(2, 2, 15, 2))
_SMALL = dict(embed_dims=(72, 144, 288, 576), num_heads=(3, 6, 12, 24), depths=(5, 5, 22, 5))
_BASE = dict(embed_dims=(96, 192, 384, 768), num_heads=(4, 8, 16, 32), depths=(5, 5, 23, 5))


# MoH-ViT: the official per-stage shared heads and top-k (``routed_head``). Passing ``attention``
# other than "moh", or an ``activation_ratio``, replaces them.
def _moh(shared_heads: Sequence[int], topk: Sequence[int]) -> Dict[str, Any]:
    return dict(attention="moh", shared_heads=list(shared_heads), topk=list(topk))


TRANSNEXT_PRESETS: Dict[str, Dict[str, Any]] = {
    # CPU-sized (1.0M parameters at 10 classes) for the embedded digits default and tests; head_dim 24
    # like the paper models. Built for 32x32 inputs (token grids 8/4/2/1).
    "transnext_nano": dict(embed_dims=(24, 48, 96, 192), num_heads=(1, 2, 4, 8), depths=(1, 1, 2, 1), img_size=32,
                           num_classes=10),
    "transnext_micro": _MICRO,
    "transnext_tiny": _TINY,
    "transnext_small": _SMALL,
    "transnext_base": _BASE,
    "moh_transnext_small_80": {**_SMALL, **_moh((3, 6, 3, 8), (0, 0, 6, 12))},
    "moh_transnext_small_75": {**_SMALL, **_moh((3, 6, 3, 4), (0, 0, 6, 12))},
    "moh_transnext_base_75": {**_BASE, **_moh((4, 8, 4, 5), (0, 0, 8, 16))},
    "moh_transnext_base_50": {**_BASE, **_moh((2, 2, 2, 4), (2, 4, 6, 8))},
}

# Released weights, where they live (pretrained=True fetches them through the hub cache: moh_vision/models/hub.py;
# a local copy: pretrained_cfg_overlay=dict(file=<path>)). (hub id, file name as the repo publishes it.)
_RELEASED = {
    "transnext_micro": ("DaiShiResearch/transnext-micro-224-1k", "transnext_micro_224_1k.pth"),
    "transnext_tiny": ("DaiShiResearch/transnext-tiny-224-1k", "transnext_tiny_224_1k.pth"),
    "transnext_small": ("DaiShiResearch/transnext-small-224-1k", "transnext_small_224_1k.pth"),
    "transnext_base": ("DaiShiResearch/transnext-base-224-1k", "transnext_base_224_1k.pth"),
    # MoH-ViT: the official evaluation reads checkpoints/<config name>.pth; a repo holding one weights file
    # under another name is found too (hub.py)
    "moh_transnext_small_80": ("Chat-UniVi/MoH-ViT-S-80", "moh_transnext_small_80.pth"),
    "moh_transnext_small_75": ("Chat-UniVi/MoH-ViT-S-75", "moh_transnext_small_75.pth"),
    "moh_transnext_base_75": ("Chat-UniVi/MoH-ViT-B-75", "moh_transnext_base_75.pth"),
    "moh_transnext_base_50": ("Chat-UniVi/MoH-ViT-B-50", "moh_transnext_base_50.pth"),
}
# The 384x384 fine-tunes: timm tag ``.in1k_384`` (build with img_size=384).
_RELEASED_384 = {
    "transnext_small": ("DaiShiResearch/transnext-small-384-1k-ft-1k", "transnext_small_384_1k_ft_1k.pth"),
    "transnext_base": ("DaiShiResearch/transnext-base-384-1k-ft-1k", "transnext_base_384_1k_ft_1k.pth"),
}


def _cfg(name: Optional[str] = None, size: int = 224) -> Dict[str, Any]:
    """The official ImageNet-1K evaluation: 224 inputs (resize 256, center crop 224: crop_pct 0.875), bicubic,
    ImageNet statistics (the 384 fine-tunes: 384, no crop); ``transnext_nano``: the embedded digits
    ((x - 0.5) / 0.5 at 32x32, no crop). Released weights: their hub id and file."""
    moh = name in _MOH_PRESET_NAMES
    hub_id, filename = (_RELEASED_384 if size == 384 else _RELEASED).get(name, (None, None))
    cfg = dict(num_classes=1000, input_size=(3, size, size), pool_size=(size // 32, size // 32),
               fixed_input_size=True, crop_pct=0.875 if size == 224 else 1.0,
               interpolation="bicubic", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
               first_conv="patch_embed1.proj", classifier="head", hf_hub_id=hub_id, hf_hub_filename=filename,
               origin_url="https://github.com/SkyworkAI/MoH" if moh else "https://github.com/DaiShiResearch/TransNeXt",
               paper_ids="arXiv:2410.11842" if moh else "arXiv:2311.17132",
               notes=(f"released weights: {hub_id} ({filename})" if hub_id else "released weights: none",))
    if name == "transnext_nano":
        cfg.update(num_classes=10, input_size=(3, 32, 32), pool_size=(1, 1), crop_pct=1.0, interpolation="bilinear",
                   mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), notes=("CPU-sized, for the embedded digits",))
    return cfg


_MOH_PRESET_NAMES = {name for name, preset in TRANSNEXT_PRESETS.items() if "shared_heads" in preset}
# Read by timm's register_model (it must exist before the entry points below are decorated). A name with
# released weights gets the tag ``in1k`` (its default), the 384 fine-tunes ``in1k_384``.
default_cfgs = generate_default_cfgs({
    **{(f"{name}.in1k" if name in _RELEASED else name): _cfg(name) for name in TRANSNEXT_PRESETS},
    **{f"{name}.in1k_384": _cfg(name, 384) for name in _RELEASED_384},
})


def create_transnext(name: str, pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """Build preset ``name`` with ``kwargs`` overriding it; what the timm entry points call.
    ``features_only=True`` gives the ``out_indices`` stage maps (default: all four)."""
    if kwargs.get("feature_cls", "getter") != "getter":  # the maps exist only inside forward_stage
        raise ConfigError(f"{name}: TransNeXt features come from forward_intermediates (feature_cls='getter'); "
                          f"got feature_cls={kwargs['feature_cls']!r}")
    return build_from_preset(TransNeXt, name, pretrained, TRANSNEXT_PRESETS[name], kwargs,
                             feature_cfg=dict(feature_cls="getter", out_indices=(0, 1, 2, 3)))


@register_model
def transnext_nano(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("transnext_nano", pretrained, **kwargs)


@register_model
def transnext_micro(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("transnext_micro", pretrained, **kwargs)


@register_model
def transnext_tiny(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("transnext_tiny", pretrained, **kwargs)


@register_model
def transnext_small(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("transnext_small", pretrained, **kwargs)


@register_model
def transnext_base(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("transnext_base", pretrained, **kwargs)


@register_model
def moh_transnext_small_80(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("moh_transnext_small_80", pretrained, **kwargs)


@register_model
def moh_transnext_small_75(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("moh_transnext_small_75", pretrained, **kwargs)


@register_model
def moh_transnext_base_75(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("moh_transnext_base_75", pretrained, **kwargs)


@register_model
def moh_transnext_base_50(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    return create_transnext("moh_transnext_base_50", pretrained, **kwargs)


register_family(TransNeXt, TRANSNEXT_PRESETS)
