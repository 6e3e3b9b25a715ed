"""Every rank samples its share, as DiT's ``sample_ddp.py`` seeds and orders it; rank 0 merges them.

Rank ``r`` of ``W`` draws everything from one stream seeded ``seed * W + r``: each batch's labels (``random``: uniform;
``balanced``: a seeded shuffle of equal class counts) then its noise. Sample ``i`` of that rank's batch ``t`` is output
sample ``t * B * W + i * W + r``; every rank samples the same number of full batches and the first ``N`` are kept.
Finished batches are stored in a parts folder with the stream's state after them (a rerun resumes there). Used by
``tools/sample.py`` (:mod:`.sampling`) and by the FID during training (the trainer hands :func:`sample_images` to the
task's step work)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from moh_vision.checkpoints import atomic_write
from .distributed import barrier

LABEL_STREAM = 0x1AB  # the balanced labels' shuffle: its own stream, apart from the ranks' sampling streams


def balanced_labels(num_samples: int, num_classes: int, seed: int) -> torch.Tensor:
    """``num_samples`` labels, each class ``N // C`` or one more times, in an order shuffled with ``seed``."""
    order = np.random.default_rng([LABEL_STREAM, int(seed)]).permutation(num_samples)
    return torch.from_numpy(order % num_classes).long()


def rank_seed(seed: int, rank: int, world_size: int) -> int:
    """The seed of rank ``rank``'s one stream, as DiT's ``sample_ddp.py`` seeds it."""
    return int(seed) * int(world_size) + int(rank)


def batches_per_rank(num_samples: int, batch_size: int, world_size: int) -> int:
    """Full batches each rank samples: ``num_samples`` rounded up to a multiple of ``batch_size * world_size``."""
    return math.ceil(num_samples / (batch_size * world_size))


def sample_indices(batch: int, rank: int, world_size: int, batch_size: int) -> np.ndarray:
    """Where the samples of rank ``rank``'s ``batch``-th batch go in the output (``sample_ddp.py``'s file numbers)."""
    return batch * batch_size * world_size + np.arange(batch_size) * world_size + rank


def part_path(parts: Path, rank: int, batch: int) -> Path:
    return parts / f"rank{rank:04d}_batch{batch:06d}.npz"


@torch.no_grad()
def sample_rank(task, model, mode: str, num_samples: int, num_classes: int, seed: int, device: torch.device,
                parts: Path, dist, bar=None, decode_batch_size: int = 32) -> None:
    """This rank's batches (see the module docstring), decoded ``decode_batch_size`` latents at a time and stored with
    their output indices and the stream's state after them; a stored batch is not sampled again, the stream goes on
    from its state."""
    from moh_vision.analysis.grids import to_uint8
    size = int(task.sample_cfg["batch_size"])
    balanced = balanced_labels(num_samples, num_classes, seed) if mode == "balanced" else None
    stream = torch.Generator(device=device).manual_seed(rank_seed(seed, dist.rank, dist.world_size))
    for batch in range(batches_per_rank(num_samples, size, dist.world_size)):
        path = part_path(parts, dist.rank, batch)
        if path.exists():
            with np.load(path) as part:
                stream.set_state(torch.from_numpy(part["stream"]))
        else:
            index = sample_indices(batch, dist.rank, dist.world_size, size)
            if balanced is None:
                labels = torch.randint(0, num_classes, (size,), generator=stream, device=device).cpu()
            else:  # indices past N are sampled and dropped, as sample_ddp.py's: any class
                labels = balanced[torch.from_numpy(index % num_samples)]
            latents = task.sample(model, labels, device, generator=stream)
            images = np.concatenate([to_uint8(task.decode(x)) for x in latents.split(decode_batch_size)])
            state = stream.get_state().numpy()
            atomic_write(path, lambda f: np.savez(f, images=images, labels=labels.numpy(), index=index, stream=state))
        if bar is not None:
            bar.update(size)


def merge_parts(parts: Path, num_samples: int, batch_size: int, world_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Every rank's batches in output order, the first ``num_samples`` kept."""
    images = labels = None
    for rank in range(world_size):
        for batch in range(batches_per_rank(num_samples, batch_size, world_size)):
            with np.load(part_path(parts, rank, batch)) as part:
                index, keep = part["index"], part["index"] < num_samples
                if images is None:
                    images = np.empty((num_samples, *part["images"].shape[1:]), dtype=np.uint8)
                    labels = np.empty(num_samples, dtype=np.int64)
                images[index[keep]], labels[index[keep]] = part["images"][keep], part["labels"][keep]
    return images, labels


def sample_images(task, model, mode: str, num_samples: int, num_classes: int, seed: int, device: torch.device,
                  parts: Path, dist, progress: bool = True, decode_batch_size: int = 32
                  ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """All ranks sample their batches; rank 0 returns (uint8 NHWC images, labels) in output order, others None."""
    size = int(task.sample_cfg["batch_size"])
    bar = None
    if progress and dist.is_main:
        from tqdm.auto import tqdm
        bar = tqdm(total=batches_per_rank(num_samples, size, dist.world_size) * size, unit="img",
                   desc=f"sampling (rank 0 of {dist.world_size})", dynamic_ncols=True)
    parts.mkdir(parents=True, exist_ok=True)
    sample_rank(task, model, mode, num_samples, num_classes, seed, device, parts, dist, bar, decode_batch_size)
    if bar is not None:
        bar.close()
    barrier(dist)
    return merge_parts(parts, num_samples, size, dist.world_size) if dist.is_main else None
