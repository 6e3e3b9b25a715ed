"""Where the images of a split come from: class folders, tar files, a Hugging Face dataset on disk, webdataset shards.

Every source gives ``(classes, split)`` pairs the data modules of :mod:`moh_vision.data.imagefolder` turn into datasets:

* ``folder``: ``<split>/<class>/**/<image>`` (:func:`~moh_vision.data.imagefolder.scan_class_folders`).
* ``tar``: a tar file, a tar of tars (``ILSVRC2012_img_train.tar``: one tar per class inside) or a folder of tars,
  read in place (random access: each image is one ``pread`` at the offset its index records; tars must be
  uncompressed). Labels: a member's ``<key>.cls`` sidecar (webdataset shards), else its folder inside the tar, else the
  inner tar it is in, else (a folder of tars) its tar file's name. A flat tar (``ILSVRC2012_img_val.tar``) takes its
  labels from a labels file (:func:`read_val_labels`).
* ``hfds``: a Hugging Face dataset on disk, the parquet files of ``ILSVRC/imagenet-1k`` (``data/train-*.parquet``,
  ``data/validation-*.parquet``) or a ``save_to_disk`` folder, read with the ``datasets`` library; classes are the
  dataset's ``label`` names in its own order.
* ``wds``: webdataset shards (``timm/imagenet-1k-wds``: ``*-train-*.tar`` / ``*-validation-*.tar`` of ``<key>.jpg`` +
  ``<key>.cls``) streamed in order for training (:class:`ShardStream`); their validation shards are read map-style.

Class order (``class_order``): ``natural`` is timm's (``timm.utils.misc.natural_key``: ``2`` before ``10``), ``sorted``
the plain string sort (what runs used before ``class_order`` existed); ``class_map=<file>`` (one class name a line, the
line number its index) replaces both."""
from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ConfigError

SOURCES = ("auto", "folder", "tar", "hfds", "wds")
CLASS_ORDERS = ("natural", "sorted")
SEP = "\t"  # a tar member's reference in the file index: "<tar path>\t<offset>\t<size>\t<member name>"


# -- Class order -------------------------------------------------------------------------------------------------------
def natural_key(name: str) -> list:
    """timm's natural sort key (``timm.utils.misc.natural_key``): digit runs compare as numbers."""
    from timm.utils.misc import natural_key as timm_key
    return timm_key(name)


def order_classes(names: Sequence[str], class_order: str) -> List[str]:
    if class_order not in CLASS_ORDERS:
        raise ConfigError(f"data.class_order={class_order!r}; expected one of {', '.join(CLASS_ORDERS)}")
    return sorted(names, key=natural_key) if class_order == "natural" else sorted(names)


