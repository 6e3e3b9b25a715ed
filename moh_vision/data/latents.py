"""Pre-encoded VAE latents for latent diffusion (DiT / MoH-DiT on ImageNet 256 -> 32x32x4).

``tools/extract_latents.py`` writes, into one directory::

    shard_00000.pt ... shard_NNNNN.pt   one per ``shard_size`` source images, written atomically
    index.json                          written last: the directory is complete when it exists

A shard is a plain ``torch.save`` dict (loads with ``weights_only=True``, memory-mapped)::

    moments       float16 [n, F, 2, C, h, w]  the VAE encoder's diagonal Gaussian per image:
                                              [:, f, 0] = mean, [:, f, 1] = std (unscaled latent space);
                                              f = 0 the image, f = 1 its horizontal flip (F = 1 with flip=false)
    labels        int64 [n]                   class index (sorted class-folder names)
    source_index  int64 [n]                   position of the image in the sorted file list
    meta          dict                        the extraction settings, checked when a run resumes

``index.json`` holds ``num_images``, ``num_classes``, ``class_names``, ``image_size`` (pixels), ``latent_size``,
``latent_channels``, ``scale_factor``, ``vae_path``, ``flip``, ``shards`` (``[{"file", "count"}]``) and ``skipped``
(unreadable source files).

DiT encodes every image afresh each step and draws ``z ~ N(mean, std^2)`` from the encoder (plus a random flip); storing
the distribution instead of one draw keeps that: :class:`LatentsData` draws a fresh flip and sample per item from
torch's RNG, which the trainer seeds per (seed, epoch, index), so runs are reproducible and resume exactly. Items are
``z * scale_factor`` (0.18215 for the SD VAE)."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from moh_vision.errors import ConfigError

SCALE_FACTOR = 0.18215  # Stable Diffusion VAE (sd-vae-ft-ema / -mse): latents * 0.18215 have ~unit variance
INDEX_FILE = "index.json"
FORMAT = "moh-vision-latents"
FORMAT_VERSION = 1


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.pt"


# -- Image preprocessing and the VAE -----------------------------------------------------------------------------------
def center_crop_arr(image: Image.Image, image_size: int) -> np.ndarray:
    """ADM's (and DiT's) center crop, uint8 HWC: box-filter halvings, bicubic resize of the short side, center crop."""
    while min(image.size) >= 2 * image_size:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.BOX)
    scale = image_size / min(image.size)
    image = image.resize(tuple(round(s * scale) for s in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image)
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return arr[top:top + image_size, left:left + image_size]


def _vae_location(path: os.PathLike) -> Tuple[Path, Optional[str]]:
    """(directory, subfolder) of a local AutoencoderKL: the VAE folder itself or a pipeline with ``vae/``."""
    root = Path(path).expanduser()
    expected = ("expected a local diffusers AutoencoderKL directory (config.json + weights, e.g. a copy of "
                "stabilityai/sd-vae-ft-ema); nothing is downloaded")
    if not root.is_dir():
        raise ConfigError(f"VAE path {path} {'is not a directory' if root.exists() else 'does not exist'}; {expected}")
    subfolder = None
    if not (root / "config.json").is_file() and (root / "vae" / "config.json").is_file():
        subfolder = "vae"
    config_file = root / (subfolder or "") / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"VAE path {path} has no config.json; {expected}")
    try:
        kind = json.loads(config_file.read_text()).get("_class_name")
    except (OSError, ValueError) as err:
        raise ConfigError(f"VAE config {config_file} is unreadable ({err}); {expected}") from err
    if kind != "AutoencoderKL":
        raise ConfigError(f"VAE path {path} holds a {kind or 'non-diffusers'} model, not an AutoencoderKL; {expected}")
    return root, subfolder


def load_vae(path: os.PathLike, device: Any = "cpu"):
    """A diffusers ``AutoencoderKL`` from a LOCAL directory (never downloads), in eval mode, frozen; loaded once per
    (path, device) and shared: do not modify the returned module."""
    root, subfolder = _vae_location(path)
    return _load_vae_cached(str(root.resolve()), subfolder, str(torch.device(device)))


@lru_cache(maxsize=2)
def _load_vae_cached(root: str, subfolder: Optional[str], device: str):
    from diffusers import AutoencoderKL
    try:
        vae = AutoencoderKL.from_pretrained(root, subfolder=subfolder, local_files_only=True, low_cpu_mem_usage=False)
    except (OSError, ValueError) as err:
        raise ConfigError(f"could not load the VAE from {root}: {err}") from err
    return vae.to(device).eval().requires_grad_(False)


# -- Reading shards ----------------------------------------------------------------------------------------------------
def read_index(root: os.PathLike) -> Dict[str, Any]:
    """The index of a finished extraction, with one-line errors for a missing, empty or partial directory."""
    root = Path(root).expanduser()
    hint = "create it with: python tools/extract_latents.py data=<image folder> vae=<vae dir> out=" + str(root)
    if not root.is_dir():
        raise ConfigError(f"data.root={root} {'is not a directory' if root.exists() else 'does not exist'}; {hint}")
    index_file = root / INDEX_FILE
    if not index_file.is_file():
        shards = sorted(root.glob("shard_*.pt"))
        if shards:
            raise ConfigError(f"data.root={root} holds {len(shards)} latent shards but no {INDEX_FILE}: the "
                              f"extraction is unfinished; rerun tools/extract_latents.py with the same arguments")
        raise ConfigError(f"data.root={root} holds no latents ({INDEX_FILE} is missing); {hint}")
    index = json.loads(index_file.read_text())
    if index.get("format") != FORMAT:
        raise ConfigError(f"{index_file} is not a {FORMAT} index")
    missing = [s["file"] for s in index["shards"] if not (root / s["file"]).is_file()]
    if missing:
        raise ConfigError(f"data.root={root} lacks {len(missing)} shard file(s) its index lists, e.g. {missing[0]}")
    if not index["num_images"]:
        raise ConfigError(f"data.root={root} holds no latents (0 images were encoded)")
    return index


def load_shard(path: os.PathLike) -> Dict[str, Any]:
    """One shard, memory-mapped (pages are read on access, shared between DataLoader workers)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class LatentShards(Dataset):
    """``(latent * scale_factor, label)`` for chosen images of a latents directory; shards open lazily per process.

    ``sample=True`` (training): a random flip copy and ``z = mean + std * eps`` from torch's global RNG;
    ``sample=False`` (validation): the unflipped copy and ``eps`` from a generator seeded by the index, leaving the
    global RNG untouched. ``posterior=False`` uses the mean instead of a draw."""

    def __init__(self, root: Path, shard_files: List[str], counts: np.ndarray, labels: np.ndarray,
                 items: np.ndarray, scale_factor: float, flip: bool, sample: bool, posterior: bool = True):
        self.root, self.shard_files = Path(root), list(shard_files)
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.labels, self.items = labels, items
        self.scale_factor, self.flip, self.sample, self.posterior = float(scale_factor), flip, sample, posterior
        self._moments: Optional[List[Optional[torch.Tensor]]] = None

    def __len__(self) -> int:
        return len(self.items)

    def __getstate__(self) -> Dict[str, Any]:  # never pickle mapped tensors into worker processes
        return {**self.__dict__, "_moments": None}

    def _locate(self, image: int) -> Tuple[torch.Tensor, int]:
        if self._moments is None:
            self._moments = [None] * len(self.shard_files)
        k = int(np.searchsorted(self.starts, image, side="right") - 1)
        if self._moments[k] is None:
            self._moments[k] = load_shard(self.root / self.shard_files[k])["moments"]
        return self._moments[k], image - int(self.starts[k])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        image = int(self.items[index])
        moments, row = self._locate(image)
        copies = moments.shape[1]
        generator = None if self.sample else torch.Generator().manual_seed(image)
        flip = int(torch.randint(copies, ())) if (self.sample and self.flip and copies > 1) else 0
        mean, std = moments[row, flip, 0].float(), moments[row, flip, 1].float()
        z = mean + std * torch.randn(mean.shape, generator=generator) if self.posterior else mean
        return z * self.scale_factor, int(self.labels[image])


