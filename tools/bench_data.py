"""Time this project's image loaders against timm's on a generated ImageNet-like JPEG tree.

    python tools/bench_data.py                                   # 4 classes of 500x375 JPEGs, workers 0 and 2
    python tools/bench_data.py quick=true                        # a few seconds, for CI
    python tools/bench_data.py workers=0,4 rounds=5 out=bench_data.md   # + bench_data.json
    python tools/bench_data.py root=/data/flowers workers=0,8    # an existing train/ + val/ tree (only read)
    python tools/bench_data.py source=wds                        # moh_vision reads a webdataset copy of the tree

For each split (train: the TransNeXt recipe's augmentation; val: resize and crop) and worker count, one
pass of this project's loader (``ImageFolderData`` in the trainer's loaders) and one of timm's
(``create_loader`` with the same recipe) per round, the candidates taking turns; images/s (median and
quartiles), per worker (``workers=0``: the main process on one thread, i.e. one worker's rate) and the
per-round ratio. How it times: :mod:`moh_vision.analysis.data_bench`.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Optional, Sequence

from moh_vision.analysis.data_bench import QUICK_DATA, DataBench, bench_data
from moh_vision.cli import Option, boolean, integer, list_of, run_tool, text

OPTIONS = (
    Option("root", help="the tree: used as it is if it has train/, else generated there (default: a temporary dir)"),
    Option("classes", 4, integer, "classes of the generated tree", minimum=1),
    Option("train_per_class", 48, integer, "generated training images per class", minimum=1),
    Option("val_per_class", 16, integer, "generated validation images per class", minimum=1),
    Option("image_size", [500, 375], list_of(integer), "width,height of the generated JPEGs", minimum=8),
    Option("img_size", 224, integer, "the model's input side", minimum=8),
    Option("batch", 32, integer, "images per batch", minimum=1),
    Option("workers", [0, 2], list_of(integer), "loader worker counts (0: in the main process)", minimum=0),
    Option("splits", ["train", "val"], list_of(text), "which pipelines", choices=("train", "val")),
    Option("rounds", 3, integer, "timed passes per candidate (interleaved)", minimum=1),
    Option("seed", 0, integer, "the tree's and the sampler's seed", minimum=0),
    Option("source", "folder", text, "what moh_vision's loader reads: the tree, or a copy as tar, wds (streamed) or "
           "hfds (parquet)", choices=("folder", "tar", "wds", "hfds")),
    Option("quick", False, boolean, "a tiny tree, one round: a smoke test for CI"),
    Option("out", help="also write the markdown table here, and every number to .json beside it"),
)


def bench(opts) -> dict:
    settings = {f.name: opts[f.name] for f in fields(DataBench)}
    settings["image_size"] = tuple(settings["image_size"])
    return bench_data(DataBench(**{**settings, **(QUICK_DATA if opts.quick else {})}), opts.out)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