def read_class_map(path: str) -> List[str]:
    """The classes of a class-map file: one name a line (timm's ``.txt`` class maps), its line number its index."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise ConfigError(f"data.class_map={path} does not exist; expected a text file with one class name a line")
    with open(path, encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip()]
    if not names:
        raise ConfigError(f"data.class_map={path} is empty; expected one class name a line")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"data.class_map={path} names {twice[0]} more than once; expected each class once")
    return names


def class_index(found: Sequence[str], class_order: str, class_map, where: str) -> List[str]:
    """The class list (index -> name) for the class names ``found`` at ``where``: ``class_map``'s (a file, or the
    list itself), else ``found`` in ``class_order``. Names the map does not hold are a one-line error."""
    if not class_map:
        return order_classes(set(found), class_order)
    listed = isinstance(class_map, (list, tuple))
    classes = list(class_map) if listed else read_class_map(class_map)
    missing = sorted(set(found) - set(classes))
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        what = f"the {len(classes)} expected classes" if listed else f"data.class_map={class_map}"
        raise ConfigError(f"{where} has classes that {what} does not list ({shown}); expected "
                          f"{'only those' if listed else 'a class map with every class name of the data'}")
    return classes


# -- Finding the source ------------------------------------------------------------------------------------------------
HF_SPLITS = {"train": ("train",), "val": ("validation", "val", "valid")}


def hf_files(root: str, split: str) -> List[str]:
    """Parquet files of ``split`` under ``root`` (``ILSVRC/imagenet-1k``: ``data/<split>-*.parquet``)."""
    found: List[str] = []
    for name in HF_SPLITS[split]:
        for pattern in (f"{name}-*.parquet", f"{name}/*.parquet", f"{name}.parquet"):
            for base in (root, os.path.join(root, "data")):
                found += glob.glob(os.path.join(base, pattern))
        if found:
            break
    return sorted(found)


def _is_hf_saved(root: str) -> bool:
    return any(os.path.isfile(os.path.join(root, f)) for f in ("dataset_dict.json", "state.json"))


def _tars_in(folder: str) -> List[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".tar") and not f.startswith("."))


def _first_names(tar_path: str, count: int = 8) -> List[str]:
    with tarfile.open(tar_path, "r:") as tf:
        names = []
        for member in tf:
            if member.isfile():
                names.append(member.name)
            if len(names) >= count:
                break
    return names


def looks_like_wds(tar_path: str) -> bool:
    return any(name.endswith(".cls") for name in _first_names(tar_path))


def infer_source(root: str) -> str:
    """The source the form of ``root`` implies (``auto``); streaming (``wds``) is never inferred."""
    if os.path.isfile(root):
        return "tar"
    if not os.path.isdir(root):
        return "folder"  # the folder reader says what is missing
    if _is_hf_saved(root) or hf_files(root, "train") or hf_files(root, "val"):
        return "hfds"
    for split in ("train", "val", ""):
        folder = os.path.join(root, split) if split else root
        if os.path.isfile(folder + ".tar") or (split and _imagenet_tar(root, split)):
            return "tar"
        if os.path.isdir(folder) and _tars_in(folder):
            return "tar"
    return "folder"


def _imagenet_tar(root: str, split: str) -> Optional[str]:
    path = os.path.join(root, f"ILSVRC2012_img_{split}.tar")
    return path if os.path.isfile(path) else None


def split_path(root: str, split: str, source: str) -> Optional[str]:
    """Where ``split`` (train or val) of ``root`` is for ``source``: a folder, a tar file, or ``root`` itself when it
    holds the split's shards (``*-train-*.tar``); None: not there."""
    if source in ("tar", "wds"):
        for path in (os.path.join(root, split), os.path.join(root, split) + ".tar", _imagenet_tar(root, split)):
            if path and (os.path.isfile(path) or (os.path.isdir(path) and _tars_in(path))):
                return path
        return root if os.path.isdir(root) and wds_shards(root, split, named_only=True) else None
    folder = os.path.join(root, split)
    return folder if os.path.isdir(folder) else None


def split_tars(path: str, split: str) -> List[str]:
    """The tar files of ``split`` at ``path`` (from :func:`split_path`): the file, the split's shards, or every tar."""
    if os.path.isfile(path):
        return [path]
    return wds_shards(path, split, named_only=True) or [os.path.join(path, t) for t in _tars_in(path)]


def wds_shards(folder: str, split: str, named_only: bool = False) -> List[str]:
    """Shards of ``split`` in ``folder``: ``*-train-*.tar`` / ``*-validation-*.tar`` (timm's names), else (unless
    ``named_only``) all tars of a folder named after the split."""
    tars = _tars_in(folder)
    names = HF_SPLITS[split]
    mine = [t for t in tars if any(re.search(rf"(^|[-_.]){n}([-_.]|$)", t) for n in names)]
    if mine:
        return [os.path.join(folder, t) for t in mine]
    if not named_only and os.path.basename(os.path.normpath(folder)) in (split,) + names:
        return [os.path.join(folder, t) for t in tars]
    return []


