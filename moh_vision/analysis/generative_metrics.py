"""FID, Inception Score and precision/recall of generated images, with torch-fidelity and LOCAL
Inception weights (never downloaded).

The weights are torch-fidelity's port of the TF-slim Inception used by the original FID code,
``weights-inception-2015-12-05-6726825d.pth`` (the URL is ``URL_INCEPTION_V3`` in
``torch_fidelity.feature_extractor_inceptionv3``): fetch it once on a machine with network access and
pass its path. Its FID agrees closely with the TF implementations, but numbers for papers come from
ADM's evaluation suite run on the ``.npz`` that ``tools/sample.py`` writes (DiT's protocol), so
report those when comparing with published values.

The offline digits proxies (class accuracy, Frechet distance of a digits classifier's features)
live in :mod:`moh_vision.analysis.metrics`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from moh_vision.errors import ConfigError

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
_PROBE_KEY = "Conv2d_1a_3x3.conv.weight"  # a key every torch-fidelity InceptionV3 state dict has


def check_inception_weights(path: Union[str, os.PathLike, None]) -> Path:
    """The path of a readable torch-fidelity InceptionV3 state dict, or a one-line ConfigError."""
    hint = (f"inception_weights= must name a local copy of torch-fidelity's {INCEPTION_FILE} "
            f"(nothing is downloaded)")
    if not path:
        raise ConfigError(f"FID / IS / precision-recall need Inception weights; {hint}")
    path = Path(str(path)).expanduser()
    if not path.is_file():
        raise ConfigError(f"inception_weights={path} does not exist; {hint}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"inception_weights={path} is not a readable state dict ({type(err).__name__}); {hint}")
    if not isinstance(state, dict) or _PROBE_KEY not in state:
        raise ConfigError(f"inception_weights={path} is not a torch-fidelity InceptionV3 state dict; {hint}")
    return path


class UInt8Images(Dataset):
    """uint8 NHWC images (an array or an ``.npz``'s ``arr_0``) as the uint8 CHW tensors torch-fidelity reads."""

    def __init__(self, images: np.ndarray):
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
            raise ConfigError(f"expected uint8 NHWC images with 1 or 3 channels, got {images.dtype} {images.shape}")
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(self.images[i])).permute(2, 0, 1)
        return x.expand(3, -1, -1).contiguous() if x.shape[0] == 1 else x


class FolderImages(Dataset):
    """Every image below a folder (recursively, sorted), center-cropped ADM-style to ``image_size``."""

    def __init__(self, root: Path, image_size: int):
        from moh_vision.data.imagefolder import IMG_EXTENSIONS

        self.files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS
                            and not any(part.startswith(".") for part in p.relative_to(root).parts))
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        from moh_vision.data.imagefolder import load_image
        from moh_vision.data.latents import center_crop_arr

        arr = center_crop_arr(load_image(str(self.files[i]), "RGB"), self.image_size)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)


def reference_images(reference: Union[str, os.PathLike, np.ndarray], image_size: int) -> Dataset:
    """Real images to compare with: a folder of images (cropped to ``image_size``), an ``.npz`` with
    ``arr_0`` (uint8 NHWC, e.g. ADM's reference batches), or a uint8 NHWC array."""
    if isinstance(reference, np.ndarray):
        return UInt8Images(reference)
    path = Path(str(reference)).expanduser()
    if path.is_dir():
        data = FolderImages(path, image_size)
        if not len(data):
            raise ConfigError(f"fid_ref={path} holds no images")
        return data
    if path.is_file() and path.suffix == ".npz":
        with np.load(path) as npz:
            if "arr_0" not in npz:
                raise ConfigError(f"fid_ref={path} has no arr_0 (expected uint8 NHWC images, the ADM format)")
            return UInt8Images(npz["arr_0"])
    raise ConfigError(f"fid_ref={path} {'does not exist' if not path.exists() else 'is neither a folder nor an .npz'}; "
                      f"expected a folder of real images or an .npz with arr_0 (uint8 NHWC)")


def generative_metrics(samples: np.ndarray, reference: Union[str, os.PathLike, np.ndarray, Dataset, None],
                       inception_weights: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
                       batch_size: int = 64, fid: bool = True, isc: bool = True, prc: bool = True,
                       feature_layer: str = "2048") -> Dict[str, float]:
    """FID (samples vs reference), Inception Score (samples) and precision/recall (samples vs reference,
    k = 3 nearest neighbours) of uint8 NHWC ``samples``.

    ``feature_layer`` is the Inception feature FID and precision/recall use: ``"2048"`` (pool3, the
    standard FID) or ``"768"``, ``"192"``, ``"64"`` (earlier layers; pytorch-fid's advice for fewer
    samples than dimensions). ``reference`` may be None for the Inception Score alone. Returns
    ``fid``, ``inception_score``, ``inception_score_std``, ``precision``, ``recall`` (those asked for).
    """
    import torch_fidelity

    if feature_layer not in ("64", "192", "768", "2048"):
        raise ConfigError(f"feature_layer={feature_layer} is not an Inception feature; use 2048, 768, 192 or 64")
    weights = check_inception_weights(inception_weights)
    fake = UInt8Images(samples)
    real = None  # the Inception Score alone needs no reference
    if fid or prc:
        if reference is None:
            raise ConfigError("FID and precision/recall need reference images (fid_ref=<folder or .npz>)")
        real = reference if isinstance(reference, Dataset) else reference_images(reference, samples.shape[1])
    smallest = min(len(fake), len(real) if real is not None else len(fake))
    if smallest < 2 or (prc and smallest < 4):
        raise ConfigError(f"need at least {4 if prc else 2} samples and reference images "
                          f"(got {len(fake)} and {len(real) if real is not None else 0})")
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    out = torch_fidelity.calculate_metrics(
        input1=fake, input2=real, fid=fid, isc=isc, prc=prc, cuda=device.type == "cuda", batch_size=batch_size,
        feature_extractor="inception-v3-compat", feature_extractor_weights_path=str(weights),
        feature_layer_fid=feature_layer, feature_layer_prc=feature_layer,
        isc_splits=min(10, len(fake)), cache=False, datasets_download=False, verbose=False, save_cpu_ram=True)
    names = {"frechet_inception_distance": "fid", "inception_score_mean": "inception_score",
             "inception_score_std": "inception_score_std", "precision": "precision", "recall": "recall"}
    return {ours: float(out[theirs]) for theirs, ours in names.items() if theirs in out}
