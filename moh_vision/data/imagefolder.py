"""Real-image classification data: class-folder trees (``ImageFolderData``) and ImageNet-1K (``ImageNetData``).

Layout (the one torchvision's ``ImageFolder`` reads)::

    root/train/<class>/**/<image>.{jpg,jpeg,png,ppm,bmp,pgm,tif,tiff,webp}   (any case)
    root/val/<class>/**/<image>...

Class indices are the sorted class-folder names (the torchvision order, so ImageNet wnids get the standard indices).
Hidden files and folders (``.name``) are ignored. Everything is checked at construction; a problem raises
``ConfigError`` with one line naming the path and what was expected.

Batch format. ``collate_fn`` of a data module (used for train and val loaders) returns::

    (images: float32 [B', C, H, W], labels: int64 [B'], skipped: int)

where ``skipped`` counts the unreadable images dropped from the batch (``on_bad_image="skip"``), so ``B'`` can be odd,
or 0 (``images`` is then ``[0, C, H, W]``: skip the step). ``skipped`` is an int (a :class:`SkippedImages`) whose
``.files`` are the ``(path, reason)`` pairs; it pickles through DataLoader workers. The trainer counts distinct files
from it and names them in ``train.log``; each process (the main one, or each worker) also logs a warning once per file
on this module's logger. ``on_bad_image="raise"`` raises ``BadImageError`` naming the file instead.

Images are converted to RGB (``in_chans=3``) or L (``in_chans=1``): grayscale, CMYK, RGBA (alpha dropped, as
torchvision's loader does), palette and 16-bit images all load."""
from __future__ import annotations

import csv
import io
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate
from tqdm.auto import tqdm

from ..errors import ConfigError
from .file_index import Split, TreeWatch, as_split, built_once, cache_folder, cached_index
from .sources import (SOURCES, class_index, hf_classes, hf_image_bytes, infer_source, load_hf_split, read_member,
                      scan_tars, shard_lengths, split_path, split_tars)
from .transforms import (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, build_eval_transform, build_mixup,
                         build_train_transform)

logger = logging.getLogger(__name__)

__all__ = ["IMG_EXTENSIONS", "BadImage", "BadImageError", "SkippedImages", "ImageFileDataset", "ImageFolderData",
           "ImageNetData", "SkipBadImagesCollate", "load_image", "scan_class_folders"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_SHOW = 5  # how many names an error message lists before "..."


def _names(items: Sequence[str]) -> str:
    items = list(items)
    return ", ".join(items[:_SHOW]) + (f", ... ({len(items)} in all)" if len(items) > _SHOW else "")


# -- Loading one image -------------------------------------------------------------------------------------------------
class BadImageError(RuntimeError):
    """An image file that cannot be read or decoded (raised with ``on_bad_image="raise"``)."""


@dataclass(frozen=True)
class BadImage:
    """What the dataset returns in place of ``(image, label)`` for an unreadable file (skip mode)."""
    path: str
    reason: str


def _to_mode(img: Image.Image, mode: str) -> Image.Image:
    if img.mode == mode:
        return img
    if img.mode.startswith("I;16") or img.mode == "I":
        # 16-bit grayscale: PIL's convert clips at 255, so rescale to 8 bits first.
        arr = np.asarray(img, dtype=np.float32) / 257.0
        img = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
    elif img.mode in ("P", "PA"):
        img = img.convert("RGBA")  # palette transparency must be expanded before dropping it
    return img if img.mode == mode else img.convert(mode)


def decode_image(fileobj, mode: str = "RGB") -> Image.Image:
    """Fully decode the image in the binary file ``fileobj`` into a PIL image of ``mode`` ("RGB" or "L")."""
    img = Image.open(fileobj)
    img.load()
    return _to_mode(img, mode)


def load_image(path: str, mode: str = "RGB") -> Image.Image:
    """Read and fully decode ``path`` into a PIL image of ``mode`` ("RGB" or "L"). Decoding happens here (not lazily in
    a transform), so truncated files fail in this call."""
    with open(path, "rb") as f:
        return decode_image(f, mode)


# -- Scanning folders --------------------------------------------------------------------------------------------------
def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def _subfolders(folder: str, watch: Optional[TreeWatch] = None) -> List[str]:
    if watch is not None:
        watch.note(folder)
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def _images_under(folder: str, relative_to: str, watch: Optional[TreeWatch] = None) -> List[str]:
    """Image files below ``folder`` (recursively, following links; each folder's files sorted, then its sorted
    sub-folders), as paths relative to ``relative_to``; ``watch`` notes every folder read."""
    if watch is not None:
        watch.note(folder)  # before reading it: a change after the read shows as a later modification time
    files, folders = [], []
    try:
        entries = list(os.scandir(folder))
    except OSError as err:  # os.walk would skip it: images missing without a word
        raise ConfigError(f"cannot read the folder {folder} ({err.strerror}); expected a readable tree of images") \
            from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            folders.append(entry.name)
        elif _is_image(entry.name):
            files.append(entry.name)
    prefix = os.path.relpath(folder, relative_to)
    found = [os.path.join(prefix, name) if prefix != "." else name for name in sorted(files)]
    for name in sorted(folders):
        found += _images_under(os.path.join(folder, name), relative_to, watch)
    return found


def _require_dir(path: str, expected: str) -> None:
    if not os.path.isdir(path):
        what = "is not a folder" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"{path} {what}; expected {expected}")


