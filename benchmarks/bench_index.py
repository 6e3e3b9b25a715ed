"""Time the image-folder file index on a generated tree of empty files (ImageNet's names, 1000 classes).

    python benchmarks/bench_index.py                              # 1000 classes x (200 train + 10 val): 210,000 files
    python benchmarks/bench_index.py classes=10 train_per_class=20 rounds=1   # a few seconds
    python benchmarks/bench_index.py rounds=5 out=docs/bench/<folder>/file_index.json

The seconds a run's start-up waits for ``ImageFolderData``: scanning the tree (no cache), the first start with
the cache (scan and keep) and the next (read back and checked); median and quartiles over the rounds. The tree
is generated in a temporary folder (``root``: under that folder) and removed; its files are empty (their names are
all an index reads: :mod:`moh_vision.data.file_index`).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from tqdm.auto import tqdm

from harness import Spread, machine_description, print_json_record
from moh_vision.cli import Option, integer, run_tool

SCAN_ONLY = dict(img_size=32, auto_augment=None, mixup=None, cutmix=None, re_prob=None, repeated_aug=1)


def make_empty_tree(root: Path, classes: int, train_per_class: int, val_per_class: int) -> int:
    """``root/{train,val}/class<c>/<i>.JPEG``, empty files as ImageNet names them; the number of files."""
    count = 0
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for c in tqdm(range(classes), desc=f"generating {split}/", leave=False, disable=None):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                (folder / f"n{c:08d}_{i}.JPEG").touch()
            count += per_class
    return count


def _seconds(build) -> float:
    start = time.perf_counter()
    build()
    return time.perf_counter() - start


def time_index(root: Path, rounds: int, settle_s: float) -> Dict[str, Any]:
    """Per round: a scan without the cache, then the first and the second start with a new cache folder; the tree is
    left alone ``settle_s`` seconds first (an index of a tree that just changed is not kept)."""
    from moh_vision.data.imagefolder import ImageFolderData
    time.sleep(settle_s)
    times: Dict[str, list] = {"scan_s": [], "first_s": [], "second_s": []}
    for _ in tqdm(range(rounds), desc="rounds", leave=False, disable=None):
        times["scan_s"].append(_seconds(lambda: ImageFolderData(str(root), index_cache=None, **SCAN_ONLY)))
        with tempfile.TemporaryDirectory(prefix="index_cache_") as cache:
            times["first_s"].append(_seconds(lambda: ImageFolderData(str(root), index_cache=cache, **SCAN_ONLY)))
            if not list(Path(cache).glob("*.npz")):
                raise RuntimeError(f"the index of {root} was not kept: is the tree changing?")
            times["second_s"].append(_seconds(lambda: ImageFolderData(str(root), index_cache=cache, **SCAN_ONLY)))
    return {key: Spread.of(values).as_dict() for key, values in times.items()}


def bench_index(classes: int, train_per_class: int, val_per_class: int, rounds: int, root: Optional[str] = None,
                out: Optional[str] = None, settle_s: float = 2.5) -> Dict[str, Any]:
    """The record: the tree, the machine and :func:`time_index`'s seconds (median and quartiles), printed and, with
    ``out``, written there (JSON). The tree is made in a temporary folder (under ``root`` if given), then removed."""
    with tempfile.TemporaryDirectory(prefix="index_tree_", dir=root) as folder:
        tree = Path(folder)
        files = make_empty_tree(tree, classes, train_per_class, val_per_class)
        record = {"machine": machine_description(), "files": files, "classes": classes,
                  "train_per_class": train_per_class, "val_per_class": val_per_class, "rounds": rounds,
                  **time_index(tree, rounds, settle_s)}
    record["speedup_second_over_scan"] = record["scan_s"]["median"] / record["second_s"]["median"]
    return print_json_record(record, out)


OPTIONS = (
    Option("classes", 1000, integer, "class folders", minimum=1),
    Option("train_per_class", 200, integer, "training files per class", minimum=1),
    Option("val_per_class", 10, integer, "validation files per class", minimum=1),
    Option("rounds", 3, integer, "rounds of (scan, first start, second start)", minimum=1),
    Option("root", help="generate the tree under this folder (default: the system's temporary folder)"),
    Option("out", help="write the record (JSON) here"),
)


def bench(opts) -> dict:
    return bench_index(opts.classes, opts.train_per_class, opts.val_per_class, opts.rounds, opts.root, opts.out)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
