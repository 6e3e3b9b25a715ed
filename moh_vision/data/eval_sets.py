"""The evaluation sets papers report next to ImageNet-1K top-1: ``eval.py ... eval.sets=[in1k,real,v2,a,r]``.

* ``in1k``: ImageNet-1K val (``eval.roots.in1k``, else the data's val split), labels as the data reads them.
* ``real``: the same val images scored against the ReaL label sets that ship inside timm
  (``timm/data/_info/imagenet_real_labels.json``, one list per ``ILSVRC2012_val_<n>.JPEG``): a top-k prediction counts
  when one of its k classes is in the image's set; images whose set is empty are left out (as timm's
  ``RealLabelsImagenet`` does), and so are images not named ``ILSVRC2012_val_<n>``.
* ``v2``: ImageNet-V2 (``eval.roots.v2``): class folders ``0`` ... ``999``, each named by its class index (read as
  numbers: folder ``10`` is class 10, not the one after ``1``).
* ``a`` / ``r``: ImageNet-A / ImageNet-R (``eval.roots.a`` / ``eval.roots.r``): 200 wnid folders; the logits are
  restricted to the 200 classes of timm's index files (``imagenet_a_indices.txt`` / ``imagenet_r_indices.txt``) before
  top-k, as the papers score them.

Every set gives ``(image, target)`` items for a 1000-class model; :class:`SetScore` turns logits into top-1/top-5."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset

from ..errors import ConfigError

SETS = ("in1k", "real", "v2", "a", "r")
WNID = re.compile(r"^n\d{8}$")
REAL_NAME = re.compile(r"^ILSVRC2012_val_(\d{8})\.", re.IGNORECASE)


def timm_info_file(name: str) -> str:
    """A file of timm's ``timm/data/_info`` folder (the ImageNet synsets, the A/R indices, the ReaL labels)."""
    import timm.data
    path = os.path.join(os.path.dirname(timm.data.__file__), "_info", name)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is missing from the installed timm; expected timm's shipped {name}")
    return path


def _lines(path: str) -> List[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def imagenet_synsets() -> List[str]:
    """The 1000 ImageNet-1K wnids in class-index order (timm's ``imagenet_synsets.txt``)."""
    return _lines(timm_info_file("imagenet_synsets.txt"))


def subset_indices(name: str) -> List[int]:
    """The 1000-class indices of ImageNet-A (``a``) or ImageNet-R (``r``)."""
    return [int(i) for i in _lines(timm_info_file(f"imagenet_{name}_indices.txt"))]


def check_classes(classes: Sequence[str], num_outputs: int, where: str) -> None:
    """Data classes a ``num_outputs``-class model can be scored on, or a one-line error: the same number, and wnid
    classes of a 1000-class model in the ImageNet order."""
    if len(classes) != num_outputs:
        raise ConfigError(f"{where} has {len(classes)} classes and the model {num_outputs} outputs; expected the "
                          f"model's classes (give data.class_map=<file> with its class names, one a line)")
    if num_outputs == 1000 and all(WNID.match(c) for c in classes):
        synsets = imagenet_synsets()
        if list(classes) != synsets:
            first = next(i for i, (a, b) in enumerate(zip(classes, synsets)) if a != b) \
                if set(classes) == set(synsets) else None
            what = f"class {first} is {classes[first]}, the model's {synsets[first]}" if first is not None else \
                f"{len(set(classes) - set(synsets))} of them are not ImageNet-1K wnids"
            raise ConfigError(f"the classes of {where} do not match the ImageNet-1K model's ({what}); expected the "
                              f"1000 wnids in their order (data.class_order=natural, or data.class_map=<file>)")


class Targets(Dataset):
    """``dataset``'s images ``keep`` with ``targets[j]`` as the label of item ``j`` (unreadable images pass through)."""

    def __init__(self, dataset, keep: Sequence[int], targets: Sequence[int]):
        self.dataset, self.keep, self.targets = dataset, list(keep), list(targets)

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, j: int):
        item = self.dataset[self.keep[j]]
        return item if not isinstance(item, tuple) else (item[0], int(self.targets[j]))


@dataclass
class EvalSet:
    """One set: its items, where they came from, and how its logits are scored."""
    name: str
    root: str
    dataset: Dataset
    restrict: Optional[List[int]] = None  # 1000-class indices the logits are restricted to (A, R)
    label_sets: Optional[List[List[int]]] = None  # ReaL: item j's target is j, scored against label_sets[j]
    left_out: int = 0

    def score(self) -> "SetScore":
        return SetScore(self.restrict, self.label_sets)


