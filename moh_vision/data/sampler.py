"""Samplers whose order is a pure function of (seed, epoch), so a run can resume mid-epoch exactly."""
from __future__ import annotations

import math
import random
from typing import Any, Iterator, List

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class EpochSampler(Sampler[int]):
    """Shuffled (or ordered) indices for one rank, optionally with repeated augmentation.

    ``repeats > 1`` is the DeiT/TransNeXt repeated-augmentation sampler: every index appears
    ``repeats`` times, spread over ranks, and each rank keeps ``len(dataset) // world`` of them
    per epoch. ``start`` skips that many of this rank's indices (resume mid-epoch).
    """

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 repeats: int = 1, drop_last: bool = False):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world, self.repeats = rank, world_size, max(1, int(repeats))
        self.drop_last = drop_last
        self.epoch, self.start = 0, 0
        if self.repeats > 1:
            self.per_rank = size // world_size
        elif drop_last:
            self.per_rank = size // world_size
        else:
            self.per_rank = math.ceil(size / world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = int(epoch), int(start)

    def indices(self) -> List[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=g) if self.shuffle else torch.arange(self.size)
        if self.repeats > 1:
            order = order.repeat_interleave(self.repeats)
            total = math.ceil(len(order) / self.world) * self.world
            order = torch.cat([order, order[: total - len(order)]])
            return order[self.rank:total:self.world][: self.per_rank].tolist()
        total = self.per_rank * self.world
        if total > self.size:
            order = torch.cat([order, order[: total - self.size]])
        return order[self.rank:total:self.world].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start:])

    def __len__(self) -> int:
        return max(0, self.per_rank - self.start)


class SeededItems(Dataset):
    """Wraps a dataset so each item's random augmentation depends only on (seed, epoch, index).

    DataLoader workers draw from their own RNG streams, which shift when a run resumes
    mid-epoch; seeding python/numpy/torch per item makes augmentation independent of which
    worker loads an item and of where the run restarted.
    """

    def __init__(self, dataset: Dataset, seed: int = 0):
        self.dataset, self.seed, self.epoch = dataset, int(seed), 0

    def __len__(self) -> int:
        return len(self.dataset)

    def item_seed(self, index: int) -> int:
        return (self.seed * 1_000_003 + self.epoch * 9_973 + int(index) * 7) % (2**31 - 1)

    def __getitems__(self, indices: List[int]) -> List[Any]:
        """A batch (the DataLoader asks for one at a time): in one call where the dataset can draw each item's
        augmentation from its own seed (``seeded_items(indices, seeds)``, torch's CPU generator only), else
        item by item."""
        batched = getattr(self.dataset, "seeded_items", None)
        if batched is None:
            return [self[index] for index in indices]
        return batched(indices, [self.item_seed(index) for index in indices])

    def __getitem__(self, index: int) -> Any:
        item_seed = self.item_seed(index)
        in_main_process = torch.utils.data.get_worker_info() is None
        if in_main_process:  # leave the training loop's RNG streams untouched
            saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
        random.seed(item_seed)
        np.random.seed(item_seed)
        # the CPU generator only (augmentation runs on the CPU): torch.manual_seed would also queue a seed
        # for every accelerator backend, recording a stack trace each time (~0.5 ms per item)
        torch.default_generator.manual_seed(item_seed)
        try:
            return self.dataset[index]
        finally:
            if in_main_process:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.set_rng_state(saved[2])

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
