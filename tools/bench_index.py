"""Time the image-folder file index on a generated tree of empty files (ImageNet's names, 1000 classes).

    python tools/bench_index.py                                  # 1000 classes x (200 train + 10 val): 210,000 files
    python tools/bench_index.py classes=10 train_per_class=20 rounds=1   # a few seconds
    python tools/bench_index.py rounds=5 out=docs/bench/<folder>/file_index.json

The seconds a run's start-up waits for ``ImageFolderData``: scanning the tree (no cache), the first start with
the cache (scan and keep) and the next (read back and checked); median and quartiles over the rounds. The tree
is generated in a temporary folder (``root``: under that folder) and removed. How it times:
:mod:`moh_vision.analysis.index_bench`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from moh_vision.analysis.index_bench import bench_index
from moh_vision.cli import Option, integer, run_tool

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