def scan_class_folders(split_dir: str, watch: Optional[TreeWatch] = None, class_order: str = "sorted",
                       class_map: Optional[str] = None) -> Tuple[List[str], List[str], List[int]]:
    """``(classes, image paths relative to split_dir, labels)`` of a class-folder tree; ``watch`` notes folders read.
    Classes are the folder names in ``class_order`` (``sorted``: the plain string sort; ``natural``: timm's), or those
    of ``class_map`` (a file, one name a line), which must list every folder."""
    _require_dir(split_dir, "a folder with one sub-folder of images per class")
    folders = _subfolders(split_dir, watch)
    if not folders:
        loose = [f for f in os.listdir(split_dir) if _is_image(f)]
        hint = f" (it holds {len(loose)} images directly)" if loose else ""
        raise ConfigError(f"{split_dir} has no class folders{hint}; expected one sub-folder of images per class")
    classes = class_index(folders, class_order, class_map, split_dir)
    present = set(folders)
    paths: List[str] = []
    labels: List[int] = []
    empty = []
    for index, name in enumerate(tqdm(classes, desc=f"indexing {split_dir}", leave=False, disable=None)):
        if name not in present:  # a class map's class without a folder here
            continue
        found = _images_under(os.path.join(split_dir, name), split_dir, watch)
        if not found:
            empty.append(name)
        paths += found
        labels += [index] * len(found)
    if not paths:
        raise ConfigError(f"{split_dir} holds no images in its {len(classes)} class folders; "
                          f"expected files ending in {'/'.join(IMG_EXTENSIONS)}")
    if empty:
        raise ConfigError(f"class folder {os.path.join(split_dir, empty[0])} has no images"
                          f"{f' (nor do {len(empty) - 1} more: {_names(empty[1:])})' if len(empty) > 1 else ''}; "
                          f"expected at least one file ending in {'/'.join(IMG_EXTENSIONS)} per class folder")
    return classes, paths, labels


