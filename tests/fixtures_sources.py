"""Small copies of one class-folder tree in every layout the data sources read (made by the tests, in tmp_path):
tars of class folders, ILSVRC-style tars (a tar of per-class tars, a flat val tar with its labels file), folders of
per-class tars, webdataset shards, Hugging Face parquet files, and V2 / A / R / ReaL-named eval folders."""
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("class2", "class10", "eel")  # natural order: class2, class10, eel; plain sort: class10, class2, eel
NATURAL = ["class2", "class10", "eel"]


def png(seed: int, size=(40, 36)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def make_tree(root: Path, classes=CLASSES, n_train=3, n_val=2) -> Path:
    """root/{train,val}/<class>/<class>_<i>.png"""
    for split, n in (("train", n_train), ("val", n_val)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                (folder / f"{name}_{i}.png").write_bytes(png(1000 * (split == "val") + 100 * c + i))
    return root


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _images(tree: Path, split: str):
    """[(class, file name, bytes)] of a split, in a fixed order."""
    return [(c.name, f.name, f.read_bytes()) for c in sorted((tree / split).iterdir()) for f in sorted(c.iterdir())]


def tars_of_folders(tree: Path, out: Path) -> Path:
    """out/train.tar and out/val.tar holding <class>/<file>."""
    out.mkdir(parents=True)
    for split in ("train", "val"):
        with tarfile.open(out / f"{split}.tar", "w") as tf:
            for cls, name, data in _images(tree, split):
                _add(tf, f"{cls}/{name}", data)
    return out


def ilsvrc_tars(tree: Path, out: Path):
    """out/ILSVRC2012_img_train.tar (one <class>.tar inside per class), out/ILSVRC2012_img_val.tar (flat
    ILSVRC2012_val_<n>.JPEG files) and out/LOC_val_solution.csv; returns (out, {val file name: class})."""
    out.mkdir(parents=True)
    with tarfile.open(out / "ILSVRC2012_img_train.tar", "w") as outer:
        by_class = {}
        for cls, name, data in _images(tree, "train"):
            by_class.setdefault(cls, []).append((name, data))
        for cls, files in by_class.items():
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as inner:
                for name, data in files:
                    _add(inner, name, data)
            _add(outer, f"{cls}.tar", buf.getvalue())
    truth, rows = {}, ["ImageId,PredictionString"]
    with tarfile.open(out / "ILSVRC2012_img_val.tar", "w") as tf:
        for k, (cls, _, data) in enumerate(_images(tree, "val")):
            name = f"ILSVRC2012_val_{k + 1:08d}.JPEG"  # PNG bytes: PIL reads the content, not the extension
            _add(tf, name, data)
            truth[name] = cls
            rows.append(f"ILSVRC2012_val_{k + 1:08d},{cls} 1 2 3 4")
    (out / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    return out, truth


def folders_of_class_tars(tree: Path, out: Path) -> Path:
    """out/{train,val}/<class>.tar (timm's ReaderImageInTar layout: one tar per class)."""
    for split in ("train", "val"):
        (out / split).mkdir(parents=True)
        by_class = {}
        for cls, name, data in _images(tree, split):
            by_class.setdefault(cls, []).append((name, data))
        for cls, files in by_class.items():
            with tarfile.open(out / split / f"{cls}.tar", "w") as tf:
                for name, data in files:
                    _add(tf, name, data)
    return out


def wds_shards(tree: Path, out: Path, classes=NATURAL, shards=(2, 1)) -> Path:
    """timm/imagenet-1k-wds style: out/tiny-train-<n>.tar, out/tiny-validation-<n>.tar of <key>.png + <key>.cls
    (the class index in ``classes``), with an _info.json listing the shard lengths."""
    out.mkdir(parents=True)
    info = {"num_classes": len(classes), "splits": {}}
    for (split, name), count in zip((("train", "train"), ("val", "validation")), shards):
        files = _images(tree, split)
        names, lengths = [], []
        for s in range(count):
            part = files[s::count]
            shard = f"tiny-{name}-{s:04d}.tar"
            with tarfile.open(out / shard, "w") as tf:
                for cls, fname, data in part:
                    key = f"{cls}_{os.path.splitext(fname)[0]}"
                    _add(tf, f"{key}.png", data)
                    _add(tf, f"{key}.cls", str(classes.index(cls)).encode())
            names.append(shard)
            lengths.append(len(part))
        info["splits"][name] = {"name": name, "num_samples": sum(lengths), "filenames": names,
                                "shard_lengths": lengths}
    (out / "_info.json").write_text(json.dumps(info))
    return out


def hf_parquet(tree: Path, out: Path, classes=NATURAL) -> Path:
    """out/data/{train,validation}-00000-of-00001.parquet as ILSVRC/imagenet-1k ships them (image, label columns;
    label a ClassLabel with ``classes``' names), written with the datasets library."""
    import datasets
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(classes))})
    (out / "data").mkdir(parents=True)
    for split, name in (("train", "train"), ("val", "validation")):
        files = _images(tree, split)
        ds = datasets.Dataset.from_dict({"image": [{"bytes": data, "path": fname} for _, fname, data in files],
                                         "label": [classes.index(cls) for cls, _, _ in files]}, features=features)
        ds.to_parquet(str(out / "data" / f"{name}-00000-of-00001.parquet"))
    return out
