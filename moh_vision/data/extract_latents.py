"""Encode an image-folder tree (its train split) into VAE latent shards for ``data=latents``
(``tools/extract_latents.py``; the format: :mod:`moh_vision.data.latents`).

Each image is center-cropped the ADM/DiT way to ``image_size`` and encoded, with its horizontal flip, by a local
diffusers ``AutoencoderKL``; the encoder's Gaussian (mean and std, fp16) is stored so training draws a fresh latent per
step as DiT does. Shards are written atomically and a rerun skips finished ones (resume after a crash or preemption).
Under torchrun rank ``r`` encodes every ``world``-th shard and rank 0 writes ``index.json`` once all shards exist."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from moh_vision.checkpoints import atomic_save, atomic_write
from moh_vision.errors import ConfigError
from .imagefolder import BadImage, ImageFileDataset, scan_class_folders
from .latents import FORMAT, FORMAT_VERSION, INDEX_FILE, center_crop_arr, load_shard, load_vae, shard_name

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Extraction:
    """What to encode and how; ``data`` is a class-folder tree (``<data>/train/<class>/*`` or ``<data>/<class>/*``)."""
    data: str
    vae: str
    out: str
    image_size: int = 256
    batch_size: int = 32
    shard_size: int = 10_000
    num_workers: int = 4
    flip: bool = True
    dtype: str = "fp32"
    scale_factor: Optional[float] = None
    progress: bool = True


def train_split(data: str) -> str:
    """``<data>/train``, the Kaggle ImageNet layout's train folder, or ``<data>`` itself."""
    for candidate in (os.path.join(data, "train"), os.path.join(data, "ILSVRC", "Data", "CLS-LOC", "train")):
        if os.path.isdir(candidate):
            return candidate
    return data


class CroppedImages(Dataset):
    """``(uint8 CHW image, label, index)`` after the ADM center crop, or ``(BadImage, label, index)``."""

    def __init__(self, files: ImageFileDataset, indices: Sequence[int], image_size: int):
        self.files, self.indices, self.image_size = files, list(indices), image_size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        index = self.indices[i]
        item = self.files[index]  # (PIL image, label), or a BadImage marker for an unreadable file
        if isinstance(item, BadImage):
            return item, int(self.files.targets[index]), index
        arr = center_crop_arr(item[0], self.image_size)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1), item[1], index


def collate(batch):
    good = [b for b in batch if not isinstance(b[0], BadImage)]
    bad = [b[0].path for b in batch if isinstance(b[0], BadImage)]
    if not good:
        return None, None, None, bad
    return (torch.stack([b[0] for b in good]), torch.tensor([b[1] for b in good]),
            torch.tensor([b[2] for b in good]), bad)


@torch.no_grad()
def encode(vae, images: torch.Tensor, flip: bool, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float16 moments [B, F, 2, C, h, w] (mean, std; F = 2 with the flipped copy)."""
    x = images.to(next(vae.parameters()).device).to(torch.float32) / 127.5 - 1.0
    copies = [x, x.flip(-1)] if flip else [x]
    dist = vae.encode(torch.cat(copies).to(dtype)).latent_dist
    moments = torch.stack([dist.mean.float(), dist.std.float()], dim=1)  # [F*B, 2, C, h, w]
    b = images.shape[0]
    return moments.view(len(copies), b, *moments.shape[1:]).transpose(0, 1).to(torch.float16).cpu()


def shard_meta(job: Extraction, source: str, total: int, k: int) -> Dict[str, Any]:
    first = k * job.shard_size
    return {"format": FORMAT, "version": FORMAT_VERSION, "source": source, "num_files": total,
            "first": first, "end": min(first + job.shard_size, total), "image_size": job.image_size,
            "flip": job.flip, "vae_path": str(Path(job.vae).resolve())}


def finished(path: Path, meta: Dict[str, Any]) -> bool:
    """True when ``path`` holds this shard from an extraction with the same settings (else an error)."""
    if not path.exists():
        return False
    try:
        stored = load_shard(path)["meta"]
    except Exception as err:  # a foreign or damaged file: never silently overwrite it
        raise ConfigError(f"{path} is not a readable latent shard ({type(err).__name__}); remove it or use a new out=")
    if stored != meta:
        diff = sorted(k for k in set(stored) | set(meta) if stored.get(k) != meta.get(k))
        raise ConfigError(f"{path} comes from an extraction with other settings ({', '.join(diff)} differ); "
                          f"use a new out= or rerun with the original arguments")
    return True


def extract_shard(job: Extraction, vae, files: ImageFileDataset, meta: Dict[str, Any], bar) -> Dict[str, Any]:
    data = CroppedImages(files, range(meta["first"], meta["end"]), job.image_size)
    loader = DataLoader(data, batch_size=job.batch_size, num_workers=job.num_workers, collate_fn=collate,
                        multiprocessing_context="fork" if job.num_workers > 0 else None)
    moments, labels, indices, skipped = [], [], [], []
    for images, y, idx, bad in loader:
        skipped += [os.path.relpath(p, meta["source"]) for p in bad]
        if images is not None:
            moments.append(encode(vae, images, meta["flip"], DTYPES[job.dtype]))
            labels.append(y)
            indices.append(idx)
        if bar is not None:
            bar.update(len(bad) + (0 if images is None else len(images)))
    return {"moments": torch.cat(moments) if moments else torch.empty(0, dtype=torch.float16),
            "labels": torch.cat(labels) if labels else torch.empty(0, dtype=torch.long),
            "source_index": torch.cat(indices) if indices else torch.empty(0, dtype=torch.long),
            "skipped": skipped, "meta": meta}


def write_index(job: Extraction, classes: List[str], num_shards: int, vae_scale: float, wait_s: float = 5.0) -> dict:
    """Wait for every shard (other ranks may still be encoding), then write ``index.json`` atomically."""
    out = Path(job.out)
    paths = [out / shard_name(k) for k in range(num_shards)]
    if not all(p.exists() for p in paths):
        log.info("waiting for the other ranks' shards ...")
    while not all(p.exists() for p in paths):
        time.sleep(wait_s)
    shards, skipped, shape = [], [], None
    for p in paths:
        shard = load_shard(p)
        count = int(shard["labels"].numel())
        shards.append({"file": p.name, "count": count})
        skipped += list(shard["skipped"])
        if count:
            shape = tuple(shard["moments"].shape[1:])
    if shape is None:
        raise ConfigError(f"no readable image under {job.data}; nothing was encoded")
    copies, _, channels, side, _ = shape
    index = {"format": FORMAT, "version": FORMAT_VERSION, "num_images": sum(s["count"] for s in shards),
             "num_classes": len(classes), "class_names": classes, "image_size": job.image_size,
             "latent_size": side, "latent_channels": channels, "scale_factor": vae_scale,
             "vae_path": str(Path(job.vae).resolve()), "flip": copies > 1, "dtype": "float16",
             "moments": "mean, std of the encoder's diagonal Gaussian (unscaled)",
             "source": str(Path(train_split(job.data)).resolve()), "shards": shards, "skipped": skipped}
    atomic_write(out / INDEX_FILE, lambda f: f.write(json.dumps(index, indent=1).encode()))
    return index


def extract_latents(job: Extraction, device: torch.device, rank: int = 0, world: int = 1) -> Optional[dict]:
    """Encode this process's shards of ``job``; rank 0 then writes and returns the index (others: None)."""
    if job.shard_size < 1 or job.batch_size < 1 or job.image_size < 8:
        raise ConfigError("shard_size and batch_size must be >= 1 and image_size >= 8")
    if job.dtype not in DTYPES:
        raise ConfigError(f"dtype={job.dtype}: use one of {', '.join(DTYPES)}")
    vae = load_vae(job.vae, device)  # first: a wrong VAE path fails before scanning a large tree
    if job.dtype != "fp32":
        vae = vae.to(DTYPES[job.dtype])
    source = str(Path(train_split(job.data)).resolve())
    classes, paths, labels = scan_class_folders(source)
    files = ImageFileDataset(source, paths, labels, classes, transform=None, mode="RGB", on_bad_image="skip")
    scale = float(job.scale_factor or getattr(vae.config, "scaling_factor", None) or 0.18215)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    total = len(files)
    num_shards = (total + job.shard_size - 1) // job.shard_size
    mine = list(range(rank, num_shards, world))
    metas = {k: shard_meta(job, source, total, k) for k in mine}
    todo = [k for k in mine if not finished(out / shard_name(k), metas[k])]
    if rank == 0:
        log.info("%d images in %d classes -> %d shards of %d in %s (%d ranks; %d shards left on rank 0)",
                 total, len(classes), num_shards, job.shard_size, out, world, len(todo))
    bar = None
    if job.progress and rank == 0:
        from tqdm.auto import tqdm
        done = sum(metas[k]["end"] - metas[k]["first"] for k in mine if k not in todo)
        bar = tqdm(total=sum(metas[k]["end"] - metas[k]["first"] for k in mine), initial=done,
                   unit="img", desc="encoding", dynamic_ncols=True)
    for k in todo:
        atomic_save(extract_shard(job, vae, files, metas[k], bar), out / shard_name(k))
    if bar is not None:
        bar.close()
    if rank != 0:
        return None
    index = write_index(job, classes, num_shards, scale)
    log.info("wrote %s: %d images, latents %dx%dx%d, %d unreadable skipped", out / INDEX_FILE, index["num_images"],
             index["latent_size"], index["latent_size"], index["latent_channels"], len(index["skipped"]))
    return index