# -- Dataset and collate -----------------------------------------------------------------------------------------------
class ImageFileDataset(Dataset):
    """``(transform(image), label)`` for image files under ``root``; a ``BadImage`` for unreadable ones.

    Paths and labels are kept in numpy arrays rather than Python lists, so DataLoader workers forked from the main
    process do not copy them page by page (refcount writes) over an epoch."""

    def __init__(self, root: str, paths: Sequence[str], labels: Sequence[int], classes: Sequence[str], transform=None,
                 mode: str = "RGB", on_bad_image: str = "skip"):
        if on_bad_image not in ("skip", "raise"):
            raise ConfigError(f"on_bad_image={on_bad_image!r}; expected 'skip' or 'raise'")
        self.root = root
        encoded = isinstance(paths, np.ndarray) and paths.dtype.kind == "S"  # as the file index keeps them
        self._paths = paths if encoded else np.array([os.fsencode(p) for p in paths])
        self.targets = np.asarray(labels, dtype=np.int64)
        self.classes = list(classes)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.transform = transform
        self.mode = mode
        self.on_bad_image = on_bad_image
        self._warned: set = set()

    def __len__(self) -> int:
        return len(self.targets)

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self._paths[index]))

    @property
    def samples(self) -> List[Tuple[str, int]]:
        """``[(path, label), ...]`` as in torchvision's ``ImageFolder`` (built on demand)."""
        return [(self.path(i), int(t)) for i, t in enumerate(self.targets)]

    def read(self, index: int) -> Image.Image:
        """The decoded image ``index`` (sources other than files override it)."""
        return load_image(self.path(index), self.mode)

    def __getitem__(self, index: int):
        path, label = self.path(index), int(self.targets[index])
        try:
            img = self.read(index)
        except Exception as exc:  # PIL raises many types on corrupt data (OSError, SyntaxError, ...)
            reason = f"{type(exc).__name__}: {exc}"
            if self.on_bad_image == "raise":
                raise BadImageError(f"cannot read image {path}: {reason}") from exc
            if path not in self._warned:
                self._warned.add(path)
                logger.warning("skipping unreadable image %s (%s)", path, reason)
            return BadImage(path, reason)
        return (self.transform(img) if self.transform is not None else img), label


class BytesDecoder:
    """``decoder(name, data)``: the image encoded in ``data``, or a ``BadImage`` (``on_bad_image="raise"``: a
    ``BadImageError``) naming ``name``; a top-level class, so that it pickles into loader workers."""

    def __init__(self, mode: str = "RGB", on_bad_image: str = "skip"):
        self.mode, self.on_bad_image = mode, on_bad_image

    def __call__(self, name: str, data: bytes):
        try:
            return decode_image(io.BytesIO(data), self.mode)
        except Exception as exc:  # PIL raises many types on corrupt data
            reason = f"{type(exc).__name__}: {exc}"
            if self.on_bad_image == "raise":
                raise BadImageError(f"cannot read image {name}: {reason}") from exc
            logger.warning("skipping unreadable image %s (%s)", name, reason)
            return BadImage(name, reason)