# -- Tar files ---------------------------------------------------------------------------------------------------------
def _open_tar(path: str, fileobj=None) -> tarfile.TarFile:
    try:
        return tarfile.open(path if fileobj is None else None, "r:", fileobj=fileobj)
    except tarfile.ReadError as err:
        raise ConfigError(f"cannot read {path} as an uncompressed tar ({err}); expected a .tar file (compressed "
                          f"tars cannot be read in place: unpack them with gunzip first)") from None


def tar_members(path: str, extensions: Sequence[str], watch=None) -> List[Tuple[str, int, int, str, str]]:
    """``(member name, offset, size, inner tar stem, cls text)`` of every image in the tar at ``path`` and in the tars
    inside it; ``cls text`` is the ``<key>.cls`` sidecar's content ('' without one)."""
    if watch is not None:
        watch.note(path)
    found, cls_of = [], {}
    with _open_tar(path) as tf:
        for member in tf:
            if not member.isfile():
                continue
            lower = member.name.lower()
            if lower.endswith(".tar"):
                inner = _open_tar(f"{path}/{member.name}", tf.extractfile(member))
                stem = os.path.splitext(os.path.basename(member.name))[0]
                with inner:
                    for m in inner:
                        if m.isfile() and m.name.lower().endswith(tuple(extensions)):
                            found.append((f"{member.name}/{m.name}", member.offset_data + m.offset_data, m.size,
                                          stem, ""))
            elif lower.endswith(".cls"):
                cls_of[os.path.splitext(member.name)[0]] = tf.extractfile(member).read().decode().strip()
            elif lower.endswith(tuple(extensions)) and not os.path.basename(member.name).startswith("."):
                found.append((member.name, member.offset_data, member.size, "", ""))
    if cls_of:
        found = [(n, o, s, t, cls_of.get(os.path.splitext(n)[0], "")) for n, o, s, t, _ in found]
    return found


def scan_tars(path: str, split: str, extensions: Sequence[str], val_labels: Optional[str], class_order: str,
              class_map: Optional[str], watch=None) -> Tuple[List[str], str, List[str], List[int]]:
    """``(classes, folder, member references, labels)`` of ``split``'s tar (folder of tars, shards) at ``path``."""
    tars = split_tars(path, split)
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    if watch is not None and os.path.isdir(path):
        watch.note(path)
    refs, names = [], []
    flat = []
    for tar_path in tars:
        rel = os.path.relpath(tar_path, folder)
        one_of_many = os.path.isdir(path)
        for name, offset, size, inner, cls in tar_members(tar_path, extensions, watch):
            refs.append(SEP.join((rel, str(offset), str(size), name)))
            parent = os.path.basename(os.path.dirname(name.split("/", 1)[1] if inner else name))
            label = cls or parent or inner or (os.path.splitext(rel)[0] if one_of_many else "")
            names.append(label)
            if not label:
                flat.append(name)
    if not refs:
        raise ConfigError(f"{path} holds no images; expected a tar of images (or of tars of images), or a folder "
                          f"of such tars")
    if flat:
        labels_of = read_val_labels(val_labels, folder, path)
        missing = [n for n in flat if os.path.splitext(os.path.basename(n))[0] not in labels_of]
        if missing:
            raise ConfigError(f"{path}: {missing[0]} has no label in the val labels file; expected one per image")
        names = [n or labels_of[os.path.splitext(os.path.basename(r.split(SEP, 3)[3]))[0]]
                 for n, r in zip(names, refs)]
    if all(n.isdigit() for n in names) and not class_map:  # .cls sidecars: class indices already
        classes = [str(i) for i in range(max(int(n) for n in names) + 1)]
        labels = [int(n) for n in names]
    else:
        classes = class_index(names, class_order, class_map, path)
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[n] for n in names]
    return classes, folder, refs, labels


