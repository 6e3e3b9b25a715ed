"""The image-folder file index (issue 53): kept between runs while the tree's folders keep their modification
times, scanned again when one changes, and built by rank 0 alone under torch.distributed."""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moh_vision.data import file_index, imagefolder
from moh_vision.data.imagefolder import ImageFolderData
from moh_vision.errors import ConfigError

SCAN_ONLY = dict(img_size=32, auto_augment=None, mixup=None, cutmix=None, re_prob=None, repeated_aug=1)
AN_HOUR_AGO = time.time_ns() - 3600 * 10**9


def empty_tree(root: Path, classes=("ant", "bee", "cow"), per_class=5) -> Path:
    """root/{train,val}/<class>/[sub/]<i>.jpg, empty files (the index reads names only), every folder's
    modification time an hour ago (a tree at rest)."""
    for split in ("train", "val"):
        for name in classes:
            for i in range(per_class):
                path = root / split / name / ("sub" if i % 2 else "") / f"{i}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
    age(root)
    return root


def age(root: Path) -> None:
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, ns=(AN_HOUR_AGO, AN_HOUR_AGO))


def index_of(data: ImageFolderData):
    return data.classes, [(s.root, s._paths.tolist(), s.targets.tolist()) for s in (data.train, data.val)]


def no_scan(*args, **kwargs):
    raise AssertionError("scanned the tree")


def test_the_index_is_kept_while_the_tree_is_unchanged_and_rescanned_when_it_changes(tmp_path, monkeypatch):
    root, cache = empty_tree(tmp_path / "tree"), tmp_path / "cache"
    scanned = ImageFolderData(str(root), index_cache=None, **SCAN_ONLY)
    first = ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY)
    assert len(list(cache.glob("*.npz"))) == 1 and index_of(first) == index_of(scanned)
    assert first.train.path(3) == str(root / "train" / "ant" / "sub" / "1.jpg")  # a folder's files, then its folders

    with monkeypatch.context() as patch:
        patch.setattr(imagefolder, "_images_under", no_scan)
        again = ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY)
    assert index_of(again) == index_of(first) and again.train.path(3) == first.train.path(3)
    assert isinstance(again.train._paths, np.ndarray) and again.num_classes == 3

    (root / "train" / "bee" / "sub" / "new.jpg").touch()  # a nested folder changes: the index is out of date
    grown = ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY)
    assert len(grown.train) == len(first.train) + 1
    assert str(root / "train" / "bee" / "sub" / "new.jpg") in [grown.train.path(i) for i in range(len(grown.train))]
    age(root)
    (root / "val" / "cow" / "4.jpg").unlink()
    assert len(ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY).val) == len(first.val) - 1


def test_a_tree_that_just_changed_is_not_kept(tmp_path):
    root, cache = empty_tree(tmp_path / "tree"), tmp_path / "cache"
    (root / "train" / "ant" / "late.jpg").touch()  # its folder's time is now: the next change could share it
    ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY)
    assert not list(cache.glob("*.npz"))


def test_a_damaged_index_is_scanned_again(tmp_path):
    root, cache = empty_tree(tmp_path / "tree"), tmp_path / "cache"
    ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY)
    (saved,) = cache.glob("*.npz")
    saved.write_bytes(saved.read_bytes()[:100])
    assert len(ImageFolderData(str(root), index_cache=str(cache), **SCAN_ONLY).train) == 15


def _rank_worker(rank: int, init_file: str, roots: list, out: str) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 1:  # only rank 0 reads the tree
            imagefolder._images_under = no_scan
        results = []
        for root in roots:
            try:
                data = ImageFolderData(root, index_cache=None, **SCAN_ONLY)
                results.append({"classes": data.classes, "train": [data.train.path(i) for i in range(len(data.train))]})
            except ConfigError as err:
                results.append({"error": str(err)})
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        tdist.destroy_process_group()


def test_rank_zero_alone_indexes_and_the_other_ranks_get_its_index_or_its_error(tmp_path):
    good, broken = empty_tree(tmp_path / "good"), empty_tree(tmp_path / "broken")
    for image in (broken / "val" / "bee").rglob("*.jpg"):
        image.unlink()
    roots = [str(good), str(broken)]
    torch.multiprocessing.start_processes(_rank_worker, args=(str(tmp_path / "init"), roots, str(tmp_path)), nprocs=2,
                                          start_method="fork")  # as tests/test_run_dir.py's ranks
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert rank0[0]["classes"] == ["ant", "bee", "cow"] and len(rank0[0]["train"]) == 15
    assert "class folder" in rank0[1]["error"] and "bee has no images" in rank0[1]["error"]


def test_the_cache_folder_follows_the_projects_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOH_VISION_CACHE_DIR", str(tmp_path / "c"))
    assert file_index.cache_folder("auto") == tmp_path / "c" / "file_index"
    assert file_index.cache_folder(None) is None and file_index.cache_folder("none") is None
    assert file_index.cache_folder(str(tmp_path / "x")) == tmp_path / "x"


def test_the_index_benchmark_times_scan_first_and_second_start(tmp_path):
    from helpers import load_benchmark

    out = tmp_path / "record.json"
    record = load_benchmark("bench_index").main(["classes=3", "train_per_class=4", "val_per_class=2", "rounds=1",
                                                 f"root={tmp_path}", f"out={out}"])
    assert json.loads(out.read_text()) == record and record["files"] == 18
    assert all(record[key]["median"] > 0 for key in ("scan_s", "first_s", "second_s"))
    assert not list(tmp_path.glob("index_tree_*"))  # the generated tree is removed
