"""Sample grids (one row per class, labelled) and the ADM evaluation-suite ``.npz`` format."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from moh_vision.checkpoints import atomic_write

Tensor = torch.Tensor


def to_uint8(images: Tensor) -> np.ndarray:
    """[-1, 1] images [N, C, H, W] -> uint8 NHWC (grayscale repeated to 3 channels)."""
    x = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if x.shape[1] == 1:
        x = x.repeat(1, 3, 1, 1)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def save_class_grid(images: Tensor, labels: Tensor, path: os.PathLike, per_row: int,
                    class_names: Optional[Sequence[str]] = None, cell: int = 64) -> Path:
    """Write a PNG (atomically): ``per_row`` samples of a class per row, its name on the left. ``images`` in [-1, 1],
    class by class (as ``labels.repeat_interleave`` orders them); small ones scaled up (nearest) to ``cell`` px."""
    arr = to_uint8(images)
    n, h, w, _ = arr.shape
    rows = (n + per_row - 1) // per_row
    scale = max(1, cell // max(h, w))
    ch, cw = h * scale, w * scale
    margin, gap = 40, 2
    canvas = Image.new("RGB", (margin + per_row * (cw + gap), rows * (ch + gap)), "white")
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        r, c = divmod(i, per_row)
        tile = Image.fromarray(arr[i]).resize((cw, ch), Image.NEAREST)
        canvas.paste(tile, (margin + c * (cw + gap), r * (ch + gap)))
        if c == 0:
            label = int(labels[i])
            name = class_names[label] if class_names else str(label)
            draw.text((4, r * (ch + gap) + ch // 2 - 6), name, fill="black")
    return atomic_write(path, lambda f: canvas.save(f, format="PNG"))


def save_adm_npz(images_uint8: np.ndarray, path: os.PathLike) -> Path:
    """Save uint8 NHWC images as ``arr_0`` in an ``.npz``, the input of the ADM/guided-diffusion evaluator."""
    if images_uint8.dtype != np.uint8 or images_uint8.ndim != 4 or images_uint8.shape[-1] != 3:
        raise ValueError(f"expected uint8 NHWC with 3 channels, got {images_uint8.dtype} {images_uint8.shape}")
    return atomic_write(path, lambda f: np.savez(f, arr_0=images_uint8))