def read_member(folder: str, ref: str, fds: Dict[str, int]) -> bytes:
    """The bytes of the tar member ``ref`` (a file-index reference) under ``folder``; ``fds`` caches open files (per
    process: :func:`os.pread` has no shared file offset, so forked workers may share them)."""
    rel, offset, size, _ = ref.split(SEP, 3)
    path = os.path.join(folder, rel)
    fd = fds.get(path)
    if fd is None:
        fd = fds[path] = os.open(path, os.O_RDONLY)
    data = os.pread(fd, int(size), int(offset))
    if len(data) != int(size):
        raise OSError(f"short read ({len(data)} of {size} bytes)")
    return data


# -- Flat validation labels --------------------------------------------------------------------------------------------
VAL_LABEL_FILES = ("LOC_val_solution.csv", "ILSVRC2012_devkit_t12.tar.gz", "ILSVRC2012_devkit_t12")


def read_val_labels(path: Optional[str], *near: str) -> Dict[str, str]:
    """``{image id (file name without extension): class name}`` of a flat val split, from ``path`` or the first of
    :data:`VAL_LABEL_FILES` found in the folders ``near``: ``LOC_val_solution.csv`` (Kaggle: ``ImageId,
    PredictionString``, the first word the wnid), the ILSVRC2012 devkit (``.tar.gz`` or unpacked: its
    ``data/meta.mat`` and ``data/ILSVRC2012_validation_ground_truth.txt``), or a text file of ``<image id> <class>``
    lines."""
    if not path:
        searched = [os.path.dirname(p) if os.path.isfile(p) else p for p in near]
        path = next((os.path.join(d, f) for d in searched for f in VAL_LABEL_FILES
                     if os.path.exists(os.path.join(d, f))), None)
        if path is None:
            raise ConfigError(f"{near[-1]} holds images without class folders and no labels file was found in "
                              f"{', '.join(dict.fromkeys(searched))} ({', '.join(VAL_LABEL_FILES)}); give "
                              f"data.val_labels=<file>")
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise ConfigError(f"data.val_labels={path} does not exist; expected {', '.join(VAL_LABEL_FILES)} or a text "
                          f"file of '<image id> <class>' lines")
    if "devkit" in os.path.basename(path):
        return _devkit_labels(path)
    labels = {}
    with open(path, newline="") as f:
        for line in f:
            parts = line.strip().replace(",", " ", 1).split()
            if len(parts) >= 2 and parts[0] != "ImageId":
                labels[os.path.splitext(parts[0])[0]] = parts[1]
    return labels


def _devkit_labels(path: str) -> Dict[str, str]:
    """The ILSVRC2012 devkit's val labels (``ILSVRC2012_val_<n>`` -> wnid): ``data/meta.mat``'s leaf synsets map each
    ``ILSVRC2012_ID`` to its wnid, ``data/ILSVRC2012_validation_ground_truth.txt`` holds one ID per val image."""
    import tempfile

    import scipy.io
    with tempfile.TemporaryDirectory() as tmp:
        root = path
        if os.path.isfile(path):
            with tarfile.open(path) as tf:
                tf.extractall(tmp, filter="data")
            root = os.path.join(tmp, os.listdir(tmp)[0])
        try:
            synsets = scipy.io.loadmat(os.path.join(root, "data", "meta.mat"), squeeze_me=True)["synsets"]
            with open(os.path.join(root, "data", "ILSVRC2012_validation_ground_truth.txt")) as f:
                ids = [int(line) for line in f if line.strip()]
        except (OSError, KeyError, ValueError) as err:
            raise ConfigError(f"cannot read the ILSVRC2012 devkit {path} ({err}); expected data/meta.mat and "
                              f"data/ILSVRC2012_validation_ground_truth.txt inside it") from None
    wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
    return {f"ILSVRC2012_val_{i + 1:08d}": wnid_of[n] for i, n in enumerate(ids)}


