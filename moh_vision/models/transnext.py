"""TransNeXt (Shi, CVPR 2024) and MoH-ViT (Jin et al., ICML 2025): a four-stage hierarchical ViT.

Every stage is an overlapping patch embedding followed by blocks of ``norm1 -> attention`` and ``norm2 ->
convolutional GLU``. Stages 1-3 use *aggregated attention*: each query attends to its 3x3 neighbourhood and to a
pooled summary of the whole map under one softmax. Stage 4 (stride 32) uses full cosine attention with a continuous
position bias. The attention is pluggable: this file registers two attention *kernels* (``transnext_aggregated``,
``transnext_full``) and every block asks the registry for ``build_attention(name, ...)`` over the right one, so
``attention="mha" | "moh" | "moa"`` works in all four stages; MoH-ViT is ``attention="moh"`` with the official
per-stage ``shared_heads`` and ``topk``. An op with several implementations (the aggregated attention, the depthwise
convolution, the pieces that recompute in backward) is one call into :mod:`moh_vision.ops`; ``kernels`` picks.

Parameter names follow the official TransNeXt / MoH-ViT checkpoints (``patch_embed{i}``, ``block{i}.{j}.attn.qkv``
...), so their weights load with ``strict=True``. Every buffer (position indices, padding mask, length scale) is
non-persistent and derived from the construction-time resolution, as in the official code: the model runs at exactly
``img_size``. timm: ``forward_features`` gives the stage-4 map ``[B, C4, H/32, W/32]``; ``features_only=True`` /
``forward_intermediates`` the four normalised stage maps (strides 4-32), as the official dense-prediction backbones use
them; ``pretrained=True`` (``pretrained_cfg_overlay=dict(file=...)``) loads the released checkpoints."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, register_notrace_function, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch.utils.checkpoint import checkpoint

from moh_vision import ops
from moh_vision.attention import HeadAttention, attention_options, build_attention, layer_options, register_form
from moh_vision.attention.forms import broadcast_kv_heads
from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels
from .factory import build_from_preset, instance_cfg
from .position_tables import relative_coordinate_table
from .families import register_family

Tensor = torch.Tensor
Size2 = Tuple[int, int]

__all__ = ["TransNeXt", "TransNeXtFullAttention", "TransNeXtAggregatedAttention"]

NUM_STAGES = 4
STAGE_STRIDES = (4, 8, 16, 32)
INIT_TEMPERATURE = 1.0 / 0.24  # softplus(temperature) starts here
CPB_HIDDEN = 512


def _inverse_softplus(value: float, shape: Sequence[int]) -> Tensor:
    return torch.log(torch.full(tuple(shape), value).exp() - 1)


# ---- Attention kernels -----------------------------------------------------------------------
# Input checks on shapes: module-level and wrapped for torch.fx, so that any fx tracer (torchvision's
# create_feature_extractor as well as timm's) records them as one call, run on the real input.
@torch.fx.wrap
def check_token_count(x: Tensor, num_tokens: int, resolution: Size2, owner: str) -> None:
    if x.shape[1] != num_tokens:
        raise ConfigError(f"{owner} was built for a {resolution[0]}x{resolution[1]} token grid ({num_tokens} tokens) "
                          f"but got {x.shape[1]} tokens; build the model with the img_size of its inputs")


class _TransNeXtAttention(HeadAttention):
    """What both TransNeXt kernels share: length-scaled cosine queries (L2-normalised, shifted by a learnable
    ``query_embedding``, times ``softplus(temperature) * seq_length_scale``, the log of the number of keys a query sees,
    so the sharpness does not drift with the input size), L2-normalised keys, and the position-bias MLP."""

    # FLOPs: the position-bias MLP is per layer, not per (token, head)
    flops_roles = {"cpb_fc1": "fixed", "cpb_act": "fixed", "cpb_fc2": "fixed"}

    def __init__(self, dim: int, num_heads: int, input_resolution: Union[int, Size2],
                 pretrain_size: Optional[Union[int, Size2]] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 kernels: Optional[Kernels] = None):
        super().__init__(dim, num_heads, head_dim=head_dim, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, kernels=kernels)
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

    def position_bias(self) -> Tensor:
        """``[h, N, M]`` bias from every query position to every key position: the MLP over the table of distinct
        offsets (its hidden layer recomputed in backward, :func:`~moh_vision.ops.position_mlp`), then gathered."""
        table = ops.position_mlp(self.relative_coords_table, self.position_mlp, kernel=self.kernels.recompute)
        table = table.transpose(0, 1).reshape(self.num_heads, *self.bias_grid)  # [h, Uh, Uw]
        index_h, index_w = self.relative_index_h, self.relative_index_w  # [Hq, Hk], [Wq, Wk]
        # the two axes one after the other: index_select's backward adds whole slices (index_add), where one
        # gather over both would accumulate element by element
        rows = table.index_select(1, index_h.reshape(-1))  # [h, Hq * Hk, Uw]
        bias = rows.index_select(2, index_w.reshape(-1))  # [h, Hq * Hk, Wq * Wk]
        bias = bias.view(self.num_heads, *index_h.shape, *index_w.shape).permute(0, 1, 3, 2, 4)  # [h, Hq, Wq, Hk, Wk]
        return bias.reshape(self.num_heads, self.num_tokens, -1)

    def check_tokens(self, x: Tensor) -> None:
        check_token_count(x, self.num_tokens, self.input_resolution, type(self).__name__)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, input_resolution={self.input_resolution}, pretrain_size={self.pretrain_size}"


@register_form("transnext_full")
class TransNeXtFullAttention(_TransNeXtAttention):
    """Stage-4 attention: every token attends to every token, ``softmax(q_s k_n^T + B) v`` with length-scaled cosine
    queries ``q_s``, normalised keys ``k_n`` and the continuous position bias ``B``; ``qkv`` and ``proj`` as in the
    official checkpoints. ``fused_attn``: ``F.scaled_dot_product_attention`` with the bias as an additive mask (scale
    1: the queries carry the temperature); ``False``: the explicit softmax."""

    def __init__(self, dim: int, num_heads: int, input_resolution: Union[int, Size2],
                 pretrain_size: Optional[Union[int, Size2]] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0, fused_attn: bool = True,
                 kernels: Optional[Kernels] = None):
        super().__init__(dim, num_heads, input_resolution, pretrain_size=pretrain_size, head_dim=head_dim,
                         qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, kernels=kernels)
        self.fused_attn = fused_attn
        self.register_buffer("seq_length_scale", torch.tensor(math.log(self.num_tokens)), persistent=False)
        self.init_position_mlp(self.input_resolution)

    def heads(self, x: Tensor) -> Tensor:
        self.check_tokens(x)
        q, k, v = self.project_qkv(x)
        scaled = (F.normalize(q, dim=-1) + self.query_embedding) * F.softplus(self.temperature) * self.seq_length_scale
        q = scaled.to(q.dtype)  # fp32 parameters must not promote bf16/fp16 activations
        k = F.normalize(k, dim=-1)
        bias = self.position_bias().to(k.dtype)  # the queries' dtype (both normalised)
        k, v = broadcast_kv_heads(q, k, v)  # a shared key/value head (MoA) to every query head
        dropout = self.attn_drop if self.training else 0.0
        if self.fused_attn:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        attn = (q @ k.transpose(-2, -1) + bias).softmax(dim=-1)
        return (F.dropout(attn, dropout) if dropout else attn) @ v


@register_form("transnext_aggregated")
class TransNeXtAggregatedAttention(_TransNeXtAttention):
    """Stages 1-3: pixel-focused local attention and pooled global attention under ONE softmax. Each query sees (a) its
    ``window_size x window_size`` neighbourhood (zero-padded at the border, padded slots masked, plus a learned per-head
    ``relative_pos_bias_local``) and (b) ``P`` pooled tokens, ``LayerNorm(AdaptiveAvgPool(GELU(sr(x))))`` with the
    continuous position bias (pool side ``resolution // sr_ratio`` or ``fixed_pool_size``). The length scale is
    ``log(in-image neighbours + P)`` per position. The local value sum gets an extra, query-dependent weight ``q_norm @
    learnable_tokens + learnable_bias`` (not softmaxed). Projections ``q`` and ``kv`` (tokens and pooled tokens) as in
    the official checkpoints; the attention itself is :func:`~moh_vision.ops.aggregated_attention` (no window
    copies)."""

    # FLOPs: queries and the output projection are per (token, head); keys/values and the pooled
    # branch (sr, norm, act) are computed for every token whatever the routing
    flops_roles = {"q": "per_head", "kv": "fixed", "sr": "fixed", "norm": "fixed", "act": "fixed"}

    def __init__(self, dim: int, num_heads: int, input_resolution: Union[int, Size2], sr_ratio: int,
                 window_size: int = 3, fixed_pool_size: Optional[int] = None,
                 pretrain_size: Optional[Union[int, Size2]] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 kernels: Optional[Kernels] = None):
        super().__init__(dim, num_heads, input_resolution, pretrain_size=pretrain_size, head_dim=head_dim,
                         qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, kernels=kernels)
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

        neighbours, padding_mask = ops.local_window_mask(self.input_resolution, window_size)
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
        pooled = ops.average_pool(image, self.pool_size, kernel=self.kernels.recompute)
        return self.norm(pooled.flatten(2).transpose(1, 2))

    def heads(self, x: Tensor) -> Tensor:
        self.check_tokens(x)
        k_local, v_local = self.project_kv(x)  # [B, hk, N, d], hk in (1, h)
        k_pool, v_pool = self.project_kv(self.pooled_tokens(x))  # [B, hk, P, d]
        k_local, k_pool = F.normalize(k_local, dim=-1), F.normalize(k_pool, dim=-1)
        scale = F.softplus(self.temperature) * self.seq_length_scale  # [h, N, 1]
        q, local_weight = ops.cosine_queries(self.project_q(x), self.query_embedding, scale, self.learnable_tokens,
                                             self.learnable_bias, kernel=self.kernels.recompute)  # [B, h, N, d | L]
        bias = self.position_bias().to(k_local.dtype)  # [h, N, P], the queries' dtype (both normalised)
        dropout = self.attn_drop if self.training else 0.0
        return ops.aggregated_attention(q, k_local, v_local, k_pool, v_pool, bias, self.relative_pos_bias_local,
                                        local_weight, self.input_resolution, self.window_size, dropout,
                                        self.padding_mask, kernel=self.kernels.aggregated)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window_size={self.window_size}, pool_size={self.pool_size}"


class TokenConv1x1(nn.Conv2d):
    """The pooled branch's 1x1 convolution (the official ``sr``: its parameters, keys and FLOPs) on tokens ``[B, N, C]``
    as the linear map it is (a convolution of the tokens viewed as an image takes the CPU's slow path)."""

    def __init__(self, dim: int):
        super().__init__(dim, dim, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.flatten(1), self.bias)


# ---- Blocks ----------------------------------------------------------------------------------
class DWConv(nn.Module):
    """3x3 depthwise convolution over a token sequence laid out as an ``H x W`` image."""

    def __init__(self, dim: int, kernels: Optional[Kernels] = None):
        super().__init__()
        self.kernels = Kernels.of(kernels)
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        return ops.depthwise_conv(x, self.dwconv.weight, self.dwconv.bias, H, W, kernel=self.kernels.depthwise)


class ConvolutionalGLU(nn.Module):
    """``fc2(GELU(dwconv(a)) * b)`` with ``(a, b) = fc1(x)``: the gate branch sees its 3x3 neighbourhood, which gives
    TransNeXt position information without embeddings; ``hidden_features`` is scaled by 2/3 so the two-branch ``fc1``
    costs what a plain MLP would. After ``fc1``: :func:`~moh_vision.ops.gated_tail`."""

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0, kernels: Optional[Kernels] = None):
        super().__init__()
        hidden = int(2 * hidden_features / 3)
        self.kernels = Kernels.of(kernels)
        self.fc1 = nn.Linear(in_features, 2 * hidden)
        self.dwconv = DWConv(hidden, self.kernels)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, in_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        x, gate = self.fc1(x).chunk(2, dim=-1)
        if self.drop.p and self.training:  # dropout between the steps, as the official code
            return self.drop(self.fc2(self.drop(self.act(self.dwconv(x, H, W)) * gate)))
        conv = self.dwconv.dwconv
        return ops.gated_tail(x, gate, conv.weight, conv.bias, self.fc2.weight, self.fc2.bias, H, W, self.kernels)


class OverlapPatchEmbed(nn.Module):
    """Strided convolution with overlapping windows (``kernel > stride``), then LayerNorm (PyTorch's default eps,
    1e-5, as the official code)."""

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
                 norm_eps: float = 1e-6, kernels: Optional[Kernels] = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = ConvolutionalGLU(dim, int(dim * mlp_ratio), drop=drop, kernels=kernels)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x), H, W))