class SetScore:
    """Top-1 / top-5 hits of one set, summed batch by batch (``add``) and turned into percentages (``result``)."""

    def __init__(self, restrict: Optional[List[int]] = None, label_sets: Optional[List[List[int]]] = None):
        self.restrict = torch.tensor(restrict) if restrict is not None else None
        self.label_sets = label_sets
        self.sums = {"acc1": 0.0, "acc5": 0.0, "count": 0.0}

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits, targets = logits.float().cpu(), targets.cpu()
        if self.restrict is not None:
            top = self.restrict[logits[:, self.restrict].topk(min(5, len(self.restrict)), dim=-1).indices]
        else:
            top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        if self.label_sets is not None:
            hits = torch.tensor([[int(p) in set(self.label_sets[int(t)]) for p in row] for row, t in zip(top, targets)])
        else:
            hits = top == targets[:, None]
        self.sums["acc1"] += float(hits[:, 0].sum())
        self.sums["acc5"] += float(hits.any(dim=-1).sum())
        self.sums["count"] += float(len(targets))

    @staticmethod
    def result(sums: Dict[str, float], name: str) -> Dict[str, float]:
        n = max(sums["count"], 1.0)
        return {f"{name}/acc1": 100.0 * sums["acc1"] / n, f"{name}/acc5": 100.0 * sums["acc5"] / n,
                f"{name}/count": sums["count"]}


def _folders(root: str, names: Sequence[str], transform, what: str):
    """The class-folder tree at ``root`` with ``names`` as its class index (each folder must be one of them)."""
    from .imagefolder import ImageFileDataset, scan_class_folders
    try:
        _, paths, labels = scan_class_folders(root, None, "sorted", list(names))
    except ConfigError as err:
        raise ConfigError(f"{str(err).split('; expected')[0]}; expected {what}") from None
    return ImageFileDataset(root, paths, labels, names, transform)


def _root(roots: Dict[str, str], name: str, what: str) -> str:
    root = roots.get(name)
    if not root:
        raise ConfigError(f"eval.sets has {name} but no eval.roots.{name}; give eval.roots.{name}=<{what}>")
    root = os.path.expanduser(str(root))
    if not os.path.isdir(root):
        raise ConfigError(f"eval.roots.{name}={root} {'is not a folder' if os.path.exists(root) else 'does not exist'}"
                          f"; expected {what}")
    return root


def imagenet_val(root: str, transform):
    """ImageNet-1K val at ``root`` (any layout or source ``data=imagenet`` reads), with ``transform``."""
    from .imagefolder import ImageNetData
    val = ImageNetData(root, img_size=32, auto_augment=None, mixup=None, cutmix=None, re_prob=None,
                       repeated_aug=1, class_order="natural", splits=("val",)).val
    val.transform = transform
    return val


def build_set(name: str, roots: Dict[str, str], val, transform) -> EvalSet:
    """Evaluation set ``name`` (:data:`SETS`) from ``roots`` (``eval.roots``), ``val`` (the data's val split, for
    in1k and real when no root is given) and ``transform`` (the eval transform)."""
    if name not in SETS:
        raise ConfigError(f"eval.sets has {name!r}; expected some of {', '.join(SETS)}")
    if name in ("in1k", "real"):
        if roots.get(name):
            dataset = imagenet_val(_root(roots, name, "ImageNet-1K val (class folders or flat)"), transform)
        elif val is not None:
            dataset = val
        else:
            raise ConfigError(f"eval.sets has {name} but there is no ImageNet val; give eval.roots.{name}=<dir>")
        where = getattr(dataset, "root", roots.get(name, ""))
        if name == "in1k":
            check_classes(dataset.classes, 1000, where)
            return EvalSet(name, where, dataset)
        with open(timm_info_file("imagenet_real_labels.json")) as f:
            real = json.load(f)
        keep, label_sets = [], []
        for index in range(len(dataset)):
            match = REAL_NAME.match(os.path.basename(dataset.path(index)))
            number = int(match.group(1)) if match else 0
            if 1 <= number <= len(real) and real[number - 1]:
                keep.append(index)
                label_sets.append(real[number - 1])
        if not keep:
            raise ConfigError(f"none of the images of {where} has ReaL labels; expected ImageNet val images named "
                              f"ILSVRC2012_val_<8 digits>.JPEG")
        return EvalSet(name, where, Targets(dataset, keep, range(len(keep))), label_sets=label_sets,
                       left_out=len(dataset) - len(keep))
    if name == "v2":
        root = _root(roots, name, "ImageNet-V2: class folders 0 ... 999")
        return EvalSet(name, root, _folders(root, [str(i) for i in range(1000)], transform,
                                            "ImageNet-V2: class folders 0 ... 999"))
    label = {"a": "ImageNet-A", "r": "ImageNet-R"}[name]
    root = _root(roots, name, f"{label}: its 200 wnid folders")
    dataset = _folders(root, imagenet_synsets(), transform, f"{label}: its 200 wnid folders")
    restrict = subset_indices(name)
    outside = sorted(set(int(t) for t in dataset.targets) - set(restrict))
    if outside:
        raise ConfigError(f"{root} has class folders outside {label}'s 200 classes (e.g. "
                          f"{imagenet_synsets()[outside[0]]}); expected {label}'s wnid folders")
    return EvalSet(name, root, dataset, restrict=restrict)