# -- Hugging Face datasets ---------------------------------------------------------------------------------------------
def load_hf_split(root: str, split: str):
    """The ``datasets.Dataset`` of ``split`` (train / val) under ``root``, its images left undecoded (None: absent)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source=hfds needs the datasets package (pip install datasets)") from None
    if _is_hf_saved(root):
        saved = datasets.load_from_disk(root)
        if isinstance(saved, datasets.DatasetDict):
            name = next((n for n in HF_SPLITS[split] if n in saved), None)
            ds = saved[name] if name else None
        else:
            ds = saved if split == "val" else None
    else:
        files = hf_files(root, split)
        ds = datasets.load_dataset("parquet", data_files={split: files}, split=split) if files else None
    if ds is None:
        return None
    for column in ("image", "label"):
        if column not in ds.column_names:
            raise ConfigError(f"the {split} split of the Hugging Face dataset {root} has no '{column}' column "
                              f"(it has {', '.join(ds.column_names)}); expected image and label columns")
    return ds.cast_column("image", datasets.Image(decode=False))


def hf_classes(ds) -> List[str]:
    feature = ds.features["label"]
    names = getattr(feature, "names", None)
    if names:
        return list(names)
    return [str(i) for i in range(int(max(ds["label"])) + 1)]


def hf_image_bytes(ds, index: int) -> Tuple[bytes, str]:
    """(encoded bytes, name) of image ``index`` of ``ds``."""
    image = ds[int(index)]["image"]
    if image.get("bytes"):
        return image["bytes"], image.get("path") or f"#{index}"
    with open(image["path"], "rb") as f:
        return f.read(), image["path"]


# -- Webdataset shards, streamed ---------------------------------------------------------------------------------------
def shard_lengths(shards: Sequence[str], extensions: Sequence[str]) -> List[int]:
    """Images per shard: ``_info.json``'s ``shard_lengths`` where it lists them (timm's wds datasets), else counted."""
    info_path = os.path.join(os.path.dirname(shards[0]), "_info.json")
    known: Dict[str, int] = {}
    if os.path.isfile(info_path):
        with open(info_path) as f:
            info = json.load(f)
        for split in (info.get("splits") or {}).values():
            known.update(zip(split.get("filenames", ()), split.get("shard_lengths", ())))
    return [known[os.path.basename(s)] if os.path.basename(s) in known else len(tar_members(s, extensions))
            for s in shards]


class ShardStream(IterableDataset):
    """The training images of webdataset shards, read in order (no random access), ``batch_size`` items at a time.

    Each epoch the shards are shuffled with ``(seed, epoch)``; rank ``r`` of ``world`` takes every world-th of them and
    each of its loader workers a share of those (wrapping round to the other shards when its own run out: give at least
    ranks x workers shards), item order going through a shuffle buffer of ``buffer`` items. Every rank yields exactly
    ``steps`` batches per epoch (``total // world // batch_size``), split over its workers. Each item's augmentation is
    seeded from ``(seed, epoch, rank, worker, position)``, so an epoch is the same with the same workers. A run resumed
    mid-epoch (``set_epoch(epoch, start)``) reads the epoch again from its start and skips the batches before item
    ``start`` without decoding them (the same images only with the same number of loader workers: resume is exact at
    epoch boundaries). Items are ``(image, label)`` or a ``BadImage``."""

    def __init__(self, shards: Sequence[str], lengths: Sequence[int], transform, decode: Callable,
                 batch_size: int = 1, seed: int = 0, rank: int = 0, world_size: int = 1, buffer: int = 256,
                 extensions: Sequence[str] = (".jpg", ".jpeg", ".png", ".webp")):
        self.shards, self.lengths = list(shards), list(lengths)
        self.transform, self.decode = transform, decode  # decode(name, bytes): an image, or a BadImage
        self.seed, self.rank, self.world, self.buffer = int(seed), int(rank), int(world_size), int(buffer)
        self.extensions = tuple(extensions)
        self.batch_size, self.repeats = int(batch_size), 1
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return sum(self.lengths)

    def configure(self, batch_size: int, seed: int, rank: int, world_size: int, repeats: int = 1) -> None:
        """The trainer's per-rank batch, seed, rank and ranks; ``repeats`` > 1: repeated augmentation (each image
        ``repeats`` times in the shuffle buffer, each copy augmented on its own; the epoch keeps its length)."""
        self.batch_size, self.seed, self.rank, self.world = int(batch_size), int(seed), int(rank), int(world_size)
        self.repeats = max(1, int(repeats))

    @property
    def steps(self) -> int:
        return len(self) // self.world // self.batch_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Epoch ``epoch`` from its item ``start`` on (a whole number of batches, as the trainer resumes)."""
        self.epoch, self.start = int(epoch), int(start) // self.batch_size

    def _raw(self, shard: str) -> Iterator[Tuple[str, bytes, int]]:
        """``(name, image bytes, label)`` of one shard in its order (a ``<key>.cls`` member gives the label)."""
        pending: Dict[str, list] = {}
        with _open_tar(shard) as tf:
            for member in tf:
                if not member.isfile():
                    continue
                key, ext = os.path.splitext(member.name)
                entry = pending.setdefault(key, [None, None])
                if ext.lower() == ".cls":
                    entry[1] = int(tf.extractfile(member).read().decode().strip())
                elif ext.lower() in self.extensions:
                    entry[0] = (member.name, tf.extractfile(member).read())
                else:
                    continue
                if entry[0] is not None and entry[1] is not None:
                    del pending[key]
                    yield entry[0][0], entry[0][1], entry[1]

    def _worker_items(self, worker: int, workers: int) -> Iterator[Tuple[str, bytes, int]]:
        """This worker's items of the epoch, endlessly: its share of the rank's shards, then the other shards."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(len(self.shards), generator=g).tolist()
        own = order[self.rank::self.world] or order
        share = own[worker::workers] or [own[worker % len(own)]]
        cycle = share + [s for s in order if s not in share]
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker])
        buffer: list = []
        while True:
            for shard in cycle:
                for item in self._raw(self.shards[shard]):
                    buffer += [item] * self.repeats
                    while len(buffer) >= self.buffer:
                        yield buffer.pop(int(rng.integers(len(buffer))))
            while buffer:
                yield buffer.pop(int(rng.integers(len(buffer))))

    def _decode(self, name: str, data: bytes, label: int, item_seed: int):
        img = self.decode(name, data)
        if not hasattr(img, "mode"):  # unreadable: the decoder's BadImage
            return img
        if self.transform is None:
            return img, label
        import random
        random.seed(item_seed)
        np.random.seed(item_seed)
        torch.default_generator.manual_seed(item_seed)
        return self.transform(img), label

    def __iter__(self) -> Iterator[list]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        items = self._worker_items(worker, workers)
        # the loader takes batch j of the rank from worker j % workers: this worker's are j = worker, worker + workers..
        mine = range(worker, self.steps, workers)
        for count, batch in enumerate(mine):
            chunk = [next(items) for _ in range(self.batch_size)]
            if batch < self.start:  # done before the resume: skipped undecoded
                continue
            first = count * self.batch_size
            yield [self._decode(name, data, label, _item_seed(self.seed, self.epoch, self.rank, worker, first + k))
                   for k, (name, data, label) in enumerate(chunk)]

    def __getitem__(self, key):
        """Item ``index`` of the first shards (``(epoch, index)`` keys as :class:`SeededItems` takes them): what the
        trainer's zero step reads when a rank's first batch was unreadable."""
        epoch, index = (key[0], key[1]) if isinstance(key, tuple) else (self.epoch, key)
        for position, (name, data, label) in enumerate(item for shard in self.shards for item in self._raw(shard)):
            if position == index:
                return self._decode(name, data, label, _item_seed(self.seed, epoch, self.rank, 0, position))
        raise IndexError(index)


def _item_seed(seed: int, epoch: int, rank: int, worker: int, position: int) -> int:
    return (seed * 1_000_003 + epoch * 9_973 + rank * 104_729 + worker * 15_485_863 + position * 7) % (2**31 - 1)
