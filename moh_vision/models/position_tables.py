"""TransNeXt's position tables for the continuous position bias: log-spaced relative coordinates between query and
key positions, computed once at construction on the CPU (never saved in checkpoints)."""
from __future__ import annotations

import functools
import math
from typing import Tuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
Size2 = Tuple[int, int]


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
    """Log-spaced relative coordinates for the continuous position bias: ``table [Uh * Uw, 2]`` (every distinct (row
    offset, column offset) pair) and ``index_h [Hq, Hk]``, ``index_w [Wq, Wk]`` into its rows and columns. The two axes
    are independent, so the ``N x M`` index the official code stores (gigabytes at large inputs) is never built:
    :meth:`_TransNeXtAttention.position_bias` gathers with the two small indices."""
    key = (tuple(query_size), tuple(key_size), tuple(pretrain_size))
    return tuple(t.clone() for t in _cached_coordinate_table(*key))