class TarMemberDataset(ImageFileDataset):
    """Images inside tar files, read in place: ``paths`` are the file index's member references
    (:func:`~moh_vision.data.sources.read_member`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fds: dict = {}

    def path(self, index: int) -> str:
        rel, _, _, member = os.fsdecode(self._paths[index]).split("\t", 3)
        return os.path.join(self.root, rel, member)

    def read(self, index: int) -> Image.Image:
        return decode_image(io.BytesIO(read_member(self.root, os.fsdecode(self._paths[index]), self._fds)), self.mode)


class HfImageDataset(ImageFileDataset):
    """The images of a Hugging Face ``datasets.Dataset`` (undecoded ``image`` column; ``labels`` already mapped)."""

    def __init__(self, dataset, name: str, labels, classes, transform=None, mode: str = "RGB",
                 on_bad_image: str = "skip"):
        super().__init__(name, [], labels, classes, transform, mode, on_bad_image)
        self.dataset = dataset

    def path(self, index: int) -> str:
        return f"{self.root}[{int(index)}]"

    def read(self, index: int) -> Image.Image:
        data, _ = hf_image_bytes(self.dataset, index)
        return decode_image(io.BytesIO(data), self.mode)


class SkippedImages(int):
    """How many unreadable images a batch dropped: an ``int`` whose ``files`` are their ``(path, reason)`` pairs."""

    def __new__(cls, files: Sequence[Tuple[str, str]] = ()):
        files = tuple((str(path), str(reason)) for path, reason in files)
        obj = super().__new__(cls, len(files))
        obj.files = files
        return obj

    def __reduce__(self):  # pickles with its files (DataLoader workers send batches through pickle)
        return SkippedImages, (self.files,)

    def __repr__(self) -> str:
        return f"SkippedImages({int(self)}: {', '.join(path for path, _ in self.files)})"


class SkipBadImagesCollate:
    """Batch ``(image, label)`` items into ``(images, labels, skipped)``, dropping ``BadImage`` markers.

    A top-level class (not a closure) so it pickles into spawned DataLoader workers."""

    def __init__(self, image_shape: Tuple[int, int, int]):
        self.image_shape = tuple(image_shape)

    def __call__(self, batch):
        good = [item for item in batch if not isinstance(item, BadImage)]
        skipped = SkippedImages([(item.path, item.reason) for item in batch if isinstance(item, BadImage)])
        if good:
            images, labels = default_collate(good)
        else:
            images, labels = torch.empty((0, *self.image_shape)), torch.empty(0, dtype=torch.long)
        return images, labels, skipped

    def __repr__(self) -> str:
        return f"SkipBadImagesCollate(image_shape={self.image_shape})"


# -- Data modules ------------------------------------------------------------------------------------------------------
REPEATED_AUG_MULTI_PROCESS = 3  # DeiT / TransNeXt: --repeated-aug with 3 repeats, on 8+ GPUs


def _world_size() -> int:
    import torch.distributed as tdist
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def resolve_repeated_aug(value: Optional[Union[int, str]], world_size: Optional[int] = None) -> int:
    """Repeats per image and epoch. ``"auto"``: 3 when training runs in more than one process, else 1.

    Repeated augmentation (DeiT's RASampler) places the 3 augmented copies of an image on different processes. In a
    single process they land in the same batch and an epoch sees a third of the distinct images, which costs accuracy
    instead of adding it. An explicit integer is used as given (1 or 0/None = off)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        world = _world_size() if world_size is None else int(world_size)
        return REPEATED_AUG_MULTI_PROCESS if world > 1 else 1
    try:
        repeats = 1 if not value else int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"repeated_aug={value!r}; expected auto or an integer >= 1 (1 = off)") from None
    if repeats < 1:
        raise ConfigError(f"repeated_aug={value}; expected auto or an integer >= 1 (1 = off)")
    return repeats


