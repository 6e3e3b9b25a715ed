"""The file index of an image-folder tree (classes, image paths, labels), built once and shared: walking ImageNet's
1.28M files takes every process minutes on a network file system.

* :func:`cached_index`: the index is kept in a cache folder (``data.index_cache``: ``auto`` is ``file_index`` in
  :func:`~moh_vision.analysis.metrics.cache_dir`), keyed by the tree's path and valid while every folder the scan read
  keeps its modification time (adding, removing or renaming an image changes its folder's; rewriting one changes nothing
  the index holds). Each folder's time is read before it is listed, and an index whose folders changed less than
  :data:`SETTLE_S` seconds before the scan is not kept (a coarse file system would not show a change within the same
  tick).
* :func:`built_once`: under ``torch.distributed`` rank 0 alone builds (or loads) it and sends it to the other ranks; a
  bad tree is the same one-line error on every rank."""
from __future__ import annotations

import hashlib
import logging
import os
import time
import zipfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import numpy as np

from ..errors import ConfigError, RunError

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a scan finds changes
SETTLE_S = 2.0
Split = Tuple[str, np.ndarray, np.ndarray]  # (folder, image paths relative to it as bytes, labels)
Index = Tuple[List[str], Split, Split]  # (classes, train split, val split)
T = TypeVar("T")


class TreeWatch:
    """The folders and files a scan read, with the modification time each had just before it was read."""

    def __init__(self, mtimes: Optional[Dict[str, int]] = None):
        self.mtimes: Dict[str, int] = dict(mtimes or {})

    def note(self, path: str) -> None:
        self.mtimes.setdefault(os.path.abspath(path), os.stat(path).st_mtime_ns)

    def unchanged(self) -> bool:
        try:
            return all(os.stat(path).st_mtime_ns == mtime for path, mtime in self.mtimes.items())
        except OSError:  # gone, or no longer readable
            return False

    def settled(self, now_ns: int) -> bool:
        return all(now_ns - mtime >= SETTLE_S * 1e9 for mtime in self.mtimes.values())


def as_split(folder: str, paths: List[str], labels: List[int]) -> Split:
    return folder, np.array([os.fsencode(p) for p in paths], dtype=bytes), np.asarray(labels, dtype=np.int64)


def cache_folder(index_cache: Optional[str]) -> Optional[Path]:
    """Where indexes are kept for ``data.index_cache`` (``auto``, a folder, or null / ``none``: nowhere)."""
    if index_cache is None or str(index_cache).strip().lower() in ("", "none", "null"):
        return None
    if str(index_cache) != "auto":
        return Path(index_cache).expanduser()
    from moh_vision.data import cache_dir  # the project's one cache folder (the digits classifier's too)
    return cache_dir() / "file_index"


def index_file(folder: Path, root: str, key: str) -> Path:
    """``<folder>/<hash>.npz`` for the tree at ``root`` scanned as ``key`` says (the data class and what it reads)."""
    digest = hashlib.sha256(f"{FORMAT}|{key}|{os.path.realpath(root)}".encode()).hexdigest()[:20]
    return folder / f"{digest}.npz"


def _load(path: Path) -> Optional[Index]:
    """The index in ``path`` if its tree is unchanged, else None."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        watch = TreeWatch(dict(zip((os.fsdecode(p) for p in arrays["watched"]), arrays["watched_mtimes"].tolist())))
        splits = [(str(arrays[f"{s}_folder"]), arrays[f"{s}_paths"], arrays[f"{s}_labels"]) for s in ("train", "val")]
        classes = [str(c) for c in arrays["classes"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:  # damaged: build it again
        log.warning("ignoring the unreadable file index %s (%s)", path, err)
        return None
    if not watch.unchanged():
        log.info("the file index %s is out of date (a folder changed): scanning again", path)
        return None
    return classes, splits[0], splits[1]


def _save(path: Path, index: Index, watch: TreeWatch) -> None:
    from moh_vision.checkpoints import atomic_write
    classes, train, val = index
    arrays = {"classes": np.array(classes, dtype=str),
              "watched": np.array([os.fsencode(p) for p in watch.mtimes]),
              "watched_mtimes": np.array(list(watch.mtimes.values()), dtype=np.int64)}
    for name, (folder, paths, labels) in (("train", train), ("val", val)):
        arrays.update({f"{name}_folder": np.array(folder), f"{name}_paths": paths, f"{name}_labels": labels})
    try:
        atomic_write(path, lambda f: np.savez(f, **arrays), what="file index")
    except RunError as err:  # a cache: the run goes on without it
        log.warning("%s; the tree will be scanned again next time", err)


def cached_index(scan: Callable[[TreeWatch], Index], root: str, key: str, cache: Optional[Path]) -> Index:
    """``scan(watch)``'s index of the tree at ``root``: ``cache``'s if current, else scanned and kept once settled."""
    path = index_file(cache, root, key) if cache is not None else None
    found = _load(path) if path is not None else None
    if found is not None:
        return found
    watch, started = TreeWatch(), time.time_ns()
    index = scan(watch)
    if path is not None and watch.settled(started):
        _save(path, index, watch)
    elif path is not None:
        log.info("not keeping the file index of %s: a folder changed in the last %g s", root, SETTLE_S)
    return index


def built_once(build: Callable[[], T]) -> T:
    """``build()`` on rank 0 alone under ``torch.distributed`` (in one process: here), its result sent to the other
    ranks; a :class:`ConfigError` is raised on every rank with rank 0's message."""
    import torch.distributed as tdist
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return build()
    payload: List[Optional[Tuple[str, object]]] = [None]
    if tdist.get_rank() == 0:
        try:
            payload[0] = ("ok", build())
        except ConfigError as err:
            payload[0] = ("error", str(err))
        except BaseException as err:  # the other ranks must not wait for an index that never comes
            payload[0] = ("crash", f"{type(err).__name__}: {err}")
            tdist.broadcast_object_list(payload, src=0)
            raise
    tdist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise ConfigError(str(value))
    if status == "crash":
        raise RunError(f"rank 0 failed building the file index ({value})")
    return value
