"""A plain ViT classifier with pluggable attention: the standard full-attention backbone on which MHA, MoH and MoA are
compared without TransNeXt's aggregated attention in the way.

The layout and state-dict keys follow timm's ``VisionTransformer`` (patch embedding, learned position embedding, a
class token, pre-norm blocks, final LayerNorm, Linear head): with ``attention="mha"`` a ``plain_vit_*`` model has the
keys and shapes of the matching timm ``vit_*`` / ``deit_*`` model and computes the same function, so their checkpoints
load into it (:func:`checkpoint_filter_fn`) and continue-tune into MoH. ``global_pool``: ``"token"`` (default, the
class token), ``"avg"`` (mean of the patch tokens, no class token) or ``""`` (unpooled). Registered with timm:
``plain_vit_{tiny,small,base}`` (224px, patch 16) and ``plain_vit_nano`` (32px, patch 4, for CPU runs)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, PatchEmbed, resample_abs_pos_embed, resample_patch_embed, trunc_normal_
from timm.models import register_model
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

from moh_vision.attention import build_attention, layer_options
from moh_vision.attention.registry import pop_old_form_key
from moh_vision.errors import ConfigError
from .families import register_family, register_timm_equivalents
from .factory import build_from_preset

Tensor = torch.Tensor

__all__ = ["PlainViT", "ViTBlock", "build_attention_stack", "to_2tuple_size", "checkpoint_filter_fn", "VIT_PRESETS"]

GLOBAL_POOLS = ("token", "avg", "")


# ---- Helpers shared with DiT ----------------------------------------------------------------
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
    """One registry attention per block. ``num_heads``, ``head_dim`` and every option may be a scalar or one value
    per block (:func:`~moh_vision.attention.layer_options`); ``defaults`` are the backbone's own choices (e.g.
    ``qkv_bias``) that user options override. ``options["form"]`` picks the attention's form (``sdpa`` if absent; the
    old key ``kernel`` is taken with a deprecation warning). Errors name the block they come from."""
    if depth < 1:
        raise ConfigError(f"{owner} depth={depth} must be at least 1")
    heads = _per_layer(num_heads, depth, "num_heads", owner)
    head_dims = _per_layer(head_dim, depth, "head_dim", owner)
    options = dict(options)
    form = pop_old_form_key(options, options.pop("form", "sdpa"))
    stack = []
    for i in range(depth):
        try:
            opts = {**(defaults or {}), **layer_options(options, i, depth)}
            if head_dims[i] is not None:
                opts["head_dim"] = head_dims[i]
            stack.append(build_attention(attention, dim, int(heads[i]), form=form, **opts))
        except ConfigError as err:
            raise ConfigError(f"{owner} block {i}: {err}") from None
    return stack


# ---- Model ----------------------------------------------------------------------------------
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
        global_pool: ``"token"`` (class token), ``"avg"`` (mean of the patch tokens) or ``""`` (unpooled).
        class_token: whether there is a class token (default: unless ``global_pool="avg"``).
        num_heads / head_dim: int or one value per block.
        drop_path_rate: stochastic depth, rising linearly from 0 to this value over the blocks.
        attention: registry name; ``attention_options`` go to ``build_attention`` (per block if lists).
    """

    family = "vit"

    def __init__(self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: int = 16, in_chans: int = 3,
                 num_classes: int = 1000, global_pool: str = "token", class_token: Optional[bool] = None,
                 embed_dim: int = 768, depth: int = 12, num_heads: Union[int, Sequence[int]] = 12,
                 head_dim: Union[None, int, Sequence[Optional[int]]] = None, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop_rate: float = 0.0, pos_drop_rate: float = 0.0, proj_drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, attention: str = "mha",
                 **attention_options: Any):
        super().__init__()
        size = to_2tuple_size(img_size)
        if patch_size < 1 or size[0] % patch_size or size[1] % patch_size:
            raise ConfigError(f"ViT img_size={img_size} is not divisible by patch_size={patch_size}; "
                              f"use a multiple of {patch_size}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ConfigError(f"drop_path_rate={drop_path_rate} is outside [0, 1)")
        class_token = global_pool != "avg" if class_token is None else bool(class_token)
        self.num_prefix_tokens = int(class_token)
        self._check_pool(global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
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
        # timm's feature extraction: every block's tokens, as an image of stride patch_size
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=patch_size) for i in range(depth)]
        self.init_weights()

    def _check_pool(self, global_pool: str) -> None:
        if global_pool not in GLOBAL_POOLS:
            raise ConfigError(f"ViT global_pool='{global_pool}' is unknown; allowed: token, avg, '' (unpooled)")
        if global_pool == "token" and not self.num_prefix_tokens:
            raise ConfigError("ViT global_pool='token' needs a class token; this model has none (use avg)")

    def init_weights(self) -> None:
        """timm's ViT init (truncated normal .02 for position embedding and Linears, tiny class token), then each
        attention variant's own router init where it has one (MoA: zero)."""
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
        """What timm's ViT / the DeiT recipe keep out of weight decay (besides 1-D weights and biases)."""
        return {"pos_embed"} | ({"cls_token"} if self.cls_token is not None else set())

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Layer-wise lr decay groups: embeddings, each block, the final norm with the last block, the head last."""
        return dict(stem=r"^cls_token|^pos_embed|^patch_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """timm's semantics: a new head (``0``: none) and, if given, a new pooling (``""``: unpooled tokens)."""
        if global_pool is not None:
            self._check_pool(global_pool)
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def instance_cfg(self) -> Dict[str, Any]:
        """The data settings this very model takes (what its ``pretrained_cfg`` reports)."""
        return dict(input_size=(self.in_chans, *self.patch_embed.img_size), num_classes=self.num_classes)

    def adapt_checkpoint(self, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """A timm ViT / DeiT (or our) state dict made to fit this model (:func:`checkpoint_filter_fn`)."""
        return checkpoint_filter_fn(state_dict, self)

    # --- forward -----------------------------------------------------------------------------------
    def _embed(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def _block(self, block: nn.Module, x: Tensor) -> Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> ``[B, prefix + patches, embed_dim]`` normalised tokens."""
        x = self._embed(x)
        for block in self.blocks:
            x = self._block(block, x)
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    # --- dense prediction (timm's forward_intermediates API) -----------------------------------
    def forward_intermediates(self, x: Tensor, indices: Optional[Union[int, List[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False):
        """Tokens after the blocks ``indices`` (int: the last n; ``None``: all) and the final features.
        ``output_fmt="NCHW"`` gives ``[B, embed_dim, H / patch, W / patch]`` maps (``"NLC"``: tokens); ``norm`` applies
        the final norm to each; ``return_prefix_tokens`` pairs each with its class token. Returns ``(final features,
        intermediates)`` or, with ``intermediates_only``, the list."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ConfigError(f"output_fmt='{output_fmt}' is unknown; allowed: NCHW, NLC")
        take, max_index = feature_take_indices(len(self.blocks), indices)
        B = x.shape[0]
        x = self._embed(x)
        blocks = self.blocks if not stop_early else self.blocks[:max_index + 1]
        intermediates = []
        for i, block in enumerate(blocks):
            x = self._block(block, x)
            if i in take:
                intermediates.append(self.norm(x) if norm else x)
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == "NCHW":
            H, W = self.patch_embed.grid_size
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens and self.num_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the blocks after the last of ``indices`` (and the norm / head); returns the kept indices."""
        take, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take


# ---- timm ViT / DeiT checkpoints ------------------------------------------------------------
# Tensors of timm ViT variants a plain ViT does not have, and what they are.
_FOREIGN_PARTS = {
    "dist_token": "a distillation token (deit_*_distilled: two heads)",
    "head_dist": "a distillation head (deit_*_distilled)",
    "reg_token": "register tokens",
    "fc_norm": "a norm after pooling (the *_gap / fc_norm variants)",
    "norm_pre": "a norm before the blocks (CLIP-style models)",
    ".ls1.": "LayerScale (DeiT-III, init_values)",
    "attn_pool": "attention pooling (global_pool='map')",
}


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: PlainViT) -> Dict[str, Tensor]:
    """Adapt a timm ``VisionTransformer`` state dict (``vit_*``, ``deit_*``, or one of ours) to ``model``: the layouts
    are the same; a position embedding of another resolution is resampled to the model's grid (bicubic, as timm), a
    patch embedding of another patch size to the model's (timm's ``resample_patch_embed``, FlexiViT's pseudo-inverse
    resize). Parts a plain ViT does not have (distillation or register tokens, LayerScale, fc_norm, ...) are refused."""
    foreign = sorted({what for key in state_dict for part, what in _FOREIGN_PARTS.items() if part in f".{key}"})
    if foreign:
        raise ConfigError(f"this checkpoint is a timm ViT variant with {', '.join(foreign)}; plain_vit_* models "
                          f"match the plain vit_*/deit_* layout (class token, pre-norm blocks, final norm, head)")
    out = dict(state_dict)
    pos = out.get("pos_embed")
    if pos is not None and pos.shape != model.pos_embed.shape and pos.ndim == 3:
        if pos.shape[-1] != model.pos_embed.shape[-1]:
            raise ConfigError(f"pos_embed width {pos.shape[-1]} is not the model's {model.pos_embed.shape[-1]}: "
                              f"another ViT size")
        out["pos_embed"] = resample_abs_pos_embed(pos, list(model.patch_embed.grid_size),
                                                  num_prefix_tokens=model.num_prefix_tokens)
    patch = out.get("patch_embed.proj.weight")
    size = list(model.patch_embed.patch_size)
    if patch is not None and patch.ndim == 4 and list(patch.shape[-2:]) != size:
        out["patch_embed.proj.weight"] = resample_patch_embed(patch, size)
    return out


# ---- Presets, pretrained configs and timm registration --------------------------------------
VIT_PRESETS: Dict[str, Dict[str, Any]] = {
    "plain_vit_tiny": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "plain_vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "plain_vit_base": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # CPU-sized for 32x32 inputs: 64 patches of 4x4, 6 blocks of width 128 with 4 heads of 32.
    "plain_vit_nano": dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, num_classes=10),
}

# timm ViT / DeiT models whose checkpoints load into a preset unchanged (data settings: timm's own cfg).
TIMM_EQUIVALENTS = {
    "vit_tiny_patch16_224": "plain_vit_tiny", "deit_tiny_patch16_224": "plain_vit_tiny",
    "vit_small_patch16_224": "plain_vit_small", "deit_small_patch16_224": "plain_vit_small",
    "vit_base_patch16_224": "plain_vit_base", "deit_base_patch16_224": "plain_vit_base",
}


def _cfg(name: str) -> Dict[str, Any]:
    """Data settings of the presets' recipe (DeiT's: resize 256 -> crop 224, bicubic, ImageNet statistics);
    ``plain_vit_nano``: the embedded digits ((x - 0.5) / 0.5, no crop)."""
    preset = VIT_PRESETS[name]
    size = preset["img_size"]
    cfg = dict(num_classes=preset.get("num_classes", 1000), input_size=(3, size, size), pool_size=None,
               fixed_input_size=True, crop_pct=0.875, interpolation="bicubic", mean=IMAGENET_DEFAULT_MEAN,
               std=IMAGENET_DEFAULT_STD, first_conv="patch_embed.proj", classifier="head",
               origin_url="https://github.com/facebookresearch/deit", paper_ids="arXiv:2012.12877",
               notes=("no released weights of our own; timm's vit_*/deit_* checkpoints load (README, 'timm')",))
    if name == "plain_vit_nano":
        cfg.update(crop_pct=1.0, interpolation="bilinear", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                   notes=("CPU-sized, for the embedded digits",))
    return cfg


# Read by timm's register_model (it must exist before the entry points below are decorated).
default_cfgs = {name: _cfg(name) for name in VIT_PRESETS}


def create_vit(name: str, pretrained: bool = False, **kwargs: Any) -> PlainViT:
    """Preset ``name`` with ``kwargs`` overriding it (``features_only=True``: the ``out_indices`` blocks, default the
    last 3, as NCHW maps)."""
    return build_from_preset(PlainViT, name, pretrained, VIT_PRESETS[name], kwargs,
                             feature_cfg=dict(feature_cls="getter", out_indices=3), filter_fn=checkpoint_filter_fn)


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


register_family(PlainViT, VIT_PRESETS)
register_timm_equivalents(TIMM_EQUIVALENTS)
