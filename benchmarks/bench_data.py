"""Time this project's image loaders against timm's on a generated ImageNet-like JPEG tree.

    python benchmarks/bench_data.py                                   # 4 classes of 500x375 JPEGs, workers 0 and 2
    python benchmarks/bench_data.py quick=true                        # a few seconds, for CI
    python benchmarks/bench_data.py workers=0,4 rounds=5 out=bench_data.md   # + bench_data.json
    python benchmarks/bench_data.py root=/data/flowers workers=0,8    # an existing train/ + val/ tree (only read)
    python benchmarks/bench_data.py source=wds                        # moh_vision reads a webdataset copy of the tree

For each split (train: the TransNeXt recipe's augmentation; val: resize and crop) and worker count, one
pass of this project's loader (``ImageFolderData`` in the trainer's loaders) and one of timm's
(``create_loader`` with the same recipe) per round, the candidates taking turns; images/s (median and
quartiles), per worker (``workers=0``: the main process on one thread, i.e. one worker's rate) and the
per-round ratio.

How it times: it generates an ImageNet-like class-folder tree (:func:`make_jpeg_tree`: 500 x 375 JPEGs of about
ImageNet's size on disk and decode time) and times one pass over each split with

* **moh_vision**: ``ImageFolderData`` with the TransNeXt recipe in the trainer's loaders (``SeededItems`` over an
  ``EpochSampler``, the unreadable-image collate, :func:`~moh_vision.data.sampler.loader_options`);
* **timm**: ``timm.data.ImageDataset`` in ``timm.data.create_loader`` (no prefetcher: a CPU loader) with
  ``timm.data.create_transform``'s build of the same recipe, whose posterize gets the project's fix
  (``use_safe_posterize``: Pillow 13 refuses the recipe's 0-bit posterize), the one change, so that it runs at all.

Mixup is in neither (the training step mixes batches). The candidates take turns with persistent workers
(``harness.interleave``), so a pass times loading, not process start-up; ``workers=0`` loads
in the main process on one thread (one worker's rate). The ratio moh_vision / timm is per round.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from harness import Spread, interleave, machine_description, write_record
from moh_vision.cli import Option, boolean, integer, list_of, run_tool, text
from moh_vision.data.imagefolder import ImageFolderData
from moh_vision.data.sampler import EpochKeys, EpochSampler, SeededItems, loader_options
from moh_vision.data.transforms import RECIPE_RE_COUNT, RECIPE_RE_MODE, use_safe_posterize

RECIPE = dict(auto_augment="rand-m9-mstd0.5-inc1", color_jitter=0.4, interpolation="bicubic", re_prob=0.25)
EVAL_CROP_PCT = 0.875  # ImageFolderData's default: resize 256, crop 224
LOADERS = ("moh_vision", "timm")


@dataclass
class DataBench:
    """What one run measures (this script's options)."""
    root: Optional[str] = None  # the tree: made here if it has no train/ (default: a temporary directory)
    classes: int = 4
    train_per_class: int = 48
    val_per_class: int = 16
    image_size: Tuple[int, int] = (500, 375)  # width, height of the generated JPEGs
    img_size: int = 224  # the model's input side
    batch: int = 32
    workers: Sequence[int] = (0, 2)
    splits: Sequence[str] = ("train", "val")
    rounds: int = 3
    seed: int = 0
    source: str = "folder"  # what moh_vision reads: the tree, or a copy of it as tar / wds / hfds


QUICK_DATA = dict(classes=2, train_per_class=8, val_per_class=4, image_size=(160, 120), img_size=64, batch=4,
                  workers=(0,), rounds=1)


# -- The tree ----------------------------------------------------------------------------------------------------------
def _jpeg_like(rng: np.random.Generator, size: Tuple[int, int]):
    """A photo-like image: a smooth colour field, a dozen filled shapes (edges) and sensor-like noise."""
    from PIL import Image, ImageDraw
    width, height = size
    img = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = [x0, y0, x0 + int(rng.integers(10, width // 2)), y0 + int(rng.integers(10, height // 2))]
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    noisy = np.asarray(img, dtype=np.int16) + rng.normal(0, 14, (height, width, 3)).astype(np.int16)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def make_jpeg_tree(root: Path, classes: int, train_per_class: int, val_per_class: int,
                   size: Tuple[int, int] = (500, 375), seed: int = 0) -> None:
    """``root/{train,val}/class<k>/<i>.JPEG`` (quality 90)."""
    rng = np.random.default_rng(seed)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for k in range(classes):
            folder = root / split / f"class{k}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                _jpeg_like(rng, size).save(folder / f"{i:05d}.JPEG", "JPEG", quality=90)


def describe_tree(root: Path) -> Dict[str, int]:
    """Classes, images per split and their mean size on disk, of a class-folder tree."""
    files = {split: [p for p in (root / split).rglob("*") if p.is_file()] for split in ("train", "val")}
    sizes = [p.stat().st_size for paths in files.values() for p in paths]
    return {"classes": sum(1 for p in (root / "train").iterdir() if p.is_dir()), "train_images": len(files["train"]),
            "val_images": len(files["val"]), "mean_jpeg_bytes": int(np.mean(sizes)) if sizes else 0}


# -- The loaders -------------------------------------------------------------------------------------------------------
def ours(root: Path, split: str, bench: DataBench, workers: int) -> DataLoader:
    """The trainer's loader of ``split`` over ``ImageFolderData`` with the recipe (no mixup: the step does it)."""
    if bench.source != "folder":
        root = root.parent / f"{root.name}_{bench.source}"
    data = ImageFolderData(str(root), img_size=bench.img_size, repeated_aug=1, mixup=None, cutmix=None,
                           eval_crop_pct=EVAL_CROP_PCT, source=bench.source, index_cache=None, **RECIPE)
    options = loader_options(workers, pin_memory=False)
    if split == "train" and data.streaming:  # batches from the stream itself, workers started each pass
        data.train.configure(bench.batch, bench.seed, 0, 1)
        return DataLoader(data.train, batch_size=None, collate_fn=data.collate_fn,
                          **{**options, "persistent_workers": False})
    if split == "train":
        sampler = EpochSampler(len(data.train), shuffle=True, seed=bench.seed, drop_last=True)
        return DataLoader(SeededItems(data.train, bench.seed), batch_size=bench.batch, sampler=EpochKeys(sampler),
                          drop_last=True, collate_fn=data.collate_fn, **options)
    return DataLoader(data.val, batch_size=bench.batch, shuffle=False, collate_fn=data.collate_fn, **options)


def timms(root: Path, split: str, bench: DataBench, workers: int) -> DataLoader:
    """timm's loader and transform of ``split`` with the same recipe."""
    from timm.data import ImageDataset, create_loader
    training = split == "train"
    recipe = dict(RECIPE, re_mode=RECIPE_RE_MODE, re_count=RECIPE_RE_COUNT) if training else \
        dict(interpolation=RECIPE["interpolation"], crop_pct=EVAL_CROP_PCT)
    loader = create_loader(ImageDataset(str(root / split)), input_size=(3, bench.img_size, bench.img_size),
                           batch_size=bench.batch, is_training=training, use_prefetcher=False, num_workers=workers,
                           persistent_workers=workers > 0, **recipe)
    use_safe_posterize(loader.dataset.transform)  # before the workers fork: they copy the fixed transform
    return loader


def one_pass(loader: DataLoader, images: Dict[str, int], name: str) -> Callable[[], None]:
    """A call that loads every batch of one pass over ``loader`` and notes how many images it held. The trainer's loader
    starts a new epoch each pass (new augmentations, as timm's loader draws), never repeating a sample of them."""
    epochs = getattr(loader.sampler, "sampler", None)  # EpochKeys over an EpochSampler

    def call() -> None:
        if epochs is not None:
            epochs.set_epoch(epochs.epoch + 1)
        images[name] = sum(len(batch[0]) for batch in loader)
    return call


# -- The run -----------------------------------------------------------------------------------------------------------
def _label(split: str, workers: int, loader: str) -> str:
    return f"{split}/{workers}/{loader}"


def measure(root: Path, bench: DataBench) -> List[dict]:
    """One row per (split, workers): both loaders' images/s (median, quartiles), per worker, and the per-round ratio."""
    builders = {"moh_vision": ours, "timm": timms}
    loaders = {_label(s, w, name): builders[name](root, s, bench, w)
               for s in bench.splits for w in bench.workers for name in LOADERS}
    images: Dict[str, int] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the main process as one worker (a worker process runs one thread)
    try:
        times = interleave({name: one_pass(loader, images, name) for name, loader in loaders.items()},
                           rounds=bench.rounds, warmup=1)
    finally:
        torch.set_num_threads(threads)
        loaders.clear()  # their workers stop
    rows = []
    for split in bench.splits:
        for workers in bench.workers:
            row: dict = {"split": split, "workers": workers}
            for name in LOADERS:
                label = _label(split, workers, name)
                row["images"] = images[label]
                row[name] = Spread.of([images[label] / t for t in times[label]]).as_dict()
                row[f"{name}_per_worker"] = row[name]["median"] / max(1, workers)
            mine, theirs = (_label(split, workers, name) for name in LOADERS)
            row["moh_vision_over_timm"] = Spread.of([(images[mine] / a) / (images[theirs] / b)  # per round
                                                     for a, b in zip(times[mine], times[theirs])]).as_dict()
            rows.append(row)
    return rows


def data_table(rows: Sequence[dict], header: str) -> str:
    """The markdown table of :func:`measure`'s rows."""
    lines = [header, "", "| split | workers | images/pass | moh_vision images/s | timm images/s | "
             "moh_vision per worker | timm per worker | moh_vision / timm |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rates = [Spread(**r[name]).text(1) for name in LOADERS]
        workers = "0 (in-process)" if r["workers"] == 0 else str(r["workers"])
        lines.append(f"| {r['split']} | {workers} | {r['images']} | {rates[0]} | {rates[1]} | "
                     f"{r['moh_vision_per_worker']:.1f} | {r['timm_per_worker']:.1f} | "
                     f"{Spread(**r['moh_vision_over_timm']).text(2)} |")
    return "\n".join(lines)


def bench_data(bench: DataBench, out: Optional[str] = None) -> dict:
    """Make (or reuse) the tree, measure, print the table and return the record; ``out`` gets both (md and .json)."""
    import PIL
    import timm
    with tempfile.TemporaryDirectory(prefix="bench_data_") as scratch:
        root = Path(bench.root) if bench.root else Path(scratch)
        if not (root / "train").is_dir():  # an existing tree (a real one too) is read, never written to
            make_jpeg_tree(root, bench.classes, bench.train_per_class, bench.val_per_class, bench.image_size,
                           bench.seed)
        tree = describe_tree(root)
        if bench.source != "folder":  # a copy in the source's layout, beside the tree (a real tree is not written)
            from pack import pack_tree
            copy = Path(scratch) / "packed"
            pack_tree(root, copy / f"tree_{bench.source}", bench.source)
            (copy / "tree").symlink_to(root.resolve())
            root = copy / "tree"
        rows = measure(root, bench)
    header = (f"Loader images/s, {machine_description()}, torch {torch.__version__}, timm {timm.__version__}, "
              f"Pillow {PIL.__version__}, moh_vision source {bench.source}: {tree['train_images']} train / "
              f"{tree['val_images']} val JPEGs of "
              f"{bench.image_size[0]}x{bench.image_size[1]} ({tree['mean_jpeg_bytes'] // 1024} KiB on average), "
              f"{bench.img_size}px, batch {bench.batch}; median [quartiles] over {bench.rounds} interleaved passes")
    table = data_table(rows, header)
    print(table)
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(bench).items()}
    record = {"header": header, "machine": machine_description(), "torch": torch.__version__,
              "timm": timm.__version__, "pillow": PIL.__version__, "settings": settings, "tree": tree, "rows": rows}
    write_record(out, table + "\n", record)
    return record


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