class ImageFolderData:
    """Train/val class-folder tree with the TransNeXt / DeiT augmentation recipe.

    The data-module contract: ``num_classes, in_chans, img_size, train, val, collate_fn, mixup, repeated_aug,
    label_smoothing, describe()``. Every augmentation knob switches off with 0 / None (``auto_augment``,
    ``color_jitter``, ``re_prob``, ``mixup``, ``cutmix``, ``label_smoothing``, ``repeated_aug`` -> 1, ``eval_crop_pct``
    -> squash resize without crop; ``repeated_aug="auto"``: :func:`resolve_repeated_aug`). ``label_smoothing`` is built
    into ``mixup`` when that is on; the loss uses it only when ``mixup`` is None."""

    def __init__(self, root: str, img_size: int = 224, in_chans: int = 3,
                 auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1", color_jitter: Optional[float] = 0.4,
                 interpolation: str = "bicubic", re_prob: Optional[float] = 0.25, mixup: Optional[float] = 0.8,
                 cutmix: Optional[float] = 1.0, mixup_switch_prob: float = 0.5, mixup_prob: float = 1.0,
                 label_smoothing: Optional[float] = 0.1, repeated_aug: Optional[Union[int, str]] = "auto",
                 eval_crop_pct: Optional[float] = 0.875, mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
                 std: Sequence[float] = IMAGENET_DEFAULT_STD, on_bad_image: str = "skip",
                 index_cache: Optional[str] = "auto", source: str = "auto", class_order: str = "sorted",
                 class_map: Optional[str] = None, val_labels: Optional[str] = None,
                 splits: Sequence[str] = ("train", "val")):
        if in_chans not in (1, 3):
            raise ConfigError(f"in_chans={in_chans}; image folders load as RGB (3) or grayscale (1)")
        if int(img_size) != img_size or img_size <= 0:
            raise ConfigError(f"img_size={img_size}; expected a positive integer")
        if on_bad_image not in ("skip", "raise"):
            raise ConfigError(f"on_bad_image={on_bad_image!r}; expected 'skip' or 'raise'")
        repeated_aug = resolve_repeated_aug(repeated_aug)

        self.root = os.path.expanduser(str(root))
        self.img_size, self.in_chans = int(img_size), int(in_chans)
        self.repeated_aug = repeated_aug
        self.label_smoothing = float(label_smoothing or 0.0)
        self.on_bad_image = on_bad_image
        self._recipe = dict(auto_augment=auto_augment, color_jitter=color_jitter, re_prob=re_prob,
                            interpolation=interpolation, eval_crop_pct=eval_crop_pct)

        # Transforms and mixing first: a bad knob fails before the (possibly slow) folder scan.
        self.train_transform = build_train_transform(self.img_size, self.in_chans, auto_augment=auto_augment,
                                                     color_jitter=color_jitter, interpolation=interpolation,
                                                     re_prob=re_prob, mean=mean, std=std)
        self.eval_transform = build_eval_transform(self.img_size, self.in_chans, crop_pct=eval_crop_pct,
                                                   interpolation=interpolation, mean=mean, std=std)
        if source not in SOURCES:
            raise ConfigError(f"data.source={source!r}; expected one of {', '.join(SOURCES)}")
        if not set(splits) <= {"train", "val"} or not splits:
            raise ConfigError(f"splits={list(splits)}; expected train and/or val")
        self.splits = tuple(s for s in ("train", "val") if s in splits)
        self.class_order, self.class_map, self.val_labels = class_order, class_map, val_labels
        self.source = infer_source(self.root) if source == "auto" else source
        self.streaming = self.source == "wds"
        mode = "RGB" if self.in_chans == 3 else "L"
        if self.source == "hfds":
            classes, train, val = built_once(lambda: self._hf_splits(mode))
        else:
            key = "|".join([type(self).__name__, "/".join(IMG_EXTENSIONS), self.source, class_order,
                            os.path.abspath(os.path.expanduser(class_map)) if class_map else "",
                            str(val_labels or ""), ",".join(self.splits)])
            classes, train_split, val_split = built_once(
                lambda: cached_index(self._scan, self.root, key, cache_folder(index_cache)))
            files = TarMemberDataset if self.source in ("tar", "wds") else ImageFileDataset
            train = files(*train_split, classes, self.train_transform, mode, on_bad_image) \
                if "train" in self.splits else None
            if self.streaming and train is not None:
                train = built_once(lambda: self._stream(mode))
            val = files(*val_split, classes, self.eval_transform, mode, on_bad_image) if "val" in self.splits else None
        self.train, self.val = train, val
        self.classes = classes
        self.class_to_idx = {name: i for i, name in enumerate(classes)}
        self.num_classes = len(classes)
        self.mixup = build_mixup(self.num_classes, mixup=mixup, cutmix=cutmix, switch_prob=mixup_switch_prob,
                                 label_smoothing=label_smoothing, prob=mixup_prob)
        self.collate_fn = SkipBadImagesCollate((self.in_chans, self.img_size, self.img_size))

    # -- layout ------------------------------------------------------------------------------------

    def _split_dirs(self) -> Tuple[Optional[str], Optional[str]]:
        """(train, val) folders of the class-folder layout (None: a split not asked for). Asked for val alone, a root
        without val/ that holds class folders is the val split itself."""
        expected = "a folder with train/ and val/ sub-folders, each holding one folder of images per class"
        _require_dir(self.root, expected)
        found = {s: os.path.join(self.root, s) for s in self.splits}
        if self.splits == ("val",) and not os.path.isdir(found["val"]) and _subfolders(self.root):
            found["val"] = self.root  # any folder of class folders
        for d in found.values():
            _require_dir(d, f"{os.path.basename(d)}/ inside {self.root}: {expected}")
        return found.get("train"), found.get("val")

    def _locations(self) -> Dict[str, str]:
        """Where each split asked for is, for the tar and wds sources."""
        found = {}
        for split in self.splits:
            path = split_path(self.root, split, self.source) if os.path.isdir(self.root) else \
                (self.root if split == "val" and self.splits == ("val",) else None)
            if path is None:
                shards = f" or *-{'validation' if split == 'val' else split}-*.tar shards" if self.streaming else ""
                raise ConfigError(f"no {split} tars under {self.root}; expected {self.root}/{split}.tar, "
                                  f"{self.root}/{split}/ holding .tar files, {self.root}/ILSVRC2012_img_{split}.tar"
                                  f"{shards}")
            found[split] = path
        return found

    def _scan(self, watch: Optional[TreeWatch] = None) -> Tuple[List[str], Split, Split]:
        """``(classes, train split, val split)``, with the same classes in both (a split not asked for is empty);
        ``watch`` notes every folder and file read."""
        if watch is not None and os.path.exists(self.root):
            watch.note(self.root)  # train/ or val/ replaced
            if self.class_map and os.path.isfile(os.path.expanduser(self.class_map)):
                watch.note(os.path.expanduser(self.class_map))
        order, cmap = self.class_order, self.class_map
        scanned: Dict[str, Tuple[List[str], Split]] = {}
        if self.source == "folder":
            for split, folder in zip(("train", "val"), self._split_dirs()):
                if folder is not None:
                    classes, paths, labels = scan_class_folders(folder, watch, order, cmap)
                    scanned[split] = classes, as_split(folder, paths, labels)
        else:
            for split, path in self._locations().items():
                if split == "train" and self.streaming:
                    continue  # streamed: counted by _stream
                classes, folder, refs, labels = scan_tars(path, split, IMG_EXTENSIONS, self.val_labels, order, cmap,
                                                          watch)
                scanned[split] = classes, as_split(folder, refs, labels)
        if "train" in scanned and "val" in scanned:
            _check_same_classes(scanned["train"][0], scanned["val"][0], scanned["train"][1][0], scanned["val"][1][0])
        classes = next(iter(scanned.values()))[0]
        empty = as_split("", [], [])
        return classes, scanned.get("train", (None, empty))[1], scanned.get("val", (None, empty))[1]

    def _stream(self, mode: str):
        """The training shards of the wds source, streamed (:class:`~moh_vision.data.sources.ShardStream`)."""
        from .sources import ShardStream
        path = split_path(self.root, "train", "wds")
        shards = split_tars(path, "train") if path else []
        if not shards:
            raise ConfigError(f"no training shards under {self.root}; expected *-train-*.tar webdataset shards "
                              f"(<key>.jpg + <key>.cls), or train/ holding them")
        return ShardStream(shards, shard_lengths(shards, IMG_EXTENSIONS), self.train_transform,
                           BytesDecoder(mode, self.on_bad_image))

    def _hf_splits(self, mode: str):
        """``(classes, train, val)`` of a Hugging Face dataset on disk."""
        _require_dir(self.root, "a Hugging Face dataset on disk (parquet files of ILSVRC/imagenet-1k or a "
                                "save_to_disk folder)")
        splits = {s: load_hf_split(self.root, s) for s in self.splits}
        missing = [s for s, ds in splits.items() if ds is None]
        if missing:
            raise ConfigError(f"the Hugging Face dataset {self.root} has no {missing[0]} split; expected "
                              f"data/{'validation' if missing[0] == 'val' else 'train'}-*.parquet or a saved split")
        own = hf_classes(next(iter(splits.values())))
        classes = class_index(own, self.class_order, self.class_map, self.root) if self.class_map else own
        remap = np.array([classes.index(name) for name in own], dtype=np.int64)
        transforms = {"train": self.train_transform, "val": self.eval_transform}
        made = {s: HfImageDataset(ds, f"{self.root}:{s}", remap[np.asarray(ds["label"], dtype=np.int64)], classes,
                                  transforms[s], mode, self.on_bad_image) for s, ds in splits.items()}
        return classes, made.get("train"), made.get("val")

    # -- reporting ---------------------------------------------------------------------------------

    def describe(self) -> str:
        r = self._recipe
        aug = r["auto_augment"] or "off"
        jitter = "off (RandAugment on)" if r["auto_augment"] and r["color_jitter"] else (r["color_jitter"] or "off")
        crop = r["eval_crop_pct"]
        eval_desc = f"resize {int(self.img_size / float(crop))} -> crop {self.img_size}" if crop else \
            f"squash to {self.img_size}"
        mix = (f"mixup {self.mixup.mixup_alpha} cutmix {self.mixup.cutmix_alpha} switch {self.mixup.switch_prob}"
               if self.mixup is not None else "mixup off")
        sizes = " / ".join(f"{len(d) if d is not None else 'no'} {s}" for s, d in (("train", self.train),
                                                                               ("val", self.val)))
        return (f"{type(self).__name__}: {self.root} ({self.source}, {self.class_order} class order) | "
                f"{self.num_classes} classes, {sizes} images | {self.in_chans}x{self.img_size}x{self.img_size} | "
                f"train: aa {aug}, color jitter {jitter}, {r['interpolation']}, random erasing {r['re_prob'] or 0}, "
                f"{mix}, label smoothing {self.label_smoothing}, repeated aug x{self.repeated_aug} | "
                f"eval: {eval_desc} | bad images: {self.on_bad_image}")

    def __repr__(self) -> str:
        return self.describe()


