"""The embedded default: scikit-learn's 8x8 handwritten digits, upsampled (no download, ever).

1797 images, 10 classes. The train/val split is fixed (stratified, ``split_seed``), so runs and sweeps compare on the
same validation images."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from moh_vision.errors import ConfigError


def _digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, [1797, 8, 8] pixels in 0..16 and their labels: read from the file it ships
    (``sklearn/datasets/data/digits.csv.gz``, 64 pixel columns and the label), as ``load_digits`` reads it, without
    importing scikit-learn (2.4 s a process: every run on the default data paid it); its loader where the file moved."""
    spec = importlib.util.find_spec("sklearn")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    from sklearn.datasets import load_digits
    digits = load_digits()
    return digits.images, digits.target


def load_digits_tensors(img_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """All digits as float images in [0, 1], shape [N, 1, img_size, img_size], and int labels."""
    pixels, target = _digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    if img_size != 8:
        images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False).clamp(0, 1)
    return images, torch.tensor(target, dtype=torch.long)


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

    def _affine(self, imgs: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``imgs`` [B, C, H, W] shifted, rotated and scaled by the draws ``r`` [B, 4] in [-1, 1), one image per row, in
        the arithmetic of one image at a time (the same values whatever the batch)."""
        angle = (r[:, 0].double() * self.max_rotate * torch.pi / 180).float()
        scale = (1.0 + r[:, 1].double() * self.max_scale).float()
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        shift = (r[:, 2:].double() * self.max_shift * 2).float()
        theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], -1), torch.stack([sin, cos, shift[:, 1]], -1)], 1)
        grid = F.affine_grid(theta.to(imgs.dtype), list(imgs.shape), align_corners=False)
        return F.grid_sample(imgs, grid, align_corners=False, padding_mode="zeros")

    def __getitem__(self, index: int):
        img = self.images[index]
        if self.augment:  # torch's RNG, which SeededItems seeds per item
            img = self._affine(img.unsqueeze(0), (torch.rand(4) * 2 - 1).unsqueeze(0)).squeeze(0)
        return (img - self.mean) / self.std, int(self.labels[index])

    def seeded_items(self, indices: Sequence[int], seeds: Sequence[int]) -> List[Tuple[torch.Tensor, int]]:
        """``[self[i] for i in indices]`` with torch's CPU generator seeded with ``seeds[j]`` before item ``j`` (what
        :class:`~moh_vision.data.sampler.SeededItems` does item by item), in one batched resampling: the same values, a
        fraction of the time."""
        indices = list(indices)
        imgs = self.images[indices]
        if self.augment:
            draws = [torch.rand(4, generator=torch.Generator().manual_seed(int(seed))) for seed in seeds]
            imgs = self._affine(imgs, torch.stack(draws) * 2 - 1)
        imgs = (imgs - self.mean) / self.std
        return list(zip(imgs.unbind(0), self.labels[indices].tolist()))


class DigitsData:
    """Data module over the digits (the trainer's data contract), normalised to [-1, 1]: ``img_size`` is the side the
    8x8 digits are upsampled to, ``in_chans`` 1 or 3 (the gray image repeated), ``val_fraction`` the share of each class
    held out (fixed by ``split_seed``), ``augment`` a random shift/rotation/scale of training images."""
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
        self.train = DigitsImages(images[train_idx], labels[train_idx], 0.5, 0.5, augment, max_shift, max_rotate,
                                  max_scale)
        self.val = DigitsImages(images[val_idx], labels[val_idx], 0.5, 0.5, False)
        self.collate_fn = None
        self.mixup = None
        self.repeated_aug = 1
        self.label_smoothing = 0.0

    def describe(self) -> str:
        return (f"digits {self.img_size}x{self.img_size}x{self.in_chans}: {len(self.train)} train / "
                f"{len(self.val)} val images, {self.num_classes} classes (scikit-learn, embedded)")
