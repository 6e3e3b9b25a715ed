"""A plain ViT classifier with pluggable attention: the standard full-attention backbone on which
MHA, MoH and MoA are compared without TransNeXt's aggregated attention in the way.

The layout follows timm's ``VisionTransformer`` (patch embedding, learned position embedding, a class
token, pre-norm blocks ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``, final LayerNorm, Linear head),
and so do the state-dict keys: with ``attention="mha"`` a ``plain_vit_*`` model has exactly the keys
and shapes of the matching timm ``vit_*`` model and computes the same function.

Pooling: ``global_pool="token"`` (default) classifies from a class token, as ViT/DeiT do;
``global_pool="avg"`` has no class token and averages the patch tokens after the final norm.

Registered with timm: ``plain_vit_{tiny,small,base}`` (224px, patch 16) and ``plain_vit_nano``
(32px, patch 4, for CPU runs).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, PatchEmbed, trunc_normal_
from timm.models import register_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from moh_vision.attention import build_attention, layer_options
from moh_vision.errors import ConfigError
from .factory import preset_arguments

Tensor = torch.Tensor

__all__ = ["PlainViT", "ViTBlock", "build_attention_stack", "to_2tuple_size", "VIT_PRESETS"]


# ---------------------------------------------------------------------------------------------
# Helpers shared with DiT
# ---------------------------------------------------------------------------------------------
def to_2tuple_size(size: Union[int, Sequence]) -> Tuple[int, int]:
    """``32 -> (32, 32)``; ``(H, W)`` stays; anything else is a :class:`ConfigError`."""
    if isinstance(size, int):
        return size, size
    if isinstance(size, Sequence) and not isinstance(size, str) and len(size) == 2:
        return int(size[0]), int(size[1])
    raise ConfigError(f"a size must be an int or (height, width), got {size!r}")


def _per_layer(value: Any, depth: int, name: str, owner: str) -> List[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != depth:
            raise ConfigError(f"{owner} {name} has {len(value)} entries but depth={depth}")
        return list(value)
    return [value] * depth


def build_attention_stack(attention: str, dim: int, depth: int, num_heads: Union[int, Sequence[int]],
                          head_dim: Union[None, int, Sequence[Optional[int]]], options: Dict[str, Any],
                          defaults: Optional[Dict[str, Any]] = None, owner: str = "model") -> List[nn.Module]:
    """One registry attention per block.

    ``num_heads``, ``head_dim`` and every option may be a scalar or one value per block
    (:func:`~moh_vision.attention.layer_options`); ``defaults`` are the backbone's own choices
    (e.g. ``qkv_bias``) that user options override. ``options["kernel"]`` picks the kernel
    (``sdpa`` if absent). Errors name the block they come from.
    """
    if depth < 1:
        raise ConfigError(f"{owner} depth={depth} must be at least 1")
    heads = _per_layer(num_heads, depth, "num_heads", owner)
    head_dims = _per_layer(head_dim, depth, "head_dim", owner)
    options = dict(options)
    kernel = options.pop("kernel", "sdpa")
    stack = []
    for i in range(depth):
        try:
            opts = {**(defaults or {}), **layer_options(options, i, depth)}
            if head_dims[i] is not None:
                opts["head_dim"] = head_dims[i]
            stack.append(build_attention(attention, dim, int(heads[i]), kernel=kernel, **opts))
        except ConfigError as err:
            raise ConfigError(f"{owner} block {i}: {err}") from None
    return stack


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class ViTBlock(nn.Module):
    """Pre-norm transformer block around a given attention module (keys as timm's ``Block``)."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = attn
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class PlainViT(nn.Module):
    """Vision Transformer classifier whose attention comes from the registry.

    Args:
        img_size: input side (int or (H, W)); must be divisible by ``patch_size``.
        global_pool: ``"token"`` (class token) or ``"avg"`` (mean of tokens, no class token).
        num_heads / head_dim: int or one value per block.
        drop_path_rate: stochastic depth, rising linearly from 0 to this value over the blocks.
        attention: registry name; ``attention_options`` go to ``build_attention`` (per block if lists).
    """

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: Union[int, Sequence[int]] = 12,
        head_dim: Union[None, int, Sequence[Optional[int]]] = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        attention: str = "mha",
        **attention_options: Any,
    ):
        super().__init__()
        size = to_2tuple_size(img_size)
        if patch_size < 1 or size[0] % patch_size or size[1] % patch_size:
            raise ConfigError(f"ViT img_size={img_size} is not divisible by patch_size={patch_size}; "
                              f"use a multiple of {patch_size}")
        if global_pool not in ("token", "avg"):
            raise ConfigError(f"ViT global_pool='{global_pool}' is unknown; allowed: token, avg")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ConfigError(f"drop_path_rate={drop_path_rate} is outside [0, 1)")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if global_pool == "token" else 0
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if self.num_prefix_tokens else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + self.num_prefix_tokens, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)

        attns = build_attention_stack(attention, embed_dim, depth, num_heads, head_dim, attention_options,
                                      defaults=dict(qkv_bias=qkv_bias, attn_drop=attn_drop_rate,
                                                    proj_drop=proj_drop_rate), owner="ViT")
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linear rule (plain floats: meta-safe)
        self.blocks = nn.Sequential(*[ViTBlock(embed_dim, a, mlp_ratio, proj_drop_rate, rates[i])
                                      for i, a in enumerate(attns)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's ViT init (truncated normal .02 for position embedding and Linears, tiny class token),
        then each attention variant's own router init where it has one (MoA: zero)."""
        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

        def linear(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(linear)
        for module in self.modules():
            if hasattr(module, "reset_router"):
                module.reset_router()

    # --- timm conventions ------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {"pos_embed", "cls_token"}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    # --- forward -----------------------------------------------------------------------------------
    def forward_features(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() \
                else block(x)
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x[:, 0] if self.global_pool == "token" else x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


# ---------------------------------------------------------------------------------------------
# Presets and timm registration
# ---------------------------------------------------------------------------------------------
VIT_PRESETS: Dict[str, Dict[str, Any]] = {
    "plain_vit_tiny": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "plain_vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "plain_vit_base": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # CPU-sized for 32x32 inputs: 64 patches of 4x4, 6 blocks of width 128 with 4 heads of 32.
    "plain_vit_nano": dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, num_classes=10),
}


def _cfg(name: str, **overrides: Any) -> Dict[str, Any]:
    """timm-style pretrained cfg: no weights, the data settings a training pipeline should use."""
    preset = VIT_PRESETS[name]
    size = preset["img_size"]
    cfg = dict(url="", architecture=name, num_classes=preset.get("num_classes", 1000), input_size=(3, size, size),
               pool_size=None, crop_pct=0.9, interpolation="bicubic", fixed_input_size=True,
               mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, first_conv="patch_embed.proj",
               classifier="head")
    cfg.update(overrides)
    return cfg


# Read by timm's register_model: timm.models.get_pretrained_cfg(name) knows these models' data settings.
default_cfgs = {name: {k: v for k, v in _cfg(name).items() if k != "architecture"} for name in VIT_PRESETS}

def create_vit(name: str, pretrained: bool = False, **kwargs: Any) -> PlainViT:
    """Build preset ``name`` with ``kwargs`` overriding it; what the timm entry points call."""
    args = preset_arguments(name, pretrained, VIT_PRESETS[name], kwargs)
    model = PlainViT(**args)
    size = to_2tuple_size(args["img_size"])
    model.pretrained_cfg = model.default_cfg = _cfg(name, num_classes=model.num_classes,
                                                    input_size=(args.get("in_chans", 3), *size))
    return model


@register_model
def plain_vit_tiny(pretrained: bool = False, **kwargs: Any) -> PlainViT:
    return create_vit("plain_vit_tiny", pretrained, **kwargs)


@register_model
def plain_vit_small(pretrained: bool = False, **kwargs: Any) -> PlainViT:
    return create_vit("plain_vit_small", pretrained, **kwargs)


@register_model
def plain_vit_base(pretrained: bool = False, **kwargs: Any) -> PlainViT:
    return create_vit("plain_vit_base", pretrained, **kwargs)


@register_model
def plain_vit_nano(pretrained: bool = False, **kwargs: Any) -> PlainViT:
    return create_vit("plain_vit_nano", pretrained, **kwargs)