def _folders_down_to(root: str, folder: str) -> List[str]:
    """``root`` and every folder from it down to ``folder`` (below it)."""
    chain = [root]
    relative = os.path.relpath(folder, root)
    for part in relative.split(os.sep) if relative != "." else ():
        chain.append(os.path.join(chain[-1], part))
    return chain


def _check_same_classes(train_classes, val_classes, train_dir: str, val_dir: str) -> None:
    if list(train_classes) == list(val_classes):
        return
    only_train = sorted(set(train_classes) - set(val_classes))
    only_val = sorted(set(val_classes) - set(train_classes))
    parts = [f"only in {split}: {_names(names)}" for split, names in (("train", only_train), ("val", only_val))
             if names]
    raise ConfigError(f"class folders of {train_dir} and {val_dir} differ ({'; '.join(parts)}); "
                      f"expected the same class folders in both")


# -- ImageNet-1K -------------------------------------------------------------------------------------------------------
VAL_SOLUTION_CSV = "LOC_val_solution.csv"


class ImageNetData(ImageFolderData):
    """ImageNet-1K with the TransNeXt recipe (the defaults of ``ImageFolderData``); checks 1000 classes.

    ``root`` may be either
      * ``root/{train,val}/<wnid>/*.JPEG`` (the class-folder layout; what ``torchvision.datasets.ImageNet`` unpacks the
        ILSVRC2012 tars + devkit into, and what the common ``valprep.sh`` produces), or
      * the ILSVRC layout of the Kaggle download: ``root/ILSVRC/Data/CLS-LOC/train/<wnid>/*.JPEG``, a flat
        ``.../CLS-LOC/val/*.JPEG``, and ``root/LOC_val_solution.csv`` (``ImageId,PredictionString``, the first word of
        the prediction string is the wnid). ``root`` may also point at ``CLS-LOC``."""
    expected_classes = 1000

    def _base(self) -> str:
        _require_dir(self.root, "the ImageNet folder holding train/ and val/ (or ILSVRC/Data/CLS-LOC/)")
        first = self.splits[0]  # train, or val when only val is asked for
        for base in (self.root, os.path.join(self.root, "ILSVRC", "Data", "CLS-LOC"),
                     os.path.join(self.root, "Data", "CLS-LOC")):
            if os.path.isdir(os.path.join(base, first)):
                return base
        if self.splits == ("val",) and _subfolders(self.root):
            return self.root  # the wnid folders themselves
        raise ConfigError(f"no ImageNet {first}/ folder under {self.root}; expected {self.root}/{first} "
                          f"with one folder per wnid, or the ILSVRC layout {self.root}/ILSVRC/Data/CLS-LOC/{first}")

    def _check_count(self, classes: List[str], where: str) -> None:
        if len(classes) != self.expected_classes:
            raise ConfigError(f"{where} has {len(classes)} class folders; ImageNet-1K expects "
                              f"{self.expected_classes} (use data=imagefolder for other class counts)")

    def _scan(self, watch: Optional[TreeWatch] = None) -> Tuple[List[str], Split, Split]:
        if self.source != "folder":
            index = super()._scan(watch)
            self._check_count(index[0], self.root)
            return index
        base = self._base()
        if watch is not None:  # the folders from the root down to base decide the layout found
            for folder in _folders_down_to(self.root, base):
                watch.note(folder)
            if self.class_map and os.path.isfile(os.path.expanduser(self.class_map)):
                watch.note(os.path.expanduser(self.class_map))
        order, cmap = self.class_order, self.class_map
        train_dir, val_dir = os.path.join(base, "train"), os.path.join(base, "val")
        if self.splits == ("val",) and not os.path.isdir(val_dir):
            val_dir = base
        classes, train = None, as_split("", [], [])
        if "train" in self.splits:
            classes, train_paths, train_labels = scan_class_folders(train_dir, watch, order, cmap)
            train = as_split(train_dir, train_paths, train_labels)
        val = as_split("", [], [])
        if "val" in self.splits:
            _require_dir(val_dir, f"val/ next to {train_dir}, with one folder per wnid or the flat ILSVRC val images")
            if _subfolders(val_dir, watch):
                val_classes, val_paths, val_labels = scan_class_folders(val_dir, watch, order, cmap)
                if classes is not None:
                    _check_same_classes(classes, val_classes, train_dir, val_dir)
                classes = val_classes
            else:
                val_paths, val_labels, classes = self._flat_val(base, val_dir, classes, watch)
                if "train" in self.splits:
                    present = sorted({classes[i] for i in val_labels})
                    _check_same_classes(classes, present, train_dir, val_dir)
            val = as_split(val_dir, val_paths, val_labels)
        self._check_count(classes, train_dir if "train" in self.splits else val_dir)
        return classes, train, val

    def _flat_val(self, base: str, val_dir: str, classes: Optional[List[str]], watch: Optional[TreeWatch] = None
                  ) -> Tuple[List[str], List[int], List[str]]:
        """Labels of a flat ``val/`` from ``LOC_val_solution.csv``, and the classes (those of the labels when
        ``classes`` is None: a val split read alone)."""
        images = _images_under(val_dir, val_dir, watch)
        if not images:
            raise ConfigError(f"{val_dir} holds no images; expected one folder per wnid or the flat ILSVRC val images")
        searched = list(dict.fromkeys(os.path.normpath(d) for d in (
            self.root, base, os.path.dirname(base), os.path.join(base, "..", "..", ".."))))
        csv_path = next((os.path.join(d, VAL_SOLUTION_CSV) for d in searched
                         if os.path.isfile(os.path.join(d, VAL_SOLUTION_CSV))), None)
        if csv_path is None:
            raise ConfigError(f"{val_dir} holds images without class folders and no {VAL_SOLUTION_CSV} was found in "
                              f"{', '.join(searched)}; expected that file, or val/ sorted into one folder per wnid")
        if watch is not None:  # the file, and where it was looked for
            for path in [csv_path] + [d for d in searched if os.path.isdir(d)]:
                watch.note(path)
        wnid_of = {}
        with open(csv_path, newline="") as f:
            for row in csv.reader(f):
                if len(row) >= 2 and row[0] != "ImageId" and row[1].split():
                    wnid_of[row[0]] = row[1].split()[0]
        if classes is None:
            ids = {os.path.splitext(os.path.basename(rel))[0] for rel in images}
            classes = class_index({w for i, w in wnid_of.items() if i in ids}, self.class_order, self.class_map,
                                  csv_path)
        class_to_idx = {name: i for i, name in enumerate(classes)}
        labels = []
        for rel in images:
            image_id = os.path.splitext(os.path.basename(rel))[0]
            wnid = wnid_of.get(image_id)
            if wnid is None:
                raise ConfigError(f"{os.path.join(val_dir, rel)} has no row in {csv_path}; expected one per val image")
            if wnid not in class_to_idx:
                raise ConfigError(f"{csv_path} labels {image_id} as {wnid}, which is not a class folder of "
                                  f"{base}/train")
            labels.append(class_to_idx[wnid])
        return images, labels, classes
