"""DiT (Peebles & Xie, 2023) and MoH-DiT (Jin et al., ICML 2025) with pluggable attention.

A plain transformer over latent patches with adaLN-Zero blocks: the timestep and class embeddings give, per block, a
shift/scale for each LayerNorm and a gate for each residual branch from a zero-initialised Linear, so a fresh model
predicts exactly zero. Attention comes from the registry (``attention="mha" | "moh" | "moa"`` plus its options, each a
scalar or one value per block); it sees the adaLN-modulated tokens, so a router sees the timestep and the class.

State-dict keys and shapes equal the official checkpoints' (facebookresearch/DiT; SkyworkAI/MoH ``MoH-DiT``, routers
``attn.wg``, ``attn.wg_0``, ``attn.wg_1``). Registered with timm: ``dit_{s,b,l,xl}_{2,4,8}``,
``moh_dit_{s,b,l,xl}_2_{90,75}`` (the official per-layer presets) and ``dit_tiny_2`` (16x16 digits on a CPU), each with
a pretrained cfg describing its input, so ``pretrained=True`` (``pretrained_cfg_overlay=dict(file=...)``) loads
released checkpoints (``DiT-XL-2-256x256.pt``; MoH-DiT training checkpoints: their EMA weights)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from timm.layers import Mlp, PatchEmbed
from timm.models import generate_default_cfgs, register_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from moh_vision.errors import ConfigError
from .vit import build_attention_stack, to_2tuple_size
from .families import register_family
from .factory import build_from_preset

Tensor = torch.Tensor

__all__ = ["DiT", "DiTBlock", "FinalLayer", "TimestepEmbedder", "LabelEmbedder", "modulate",
           "sincos_pos_embed_2d", "DIT_PRESETS"]


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: ``x * (1 + scale) + shift`` with per-sample ``[B, C]`` shift/scale over tokens ``[B, N, C]``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


@torch.fx.wrap  # any torch.fx tracer records the check as one call, run on the real input
def check_token_count(x: Tensor, expected: int) -> None:
    if x.shape[1] != expected:
        raise ValueError(f"unpatchify expected {expected} tokens, got {x.shape[1]}")


# ---- Fixed 2-D sine-cosine position embedding -----------------------------------------------
def _sincos_1d(dim: int, positions: Tensor) -> Tensor:
    """``[M] -> [M, dim]``: sines of ``pos * omega`` then cosines, ``omega_i = 10000^(-i / (dim/2))``."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = positions.to(torch.float64)[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_pos_embed_2d(dim: int, grid_size: Union[int, Tuple[int, int]]) -> Tensor:
    """``[H*W, dim]`` float32 embedding of a row-major ``H x W`` token grid: the first half of the channels encodes
    a token's column, the second its row (the official DiT/MAE layout); float64 rounded once, as the official numpy."""
    grid_h, grid_w = to_2tuple_size(grid_size)
    if dim % 4:
        raise ConfigError(f"a 2-D sin-cos position embedding needs a width divisible by 4 (got {dim})")
    rows = torch.arange(grid_h).repeat_interleave(grid_w)
    cols = torch.arange(grid_w).repeat(grid_h)
    return torch.cat([_sincos_1d(dim // 2, cols), _sincos_1d(dim // 2, rows)], dim=1).float()


# ---- Conditioning: timesteps and class labels -----------------------------------------------
class TimestepEmbedder(nn.Module):
    """Scalar (possibly fractional) timesteps -> 256-dim sinusoidal features -> MLP (``mlp.0``, SiLU, ``mlp.2``)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """``[N] -> [N, dim]``: cosines then sines of ``t * f_i``, ``f_i = max_period^(-i / half)`` (float32 as in
        the reference, so a given ``t`` embeds to the same bits)."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([args.cos(), args.sin()], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: Tensor) -> Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


NO_NULL_CLASS = "dropping labels needs a null class: build the model with class_dropout_prob > 0"


class LabelEmbedder(nn.Module):
    """Class labels -> vectors, with label dropout for classifier-free guidance. With ``dropout_prob > 0`` the table
    has one extra row, the null class ``num_classes``: training replaces each label by it with probability
    ``dropout_prob``; label ``num_classes`` (or ``force_drop_ids == 1``) asks for the unconditional prediction."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    @property
    def has_null_class(self) -> bool:
        return self.dropout_prob > 0

    def token_drop(self, labels: Tensor, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        if not self.has_null_class:
            raise ConfigError(NO_NULL_CLASS)
        return drop_labels(labels, force_drop_ids, self.num_classes, self.dropout_prob, True)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        return self.embedding_table(drop_labels(labels, force_drop_ids, self.num_classes,
                                                self.dropout_prob if train else 0.0, self.has_null_class))


@torch.fx.wrap  # torch.fx traces force_drop_ids as an input (never None while tracing): decide on the real one
def drop_labels(labels: Tensor, force_drop_ids: Optional[Tensor], null_class: int, drop_prob: float,
                has_null_class: bool) -> Tensor:
    """``labels`` with the null class ``null_class`` where ``force_drop_ids == 1`` or, without ``force_drop_ids``, at
    random with probability ``drop_prob`` (0: as they are). Forced drops need a null class (``has_null_class``)."""
    if force_drop_ids is not None and not has_null_class:
        raise ConfigError(NO_NULL_CLASS)
    if force_drop_ids is None:
        if drop_prob <= 0:
            return labels
        drop = torch.rand(labels.shape[0], device=labels.device) < drop_prob
    else:
        drop = force_drop_ids == 1
    return torch.where(drop, torch.full_like(labels, null_class), labels)


# ---- Blocks ---------------------------------------------------------------------------------
class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaLN-Zero: ``x += gate * f(modulate(norm(x), shift, scale))``."""

    def __init__(self, hidden_size: int, attn: nn.Module, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = attn
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm, then a Linear to ``patch_size**2 * out_channels`` per token."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


# ---- DiT ------------------------------------------------------------------------------------
class DiT(nn.Module):
    """Class-conditional diffusion transformer predicting epsilon (and, with ``learn_sigma``, the variance
    interpolation) for ``[B, C, H, W]`` inputs.

    Args:
        input_size: spatial side of the input (latent) grid, int or (H, W); 32 for 256px SD latents.
        patch_size: side of a patch; must divide ``input_size``.
        num_heads: heads per block, an int or one value per block (MoH-DiT-XL/L).
        head_dim: width of one head (``None``: ``hidden_size // num_heads``), int or per block.
        class_dropout_prob: label dropout while training; > 0 adds the null class ``num_classes``.
        learn_sigma: output ``2 * in_channels`` channels (epsilon, then the variance values).
        attention: registry name of the attention variant; ``attention_options`` go to ``build_attention``
            (lists/tuples of length ``depth`` are per block).
    """

    family = "dit"

    def __init__(self, input_size: Union[int, Tuple[int, int]] = 32, patch_size: int = 2, in_channels: int = 4,
                 hidden_size: int = 1152, depth: int = 28, num_heads: Union[int, Sequence[int]] = 16,
                 head_dim: Union[None, int, Sequence[Optional[int]]] = None, mlp_ratio: float = 4.0,
                 class_dropout_prob: float = 0.1, num_classes: int = 1000, learn_sigma: bool = True,
                 attention: str = "mha", **attention_options: Any):
        super().__init__()
        size = to_2tuple_size(input_size)
        if patch_size < 1 or size[0] % patch_size or size[1] % patch_size:
            raise ConfigError(f"DiT input_size={input_size} is not divisible by patch_size={patch_size}; "
                              f"use a multiple of {patch_size}")
        if hidden_size % 4:
            raise ConfigError(f"DiT hidden_size={hidden_size} must be divisible by 4 (2-D sin-cos position embedding)")
        if in_channels < 1 or num_classes < 1:
            raise ConfigError(f"DiT needs in_channels >= 1 and num_classes >= 1 (got {in_channels}, {num_classes})")
        if not 0.0 <= class_dropout_prob < 1.0:
            raise ConfigError(f"class_dropout_prob={class_dropout_prob} is outside [0, 1)")

        self.input_size = size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.learn_sigma = learn_sigma
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.hidden_size = hidden_size
        self.num_classes = num_classes
        self.attention = attention
        self.grid_size = (size[0] // patch_size, size[1] // patch_size)
        self.grad_checkpointing = False

        self.x_embedder = PatchEmbed(size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # Fixed, not learned; a Parameter (not a buffer) so the key matches the official checkpoints.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.x_embedder.num_patches, hidden_size), requires_grad=False)

        attns = build_attention_stack(attention, hidden_size, depth, num_heads, head_dim, attention_options,
                                      defaults=dict(qkv_bias=True), owner="DiT")
        self.num_heads = [a.num_heads for a in attns]
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, a, mlp_ratio) for a in attns])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    # --- init ------------------------------------------------------------------------------------
    def initialize_weights(self) -> None:
        """The official DiT init, then each attention variant's own router init where it has one."""
        def basic(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):  # includes MoH routers, as in MoH-DiT
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(basic)
        with torch.no_grad():
            self.pos_embed.copy_(sincos_pos_embed_2d(self.hidden_size, self.grid_size).unsqueeze(0))
        # patch embedding initialised like a Linear over the flattened patch
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: every residual branch and the output start at exactly zero
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)
        # variants whose method prescribes a router init (MoA: zero, i.e. uniform routing) keep it
        for module in self.modules():
            if hasattr(module, "reset_router"):
                module.reset_router()

    # --- shapes ------------------------------------------------------------------------------------
    def unpatchify(self, x: Tensor) -> Tensor:
        """``[B, T, p*p*C_out]`` tokens -> ``[B, C_out, H, W]`` image."""
        B = x.shape[0]
        (h, w), p, c = self.grid_size, self.patch_size, self.out_channels
        check_token_count(x, h * w)
        x = x.reshape(B, h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(B, c, h * p, w * p)

    # --- timm conventions ------------------------------------------------------------------------
    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in the backward pass (less memory, ~30% more compute)."""
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Nothing: the official DiT / MoH-DiT recipe trains with AdamW, wd=0 (``pos_embed`` is fixed, not trained)."""
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Groups for layer-wise lr decay: the embedders, one group per block, the final layer with the last block."""
        return dict(stem=r"^x_embedder|^t_embedder|^y_embedder|^pos_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^final_layer", (99999,))])

    def instance_cfg(self) -> Dict[str, Any]:
        """The input this very model takes (what its ``pretrained_cfg`` reports)."""
        return dict(input_size=(self.in_channels, *self.input_size), num_classes=self.num_classes)

    def adapt_checkpoint(self, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """A DiT state dict of another input size: the position embedding is fixed (sin-cos of the grid), so this
        model's own replaces a checkpoint's of another grid."""
        out = dict(state_dict)
        pos = out.get("pos_embed")
        if pos is not None and pos.shape != self.pos_embed.shape and pos.shape[-1] == self.pos_embed.shape[-1]:
            out["pos_embed"] = self.pos_embed.detach().clone()
        return out

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, x: Tensor, t: Tensor, y: Tensor, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        """``x``: [B, C, H, W] noisy input; ``t``: [B] (or scalar) timesteps; ``y``: [B] labels
        (``num_classes`` = null class). Returns [B, C_out, H, W]."""
        t = t.expand(x.shape[0])  # a scalar timestep for the whole batch (unconditional: torch.fx traces it)
        tokens = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop_ids)
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, c, use_reentrant=False)
            else:
                tokens = block(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c))

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float,
                         guidance_channels: Optional[int] = None) -> Tensor:
        """Classifier-free guidance in one batched pass over ``[conditional half; unconditional half]`` (second half
        of ``y`` = null class; the first half of ``x`` is used for both). Both halves return the guided epsilon
        ``uncond + cfg_scale * (cond - uncond)``. ``guidance_channels=None`` guides all ``in_channels``; ``3``
        reproduces the official DiT sampling quirk (only the first three latent channels guided, the rest keep
        each half's own prediction)."""
        n = guidance_channels if guidance_channels is not None else self.in_channels
        if not 1 <= n <= self.in_channels:
            raise ConfigError(f"guidance_channels={guidance_channels} is outside 1..in_channels={self.in_channels}")
        if x.shape[0] % 2:
            raise ValueError(f"forward_with_cfg needs an even batch [cond; uncond], got {x.shape[0]}")
        half = x[: x.shape[0] // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, y)
        eps, rest = out[:, :n], out[:, n:]
        cond, uncond = eps.chunk(2, dim=0)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)


# ---- Presets and timm registration ----------------------------------------------------------
def _runs(*pairs: Tuple[int, int]) -> List[int]:
    """``_runs((8, 9), (16, 10))`` = ``[8]*9 + [16]*10``: per-layer values written as in the paper tables."""
    return [value for value, count in pairs for _ in range(count)]


_SIZES = {  # depth, hidden_size, num_heads (DiT paper, Table 1)
    "s": dict(depth=12, hidden_size=384, num_heads=6),
    "b": dict(depth=12, hidden_size=768, num_heads=12),
    "l": dict(depth=24, hidden_size=1024, num_heads=16),
    "xl": dict(depth=28, hidden_size=1152, num_heads=16),
}

# MoH-DiT presets (SkyworkAI/MoH, MoH-DiT/models.py): per-layer heads, shared heads, routed top-k.
# XL and L widen attention with depth at a fixed head_dim; S and B keep the DiT heads.
_MOH_PRESETS = {
    "xl_2_90": dict(depth=28, hidden_size=1152, head_dim=72, num_heads=_runs((8, 9), (16, 10), (24, 9)),
                    shared_heads=_runs((8, 9), (16, 10), (16, 9)), topk=_runs((0, 19), (3, 9))),
    "xl_2_75": dict(depth=28, hidden_size=1152, head_dim=72, num_heads=_runs((8, 9), (16, 10), (24, 9)),
                    shared_heads=_runs((8, 9), (10, 10), (14, 9)), topk=_runs((0, 9), (2, 19))),
    "l_2_90": dict(depth=24, hidden_size=1024, head_dim=64, num_heads=_runs((8, 8), (16, 8), (24, 8)),
                   shared_heads=_runs((8, 8), (16, 16)), topk=_runs((0, 16), (3, 8))),
    "l_2_75": dict(depth=24, hidden_size=1024, head_dim=64, num_heads=_runs((8, 8), (16, 8), (24, 8)),
                   shared_heads=_runs((8, 16), (12, 8)), topk=_runs((0, 8), (4, 16))),
    "b_2_90": dict(depth=12, hidden_size=768, num_heads=12,
                   shared_heads=_runs((6, 5), (7, 5), (12, 2)), topk=_runs((4, 10), (0, 2))),
    "b_2_75": dict(depth=12, hidden_size=768, num_heads=12,
                   shared_heads=_runs((4, 2), (6, 8), (12, 2)), topk=_runs((2, 2), (3, 8), (0, 2))),
    "s_2_90": dict(depth=12, hidden_size=384, num_heads=6,
                   shared_heads=_runs((3, 8), (6, 4)), topk=_runs((2, 8), (0, 4))),
    "s_2_75": dict(depth=12, hidden_size=384, num_heads=6,
                   shared_heads=_runs((2, 2), (3, 8), (6, 2)), topk=_runs((1, 6), (2, 4), (0, 2))),
}


def _all_presets() -> Dict[str, Dict[str, Any]]:
    presets = {}
    for size, cfg in _SIZES.items():
        for patch in (2, 4, 8):
            presets[f"dit_{size}_{patch}"] = dict(cfg, patch_size=patch)
    for name, cfg in _MOH_PRESETS.items():
        presets[f"moh_dit_{name}"] = dict(cfg, patch_size=2, attention="moh")
    # CPU-sized, for pixel-space diffusion on 16x16 scikit-learn digits (1 channel, 10 classes):
    # 64 tokens, 6 blocks of width 128 with 4 heads of 32, about 1.9M parameters.
    presets["dit_tiny_2"] = dict(depth=6, hidden_size=128, num_heads=4, patch_size=2, input_size=16,
                                 in_channels=1, num_classes=10)
    return presets


# Every registered name -> the DiT arguments it stands for (user kwargs override them).
DIT_PRESETS: Dict[str, Dict[str, Any]] = _all_presets()

_MOH_PRESET_NAMES = {f"moh_dit_{key}" for key in _MOH_PRESETS}
_DIT_URL = "https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-{}x{}.pt"
# Released weights (pretrained=True fetches them: models/hub.py; a local copy: pretrained_cfg_overlay=dict(file=...)).
# DiT's by URL (EMA state dicts); MoH-DiT on the hub (a training checkpoint, EMA weights; the repo's one weights file).
_RELEASED = {
    "dit_xl_2": dict(url=_DIT_URL.format(256, 256), origin_url="https://github.com/facebookresearch/DiT"),
    "moh_dit_xl_2_90": dict(hf_hub_id="Chat-UniVi/MoH-DiT-XL-90", origin_url="https://github.com/SkyworkAI/MoH"),
}


def _cfg(name: str, side: Optional[int] = None) -> Dict[str, Any]:
    """What a preset takes: 256x256 ImageNet images as Stable-Diffusion VAE latents (32x32x4, scaled by 0.18215;
    center-cropped as in ADM, in [-1, 1] before the VAE), or for ``dit_tiny_2`` the 16x16 digits in [-1, 1].
    ``classifier`` is the class-embedding table (dropped when ``num_classes`` differs from the checkpoint's).
    ``side``: the latent side of a tagged cfg (DiT-XL/2 512x512: 64, built with input_size=64)."""
    preset = DIT_PRESETS[name]
    channels, side = preset.get("in_channels", 4), side or preset.get("input_size", 32)
    moh = name in _MOH_PRESET_NAMES
    released = dict(_RELEASED.get(name, {}))
    if side == 64:
        released["url"] = _DIT_URL.format(512, 512)
    source = released.get("url") or released.get("hf_hub_id")
    cfg = dict(num_classes=preset.get("num_classes", 1000), input_size=(channels, side, side), pool_size=None,
               fixed_input_size=True, crop_pct=1.0, interpolation="bicubic", mean=(0.0,) * channels,
               std=(1.0,) * channels, first_conv="x_embedder.proj", classifier="y_embedder.embedding_table",
               origin_url="https://github.com/SkyworkAI/MoH" if moh else "https://github.com/facebookresearch/DiT",
               paper_ids="arXiv:2410.11842" if moh else "arXiv:2212.09748",
               notes=(f"released weights: {source}" if source else "no released weights",
                      f"inputs: SD-VAE latents x 0.18215 of {side * 8}px center crops in [-1, 1]"))
    cfg.update(released)
    if channels != 4:
        cfg.update(mean=(0.5,) * channels, std=(0.5,) * channels, interpolation="bilinear",
                   notes=("CPU-sized: pixel-space diffusion on the embedded digits in [-1, 1]",))
    return cfg


# Read by timm's register_model (it must exist before the entry points below are decorated).
# A name with released weights gets the tag ``in1k`` (256x256); DiT-XL/2 at 512x512: ``dit_xl_2.in1k_512``.
default_cfgs = generate_default_cfgs({
    **{(f"{name}.in1k" if name in _RELEASED else name): _cfg(name) for name in DIT_PRESETS},
    "dit_xl_2.in1k_512": _cfg("dit_xl_2", 64),
})


def _from_builder(in_chans: int, img_size: Any = None, **kwargs: Any) -> DiT:
    """timm's builder passes ``in_chans``, ``img_size``; DiT's ``in_channels``, ``input_size`` are already set."""
    return DiT(**kwargs)


def create_dit(name: str, pretrained: bool = False, **kwargs: Any) -> DiT:
    """Build preset ``name`` with ``kwargs`` overriding it; what the timm entry points call."""
    clash = sorted(set(kwargs) & {"in_chans", "img_size", "global_pool"})
    if clash:
        raise ConfigError(f"{name}: DiT takes in_channels / input_size (and has no pooling), not {', '.join(clash)}")
    args = {**DIT_PRESETS[name], **kwargs}
    channels, size = args.get("in_channels", 4), to_2tuple_size(args.get("input_size", 32))
    return build_from_preset(_from_builder, name, pretrained, DIT_PRESETS[name], kwargs,
                             in_chans=channels, img_size=size)


@register_model
def dit_s_2(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_s_2", pretrained, **kwargs)


@register_model
def dit_s_4(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_s_4", pretrained, **kwargs)


@register_model
def dit_s_8(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_s_8", pretrained, **kwargs)


@register_model
def dit_b_2(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_b_2", pretrained, **kwargs)


@register_model
def dit_b_4(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_b_4", pretrained, **kwargs)


@register_model
def dit_b_8(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_b_8", pretrained, **kwargs)


@register_model
def dit_l_2(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_l_2", pretrained, **kwargs)


@register_model
def dit_l_4(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_l_4", pretrained, **kwargs)


@register_model
def dit_l_8(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_l_8", pretrained, **kwargs)


@register_model
def dit_xl_2(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_xl_2", pretrained, **kwargs)


@register_model
def dit_xl_4(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_xl_4", pretrained, **kwargs)


@register_model
def dit_xl_8(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_xl_8", pretrained, **kwargs)


@register_model
def moh_dit_s_2_90(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_s_2_90", pretrained, **kwargs)


@register_model
def moh_dit_s_2_75(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_s_2_75", pretrained, **kwargs)


@register_model
def moh_dit_b_2_90(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_b_2_90", pretrained, **kwargs)


@register_model
def moh_dit_b_2_75(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_b_2_75", pretrained, **kwargs)


@register_model
def moh_dit_l_2_90(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_l_2_90", pretrained, **kwargs)


@register_model
def moh_dit_l_2_75(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_l_2_75", pretrained, **kwargs)


@register_model
def moh_dit_xl_2_90(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_xl_2_90", pretrained, **kwargs)


@register_model
def moh_dit_xl_2_75(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("moh_dit_xl_2_75", pretrained, **kwargs)


@register_model
def dit_tiny_2(pretrained: bool = False, **kwargs: Any) -> DiT:
    return create_dit("dit_tiny_2", pretrained, **kwargs)


register_family(DiT, DIT_PRESETS)
