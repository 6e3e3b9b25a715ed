"""TransNeXt's aggregated attention through FlexAttention: ``kernels.aggregated=flex``, a CUDA candidate.

The window keys and the pooled keys are one key sequence (``N + P``), a block mask keeps each query's in-map ``window x
window`` neighbours and every pooled key, and a score modifier adds the per-slot ``local_bias`` or the per-query
``pool_bias``; FlexAttention's softmax over both is the aggregated softmax (slots outside the map masked, as the zero
padding's ``-inf``). The learnable tokens' non-softmax term ``sum_l local_weight_l v[n + o_l]`` is added from nine
shifted views of the padded values (:func:`~moh_vision.ops.aggregated.local_sum`), which ``torch.compile`` fuses.

A candidate, not a default: ``tools/gpu_checks.sh`` times it on CUDA beside ``fused``; it becomes the CUDA default only
if a record shows it faster. Its forward equals the formula on the CPU (``tests/test_aggregated_attention.py``;
FlexAttention has no CPU backward), its gradients on CUDA (a ``gpu`` test). On CUDA outside ``torch.compile`` it calls
FlexAttention compiled once (eager FlexAttention materialises every score). A call with attention dropout runs the
reference."""
from __future__ import annotations

import functools
from typing import Tuple

import torch

from .aggregated import AGGREGATED, _padded, aggregated_attention_reference, local_sum

Tensor = torch.Tensor
Size2 = Tuple[int, int]


def _geometry(size: Size2, window: int):
    H, W = size
    r, tokens = window // 2, H * W

    def offset(q_idx, kv_idx):  # (rows, columns) from the query to the key on the map
        return kv_idx // W - q_idx // W, kv_idx % W - q_idx % W

    def neighbours(q_idx, kv_idx):
        dy, dx = offset(q_idx, kv_idx)
        return (kv_idx < tokens) & (dy.abs() <= r) & (dx.abs() <= r)

    def slot(q_idx, kv_idx):  # F.unfold's order: (dy + r) * window + (dx + r)
        dy, dx = offset(q_idx, kv_idx)
        return ((dy + r) * window + dx + r).clamp(0, window * window - 1)

    return tokens, neighbours, slot


@torch.compiler.disable  # built outside a compiled graph, once per geometry (the cache)
@functools.lru_cache(maxsize=16)
def _block_mask(size: Size2, window: int, pool: int, device: torch.device):
    """The mask for ``H x W`` queries over their window and ``pool`` pooled keys (per geometry and device, computed
    once: it holds no tensor of the caller's)."""
    from torch.nn.attention.flex_attention import create_block_mask

    tokens, neighbours, _ = _geometry(size, window)

    def mask_mod(b, h, q_idx, kv_idx):
        return neighbours(q_idx, kv_idx) | (kv_idx >= tokens)

    return create_block_mask(mask_mod, None, None, tokens, tokens + pool, device=device)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """FlexAttention compiled once per process (eagerly it materialises every score; under ``torch.compile`` the
    caller's graph compiles it)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@AGGREGATED.implement("flex", devices=("cuda",))
def aggregated_attention_flex(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, pool_bias: Tensor,
                              local_bias: Tensor, local_weight: Tensor, size: Size2, window: int, dropout: float = 0.0,
                              padding_mask=None) -> Tensor:
    """The aggregated attention ``[B, h, N, d]`` (arguments as
    :func:`~moh_vision.ops.aggregated.aggregated_attention_reference`; ``k``, ``v``, ``k_pool`` and ``v_pool`` may
    have one head that every query head reads)."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout:
        return aggregated_attention_reference(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, size,
                                              window, dropout, padding_mask)

    size = (int(size[0]), int(size[1]))
    tokens, _, slot = _geometry(size, window)
    pool = k_pool.shape[-2]

    def score_mod(score, b, h, q_idx, kv_idx):
        local = local_bias[h, slot(q_idx, kv_idx)]
        pooled = pool_bias[h, q_idx, (kv_idx - tokens).clamp(min=0)]
        return score + torch.where(kv_idx < tokens, local, pooled)

    keys, values = torch.cat([k, k_pool], dim=2), torch.cat([v, v_pool], dim=2)
    attend = flex_attention if q.device.type == "cpu" or torch.compiler.is_compiling() else _compiled_flex()
    out = attend(q, keys.to(q.dtype), values.to(q.dtype), score_mod=score_mod,
                 block_mask=_block_mask(size, window, pool, q.device), scale=1.0, enable_gqa=keys.shape[1] != q.shape[1])
    v_heads = v.expand(*q.shape[:2], *v.shape[2:]) if v.shape[1] != q.shape[1] else v
    return out + local_sum(local_weight.to(q.dtype), _padded(v_heads.to(q.dtype), size, window), size, window)
