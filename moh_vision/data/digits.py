"""The embedded default: scikit-learn's 8x8 handwritten digits, upsampled (no download, ever).

1797 images, 10 classes. The train/val split is fixed (stratified, ``split_seed``), so runs and
sweeps compare on the same validation images.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from moh_vision.errors import ConfigError


def load_digits_tensors(img_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """All digits as float images in [0, 1], shape [N, 1, img_size, img_size], and int labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if img_size != 8:
        images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False).clamp(0, 1)
    return images, torch.tensor(digits.target, dtype=torch.long)


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    train, val = [], []
    for c in labels.unique(sorted=True):
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_val = int(round(len(idx) * val_fraction))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


class DigitsImages(Dataset):
    """Pre-upsampled digit images; optional random shift/scale/rotation augmentation (uses torch's RNG)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float, augment: bool,
                 max_shift: float = 0.1, max_rotate: float = 10.0, max_scale: float = 0.1):
        self.images, self.labels = images, labels
        self.mean, self.std, self.augment = mean, std, augment
        self.max_shift, self.max_rotate, self.max_scale = max_shift, max_rotate, max_scale

    def __len__(self) -> int:
        return len(self.labels)

    def _random_affine(self, img: torch.Tensor) -> torch.Tensor:
        r = torch.rand(4) * 2 - 1
        angle = float(r[0]) * self.max_rotate * torch.pi / 180
        scale = 1.0 + float(r[1]) * self.max_scale
        cos, sin = torch.cos(torch.tensor(angle)) / scale, torch.sin(torch.tensor(angle)) / scale
        theta = torch.tensor([[cos, -sin, float(r[2]) * self.max_shift * 2],
                              [sin, cos, float(r[3]) * self.max_shift * 2]], dtype=img.dtype).unsqueeze(0)
        grid = F.affine_grid(theta, [1, *img.shape], align_corners=False)
        return F.grid_sample(img.unsqueeze(0), grid, align_corners=False, padding_mode="zeros").squeeze(0)

    def __getitem__(self, index: int):
        img = self.images[index]
        if self.augment:
            img = self._random_affine(img)
        return (img - self.mean) / self.std, int(self.labels[index])


class DigitsData:
    """Data module over the digits (see the trainer's data contract: ``train``, ``val``, ``num_classes``, ...).

    Args:
        img_size: side the 8x8 digits are upsampled to.
        in_chans: 1 (grayscale) or 3 (the gray image repeated, for 3-channel models).
        val_fraction: share of each class held out for validation (fixed by ``split_seed``).
        augment: random shift/rotation/scale for training images.
        normalize: ``"standard"`` ((x - 0.5) / 0.5 for classification) or ``"symmetric"`` ([-1, 1], diffusion: same map).
    """

    digit_metrics = True  # capability (moh_vision.tasks.protocols): samples scored by the digits classifier

    def __init__(self, img_size: int = 32, in_chans: int = 1, val_fraction: float = 0.2, split_seed: int = 0,
                 augment: bool = True, max_shift: float = 0.1, max_rotate: float = 10.0, max_scale: float = 0.1):
        if in_chans not in (1, 3):
            raise ConfigError(f"data.in_chans={in_chans}: digits are grayscale; use 1 or 3")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        if img_size < 8:
            raise ConfigError(f"data.img_size={img_size}: digits are 8x8; use 8 or more")
        images, labels = load_digits_tensors(img_size)
        if in_chans == 3:
            images = images.repeat(1, 3, 1, 1)
        train_idx, val_idx = stratified_split(labels, val_fraction, split_seed)
        self.num_classes, self.in_chans, self.img_size = 10, in_chans, img_size
        self.train = DigitsImages(images[train_idx], labels[train_idx], 0.5, 0.5, augment,
                                  max_shift, max_rotate, max_scale)
        self.val = DigitsImages(images[val_idx], labels[val_idx], 0.5, 0.5, False)
        self.collate_fn = None
        self.mixup = None
        self.repeated_aug = 1
        self.label_smoothing = 0.0

    def describe(self) -> str:
        return (f"digits {self.img_size}x{self.img_size}x{self.in_chans}: {len(self.train)} train / "
                f"{len(self.val)} val images, {self.num_classes} classes (scikit-learn, embedded)")