class LatentsData:
    """Data module over a latents directory (the trainer's data contract): ``data=latents data.root=<dir>``, the
    directory ``tools/extract_latents.py out=`` wrote (``experiment=latent_diffusion`` sets the matching task and model).

    ``img_size`` is the latent side (32 for 256 px), ``in_chans`` the latent channels (4). ``flip``: a random one of the
    stored flip copies per item (DiT's RandomHorizontalFlip); ``sample_posterior``: draw ``z ~ N(mean, std^2)`` per item
    (DiT), else the mean. Validation: ``val_size`` images spread evenly over the (class-sorted) set, read
    deterministically, kept in training (as DiT trains on all of ImageNet train: ``val/loss`` monitors the fit) unless
    ``val_holdout=true``."""
    collate_fn = None
    mixup = None
    repeated_aug = 1
    label_smoothing = 0.0

    task = "diffusion"  # what these data are for: VAE latents with class labels, not images to classify

    def __init__(self, root: str, flip: bool = True, sample_posterior: bool = True, val_size: int = 1000,
                 val_holdout: bool = False):
        self.root = Path(str(root)).expanduser()
        self.index = index = read_index(self.root)
        shards = [s for s in index["shards"] if s["count"] > 0]
        files, counts = [s["file"] for s in shards], np.array([s["count"] for s in shards], dtype=np.int64)
        labels = np.concatenate([load_shard(self.root / f)["labels"].numpy() for f in files]).astype(np.int64)
        n = len(labels)
        if n != index["num_images"]:
            raise ConfigError(f"data.root={self.root}: shards hold {n} images, the index says {index['num_images']}")
        if val_size < 1:
            raise ConfigError(f"data.val_size={val_size} must be >= 1")
        if val_holdout and val_size >= n:
            raise ConfigError(f"data.val_size={val_size} with val_holdout leaves no training images (of {n})")
        val_items = np.unique(np.linspace(0, n - 1, min(int(val_size), n)).round().astype(np.int64))
        train_items = np.setdiff1d(np.arange(n), val_items) if val_holdout else np.arange(n)

        self.num_classes = int(index["num_classes"])
        self.class_names = list(index.get("class_names") or [])
        self.in_chans, self.img_size = int(index["latent_channels"]), int(index["latent_size"])
        self.image_size, self.scale_factor = int(index["image_size"]), float(index["scale_factor"])
        self.vae_path, self.val_holdout = index.get("vae_path"), bool(val_holdout)
        self.flip, self.sample_posterior = bool(flip and index.get("flip")), bool(sample_posterior)
        common = dict(root=self.root, shard_files=files, counts=counts, labels=labels,
                      scale_factor=self.scale_factor, flip=self.flip, posterior=self.sample_posterior)
        self.train = LatentShards(items=train_items, sample=True, **common)
        self.val = LatentShards(items=val_items, sample=False, **common)

    def describe(self) -> str:
        val = "held out" if self.val_holdout else "a fixed subset of train"
        return (f"latents {self.img_size}x{self.img_size}x{self.in_chans} of {self.image_size}px images "
                f"(scale {self.scale_factor}, VAE {self.vae_path}): {len(self.train)} train / {len(self.val)} val "
                f"({val}), {self.num_classes} classes, flip copies {'on' if self.flip else 'off'}, "
                f"{'posterior draws' if self.sample_posterior else 'posterior means'}")