# ---- The model -------------------------------------------------------------------------------
# Form arguments the model derives per stage; an attention option may not set them.
_STAGE_ARGUMENTS = ("input_resolution", "pretrain_size", "sr_ratio", "window_size", "fixed_pool_size", "qkv_bias",
                    "attn_drop", "proj_drop", "kernels")


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
        img_size: input side (or ``(H, W)``), a multiple of 32; the position tables are built for it, so inputs
            must have exactly this size.
        pretrain_size: the size the weights were trained at (default ``img_size``); the position-bias coordinates
            are scaled by it, so fine-tuning a 224 model at 384 keeps ``pretrain_size=224``.
        embed_dims, num_heads, mlp_ratios, depths, sr_ratios: per-stage values (4 each).
        window_size: local window of the aggregated stages (int or per-stage list).
        fixed_pool_size: pooled grid side of the aggregated stages (default ``resolution // sr_ratio``).
        attention: a registered attention name (``mha``, ``moh``, ``moa``, ...) or one per stage.
        kernels: which implementation each op runs (:class:`~moh_vision.ops.Kernels` or a mapping; default ``auto``).
        **attention_options: passed to ``build_attention`` in every stage; a list/tuple of 4 gives one value per
            stage, and a per-stage ``None`` means "that attention's default".

    A stage with ``sr_ratio == 1`` uses full attention, the others aggregated attention. ``global_pool``: ``"avg"``
    (mean over the stage-4 map) or ``""`` (unpooled, needs ``num_classes=0``)."""

    family = "transnext"

    def __init__(self, img_size: Union[int, Sequence[int]] = 224,
                 pretrain_size: Optional[Union[int, Sequence[int]]] = None, in_chans: int = 3, num_classes: int = 1000,
                 global_pool: str = "avg", embed_dims: Sequence[int] = (72, 144, 288, 576),
                 num_heads: Sequence[int] = (3, 6, 12, 24), mlp_ratios: Sequence[float] = (8, 8, 4, 4),
                 depths: Sequence[int] = (2, 2, 15, 2), sr_ratios: Sequence[int] = (8, 4, 2, 1),
                 window_size: Union[int, Sequence[Optional[int]]] = 3, fixed_pool_size: Optional[int] = None,
                 drop_rate: float = 0.0, attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 qkv_bias: bool = True, attention: Union[str, Sequence[str]] = "mha",
                 kernels: Optional[Union[Kernels, Dict[str, str]]] = None, **attention_options: Any):
        super().__init__()
        self.kernels = Kernels.of(kernels)
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
            form_args: Dict[str, Any] = dict(
                input_resolution=resolution,
                pretrain_size=(self.pretrain_size[0] // stride, self.pretrain_size[1] // stride),
                qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate, kernels=self.kernels)
            if sr_ratios[i] == 1:
                form = "transnext_full"
            else:
                form = "transnext_aggregated"
                form_args.update(sr_ratio=sr_ratios[i], window_size=window_sizes[i] or 3,
                                   fixed_pool_size=fixed_pool_size)
            options = {k: v for k, v in layer_options(attention_options, i, NUM_STAGES).items() if v is not None}
            self._check_options(attention_names[i], form, options)

            first = i == 0
            patch_embed = OverlapPatchEmbed(patch_size=7 if first else 3, stride=4 if first else 2,
                                            in_chans=in_chans if first else embed_dims[i - 1], embed_dim=embed_dims[i])
            start = sum(depths[:i])
            blocks = nn.ModuleList([
                Block(embed_dims[i],
                      build_attention(attention_names[i], embed_dims[i], num_heads[i], form=form,
                                      **form_args, **options),
                      mlp_ratio=mlp_ratios[i], drop=drop_rate, drop_path=drop_path[start + j], kernels=self.kernels)
                for j in range(depths[i])])
            setattr(self, f"patch_embed{i + 1}", patch_embed)
            setattr(self, f"block{i + 1}", blocks)
            setattr(self, f"norm{i + 1}", nn.LayerNorm(embed_dims[i], eps=1e-6))

        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()
        # built directly (not through timm): the data settings of the paper models, for this input
        self.pretrained_cfg = self.default_cfg = instance_cfg(_cfg(), self.instance_cfg())

    @staticmethod
    def _check_options(name: str, form: str, options: Dict[str, Any]) -> None:
        allowed = [o for o in attention_options(name, form) if o not in _STAGE_ARGUMENTS]
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
        for module in self.modules():  # after their Linears: variants with a router start of their own (MoA: zero)
            if hasattr(module, "reset_router") and hasattr(module, "attention_name"):
                module.reset_router()

    # --- timm conventions ------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """The parameters the official recipe keeps out of weight decay, by name: query embeddings, temperatures,
        local position biases and the position-bias MLPs (1-D weights and biases are excluded anyway)."""
        return {n for n, _ in self.named_parameters() if any(k in n for k in NO_WEIGHT_DECAY_KEYWORDS)}

    @torch.jit.ignore
    def no_weight_decay_keywords(self) -> set:
        """The official code's form of :meth:`no_weight_decay` (substrings of parameter names)."""
        return set(NO_WEIGHT_DECAY_KEYWORDS)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Groups for layer-wise lr decay: the stem, then per stage (``coarse``) or per block, each stage's patch
        embedding before its blocks and its norm with its last block; the head last."""
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
        """The normalised maps of stages ``indices`` (int: the last n; ``None``: all four) and the final features.
        ``output_fmt="NCHW"`` gives ``[B, C_i, H / s_i, W / s_i]`` (``"NLC"``: tokens). ``norm`` is accepted for
        timm's API (each stage already ends in its norm). Returns ``(features, intermediates)`` or the list alone."""
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


# ---- Presets, pretrained configs and timm registration: entry points only assemble arguments ----
_MICRO = dict(embed_dims=(48, 96, 192, 384), num_heads=(2, 4, 8, 16), depths=(2, 2, 15, 2))
_TINY = dict(embed_dims=(72, 144, 288, 576), num_heads=(3, 6, 12, 24), depths=(2, 2, 15, 2))
_SMALL = dict(embed_dims=(72, 144, 288, 576), num_heads=(3, 6, 12, 24), depths=(5, 5, 22, 5))
_BASE = dict(embed_dims=(96, 192, 384, 768), num_heads=(4, 8, 16, 32), depths=(5, 5, 23, 5))


# MoH-ViT: the official per-stage shared heads and top-k (``routed_head``); another attention or ratio replaces them
def _moh(shared_heads: Sequence[int], topk: Sequence[int]) -> Dict[str, Any]:
    return dict(attention="moh", shared_heads=list(shared_heads), topk=list(topk))


TRANSNEXT_PRESETS: Dict[str, Dict[str, Any]] = {
    # CPU-sized (1.0M parameters at 10 classes, head_dim 24, 32x32 inputs) for the embedded digits and the tests
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

# Released weights (hub id, file name): pretrained=True reads them through the hub cache (moh_vision/models/hub.py),
# a local copy with pretrained_cfg_overlay=dict(file=<path>)
_RELEASED = {
    "transnext_micro": ("DaiShiResearch/transnext-micro-224-1k", "transnext_micro_224_1k.pth"),
    "transnext_tiny": ("DaiShiResearch/transnext-tiny-224-1k", "transnext_tiny_224_1k.pth"),
    "transnext_small": ("DaiShiResearch/transnext-small-224-1k", "transnext_small_224_1k.pth"),
    "transnext_base": ("DaiShiResearch/transnext-base-224-1k", "transnext_base_224_1k.pth"),
    # MoH-ViT: the official evaluation reads checkpoints/<config name>.pth (hub.py finds one file of another name)
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
    """The official ImageNet-1K evaluation: 224 (resize 256, center crop 224), bicubic, ImageNet statistics (the 384
    fine-tunes: no crop); ``transnext_nano``: the digits ((x - 0.5) / 0.5 at 32x32). Released weights: hub id, file."""
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
# Read by timm's register_model (before the entry points below): tag ``in1k`` for released weights, ``in1k_384``.
default_cfgs = generate_default_cfgs({
    **{(f"{name}.in1k" if name in _RELEASED else name): _cfg(name) for name in TRANSNEXT_PRESETS},
    **{f"{name}.in1k_384": _cfg(name, 384) for name in _RELEASED_384},
})


def create_transnext(name: str, pretrained: bool = False, **kwargs: Any) -> TransNeXt:
    """Preset ``name`` with ``kwargs`` overriding it (``features_only=True``: the ``out_indices`` stage maps)."""
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
