"""Copies of a class-folder tree (``<root>/{train,val}/<class>/<image>``) in the other layouts the data sources read,
for the loader benchmark (``benchmarks/bench_data.py source=...``): tars of class folders (``tar``), webdataset shards
(``wds``: ``<key>.<ext>`` + ``<key>.cls`` members, an ``_info.json`` with the shard lengths) and Hugging Face parquet
files (``hfds``: ``data/{train,validation}-*.parquet`` with ``image`` and ``label`` columns)."""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import List, Tuple

from .sources import natural_key

PACKED = ("tar", "wds", "hfds")


def _files(root: Path, split: str) -> Tuple[List[str], List[Tuple[str, Path]]]:
    classes = sorted((p.name for p in (root / split).iterdir() if p.is_dir()), key=natural_key)
    return classes, [(c, f) for c in classes for f in sorted((root / split / c).rglob("*")) if f.is_file()]


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def pack_tree(root: Path, out: Path, layout: str, shards: int = 4) -> Path:
    """``root``'s tree written to ``out`` in ``layout`` (:data:`PACKED`); returns ``out``."""
    root, out = Path(root), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"splits": {}}
    for split, name in (("train", "train"), ("val", "validation")):
        classes, files = _files(root, split)
        if layout == "tar":
            with tarfile.open(out / f"{split}.tar", "w") as tf:
                for cls, path in files:
                    _add(tf, f"{cls}/{path.name}", path.read_bytes())
        elif layout == "wds":
            names, lengths = [], []
            for s in range(shards):
                part = files[s::shards]
                shard = f"packed-{name}-{s:04d}.tar"
                with tarfile.open(out / shard, "w") as tf:
                    for k, (cls, path) in enumerate(part):
                        key = f"{s:04d}_{k:06d}"
                        _add(tf, f"{key}{path.suffix.lower()}", path.read_bytes())
                        _add(tf, f"{key}.cls", str(classes.index(cls)).encode())
                names.append(shard)
                lengths.append(len(part))
            info["splits"][name] = {"name": name, "num_samples": sum(lengths), "filenames": names,
                                    "shard_lengths": lengths}
        elif layout == "hfds":
            import datasets
            features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
            ds = datasets.Dataset.from_dict({"image": [{"bytes": p.read_bytes(), "path": p.name} for _, p in files],
                                             "label": [classes.index(c) for c, _ in files]}, features=features)
            os.makedirs(out / "data", exist_ok=True)
            ds.to_parquet(str(out / "data" / f"{name}-00000-of-00001.parquet"))
        else:
            raise ValueError(f"layout={layout!r}; expected one of {', '.join(PACKED)}")
    if layout == "wds":
        (out / "_info.json").write_text(json.dumps(info))
    return out
