"""Samplers whose order is a pure function of (seed, epoch), so a run can resume mid-epoch exactly, and the options of
the loaders over them (:func:`loader_options`).

Loader workers live for the whole run (``persistent_workers``): each item's augmentation seed comes from the
``(epoch, index)`` key the main process hands over with it (``EpochKeys``), not from state that the main process changes
between epochs, which a worker started in an earlier epoch would not see."""
from __future__ import annotations

import math
import random
from typing import Any, Dict, Iterator, List, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class EpochSampler(Sampler[int]):
    """Shuffled (or ordered) indices for one rank; ``start`` skips that many of them (resume mid-epoch). ``repeats > 1``
    is DeiT/TransNeXt's repeated augmentation: every index appears ``repeats`` times, spread over ranks, and each rank
    keeps ``len(dataset) // world`` of them per epoch."""

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 repeats: int = 1, drop_last: bool = False):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world, self.repeats = rank, world_size, max(1, int(repeats))
        self.drop_last = drop_last
        self.epoch, self.start = 0, 0
        self.per_rank = size // world_size if self.repeats > 1 or drop_last else math.ceil(size / world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = int(epoch), int(start)

    def indices(self) -> List[int]:
        return [index for index, _ in self.keyed()]

    def keyed(self) -> List[Tuple[int, int]]:
        """This rank's ``(index, copy)`` pairs of the epoch: ``copy`` tells the ``repeats`` copies of an index apart
        (0 without repeated augmentation), so that each copy draws its own augmentation (:class:`SeededItems`), as each
        rank's loader draws its own in DeiT's sampler; a rank may hold two copies of one index."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=g) if self.shuffle else torch.arange(self.size)
        if self.repeats > 1:
            order = order.repeat_interleave(self.repeats)
            total = math.ceil(len(order) / self.world) * self.world
            copies = torch.arange(total) % self.repeats + torch.arange(total) // len(order) * self.repeats
            order = torch.cat([order, order[: total - len(order)]])
            mine = slice(self.rank, total, self.world)
            return list(zip(order[mine].tolist(), copies[mine].tolist()))[: self.per_rank]
        total = self.per_rank * self.world
        if total > self.size:
            order = torch.cat([order, order[: total - self.size]])
        copies = torch.arange(total) // self.size  # an index repeated to even out the ranks is a second copy
        mine = slice(self.rank, total, self.world)
        return list(zip(order[mine].tolist(), copies[mine].tolist()))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start:])

    def __len__(self) -> int:
        return max(0, self.per_rank - self.start)


class EpochKeys(Sampler[Tuple[int, int, int]]):
    """``sampler``'s indices as ``(epoch, index, copy)`` keys for :class:`SeededItems`: the epoch travels with every
    index to the loader's workers, so workers kept across epochs draw the new epoch's augmentation, and the copy number
    gives each repeated-augmentation copy its own."""

    def __init__(self, sampler: EpochSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        epoch = self.sampler.epoch  # read when the epoch's iteration starts, in the main process
        return ((epoch, index, copy) for index, copy in self.sampler.keyed()[self.sampler.start:])

    def __len__(self) -> int:
        return len(self.sampler)


class HeldIndices(Sampler[int]):
    """A fixed order of indices (validation) that ``held`` empties: a loader opened over it while held starts its
    workers with nothing to fetch (``moh_vision.engine.fit_setup.Loaders.start_workers``)."""

    def __init__(self, indices: Sequence[int]):
        self.indices, self.held = list(indices), False

    def __iter__(self) -> Iterator[int]:
        return iter(() if self.held else self.indices)

    def __len__(self) -> int:
        return 0 if self.held else len(self.indices)


Key = Union[int, Tuple[int, ...]]  # an index (of the current ``epoch``), or an (epoch, index[, copy]) key


class SeededItems(Dataset):
    """Wraps a dataset so each item's random augmentation depends only on (seed, epoch, index, copy): python, numpy and
    torch are seeded per item, whichever worker or rank loads it and wherever the run restarted. Items are asked for by
    index (in the epoch set on ``epoch``, copy 0) or by ``(epoch, index[, copy])`` key (:class:`EpochKeys`)."""

    def __init__(self, dataset: Dataset, seed: int = 0):
        self.dataset, self.seed, self.epoch = dataset, int(seed), 0

    def __len__(self) -> int:
        return len(self.dataset)

    def _epoch_and_index(self, key: Key) -> Tuple[int, int]:
        return (int(key[0]), int(key[1])) if isinstance(key, (tuple, list)) else (self.epoch, int(key))

    def item_seed(self, key: Key) -> int:
        epoch, index = self._epoch_and_index(key)
        copy = int(key[2]) if isinstance(key, (tuple, list)) and len(key) > 2 else 0
        return (self.seed * 1_000_003 + epoch * 9_973 + index * 7 + copy * 104_729) % (2**31 - 1)

    def __getitems__(self, keys: Sequence[Key]) -> List[Any]:
        """A batch (the DataLoader asks for one at a time): in one call where the dataset can draw each item's
        augmentation from its own seed (``seeded_items(indices, seeds)``, torch's CPU generator only), else per item."""
        batched = getattr(self.dataset, "seeded_items", None)
        if batched is None:
            return [self[key] for key in keys]
        return batched([self._epoch_and_index(key)[1] for key in keys], [self.item_seed(key) for key in keys])

    def __getitem__(self, key: Key) -> Any:
        item_seed, index = self.item_seed(key), self._epoch_and_index(key)[1]
        in_main_process = torch.utils.data.get_worker_info() is None
        if in_main_process:  # leave the training loop's RNG streams untouched
            saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
        random.seed(item_seed)
        np.random.seed(item_seed)
        # the CPU generator only (augmentation runs on the CPU): torch.manual_seed would also queue a seed for every
        # accelerator backend, recording a stack trace each time (~0.5 ms per item)
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


def loader_options(num_workers: int, pin_memory: bool) -> Dict[str, Any]:
    """The DataLoader options of the trainer's loaders (and the loader benchmark's): forked workers (the dataset is not
    pickled) kept for the whole run, and a generator per loader (a loader iterator draws a base seed, which must not
    come from the global RNG, or a run resumed mid-epoch would diverge from an uninterrupted one)."""
    return dict(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0,
                multiprocessing_context="fork" if num_workers > 0 else None, generator=torch.Generator())
