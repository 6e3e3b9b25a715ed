"""ADM's evaluation of a samples ``.npz`` against a reference batch, without TensorFlow (``tools/evaluate_samples.py``).

Inputs, in ADM's layout: the samples ``.npz`` holds ``arr_0``, uint8 [N, H, W, 3] (what ``tools/sample.py`` and DiT's
``sample_ddp.py`` write); the reference is one of ADM's reference batches (e.g. ``VIRTUAL_imagenet256_labeled.npz``:
``arr_0`` with 10,000 images, plus the whole training set's ``mu``/``sigma`` and ``mu_s``/``sigma_s``), any ``.npz``
with ``arr_0``, or a folder of real images (center-cropped ADM-style to the samples' size). ``arr_0`` is read in
batches, never whole (50,000 images of 256 px are 9.8 GB). Activations come from
:class:`~moh_vision.analysis.inception.InceptionActivations`, the numbers from
:func:`~moh_vision.analysis.generative_metrics.adm_metrics`."""
from __future__ import annotations

import json
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Union

import numpy as np
import torch

from moh_vision.errors import ConfigError
from .generative_metrics import FRECHET_INPUTS, adm_metrics, check_stored_statistics
from .inception import InceptionActivations
from .metrics import full_float32

log = logging.getLogger(__name__)

STATISTICS_KEYS = ("mu", "sigma", "mu_s", "sigma_s")
DEFINITIONS = {
    "fid": "Frechet distance of pool_3 (2048-d) Gaussians: samples vs the reference's mu/sigma (else its images')",
    "sfid": "Frechet distance of mixed_6/conv (first 7 channels, 17x17x7 = 2023-d) Gaussians: samples vs the "
            "reference's mu_s/sigma_s (else its images')",
    "inception_score": "exp(E KL(p(y|x) || p(y))) of the samples, mean over consecutive splits of 5,000",
    "precision": "share of samples inside the reference images' k=3 nearest-neighbour manifold (pool_3)",
    "recall": "share of reference images inside the samples' k=3 nearest-neighbour manifold (pool_3)",
}
ADM_METRICS = tuple(DEFINITIONS)  # the five numbers, in ADM's order


# -- Image sources: batches of uint8 NHWC images -----------------------------------------------------------------------
def check_images_shape(shape, dtype, what: str) -> None:
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or shape[0] == 0:
        raise ConfigError(f"{what} must be uint8 [N, H, W, 3] images (ADM's layout), got {dtype} {tuple(shape)}")


class ArrayImages:
    """Images already in memory."""

    def __init__(self, images: np.ndarray, what: str = "the samples"):
        check_images_shape(images.shape, images.dtype, what)
        self.images, self.shape = images, images.shape

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self.images), batch_size):
            yield self.images[start:start + batch_size]


class NpzImages:
    """``arr_0`` of an ``.npz``, read batch by batch from the archive."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        try:
            with zipfile.ZipFile(path) as archive:
                if "arr_0.npy" not in archive.namelist():
                    keys = [name[:-4] for name in archive.namelist() if name.endswith(".npy")]
                    raise ConfigError(f"{what} {path} has no arr_0 (it holds {', '.join(keys) or 'nothing'}); "
                                      f"expected uint8 [N, H, W, 3] images in arr_0 (ADM's layout)")
                with archive.open("arr_0.npy") as member:
                    self.shape, fortran, dtype = _npy_header(member, path)
        except zipfile.BadZipFile:
            raise ConfigError(f"{what} {path} is not an .npz archive") from None
        check_images_shape(self.shape, dtype, f"{what} {path}: arr_0")
        if fortran:
            raise ConfigError(f"{what} {path}: arr_0 is stored in Fortran order; save it with np.savez as C-ordered")

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        image_bytes = int(np.prod(self.shape[1:]))
        with zipfile.ZipFile(self.path) as archive, archive.open("arr_0.npy") as member:
            _npy_header(member, self.path)
            for start in range(0, self.shape[0], batch_size):
                count = min(batch_size, self.shape[0] - start)
                data = member.read(count * image_bytes)
                if len(data) != count * image_bytes:
                    raise ConfigError(f"{self.what} {self.path}: arr_0 ends after {start} of {self.shape[0]} images")
                yield np.frombuffer(bytearray(data), dtype=np.uint8).reshape(count, *self.shape[1:])  # writable


def _npy_header(member, path: Path):
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    raise ConfigError(f"{path}: arr_0 has .npy format version {version}; expected 1.0 or 2.0 (np.savez)")


class FolderImages:
    """Every image below a folder (recursively, sorted), center-cropped ADM-style to ``side``."""

    def __init__(self, root: Path, side: int):
        from moh_vision.data.imagefolder import IMG_EXTENSIONS
        self.files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS
                            and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not self.files:
            raise ConfigError(f"the reference folder {root} holds no images")
        self.side, self.shape = side, (len(self.files), side, side, 3)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        from moh_vision.data.imagefolder import load_image
        from moh_vision.data.latents import center_crop_arr
        for start in range(0, len(self.files), batch_size):
            yield np.stack([center_crop_arr(load_image(str(f), "RGB"), self.side)
                            for f in self.files[start:start + batch_size]])


# -- Reading the inputs ------------------------------------------------------------------------------------------------
@dataclass
class Reference:
    images: Any  # an image source (ArrayImages, NpzImages, FolderImages)
    statistics: Dict[str, np.ndarray] = field(default_factory=dict)  # mu, sigma, mu_s, sigma_s when stored


def read_samples(path: Union[str, Path], option: str = "samples") -> NpzImages:
    return NpzImages(_existing_file(path, option, ".npz with arr_0 (uint8 [N, H, W, 3])"), f"{option}=")


def read_reference(path: Union[str, Path], side: Optional[int], option: str = "ref") -> Reference:
    """An ADM reference batch (``arr_0`` and any stored statistics) or a folder of images cropped to ``side`` (None
    while the samples' side is not known: a check)."""
    where = Path(str(path)).expanduser()
    if where.is_dir():
        return Reference(FolderImages(where, side))
    where = _existing_file(path, option, "ADM reference batch .npz (arr_0, mu/sigma, mu_s/sigma_s) or a folder")
    images = NpzImages(where, f"{option}=")
    with np.load(where) as npz:
        stored = {key: npz[key] for key in STATISTICS_KEYS if key in npz.files}
    for key, value in stored.items():
        if not np.issubdtype(value.dtype, np.floating):
            raise ConfigError(f"{option}={where}: {key} is {value.dtype}; expected float statistics")
    check_stored_statistics(stored, f"{option}={where}")
    return Reference(images, stored)


def _existing_file(path: Union[str, Path], option: str, expected: str) -> Path:
    where = Path(str(path)).expanduser()
    if not where.is_file():
        raise ConfigError(f"{option}={path} {'is not a file' if where.exists() else 'does not exist'}; "
                          f"expected an {expected}")
    return where


# -- The evaluation ----------------------------------------------------------------------------------------------------
def check_evaluation_inputs(ref: Union[str, Path], weights: Union[str, Path], ref_option: str = "ref",
                            weights_option: str = "inception") -> None:
    """What an evaluation needs, checked before any image is sampled or evaluated: torch-fidelity, Inception weights
    that build its network (on the CPU), a readable reference whose stored statistics fit that network."""
    inception = InceptionActivations(weights, "cpu", option=weights_option)
    reference = read_reference(ref, side=None, option=ref_option)
    check_statistics_widths(reference.statistics, inception.widths())


@full_float32()
def reference_activations(reference: Reference, inception: InceptionActivations, batch_size: int = 64,
                          progress: bool = True) -> Dict[str, np.ndarray]:
    """The reference images' pool and spatial activations with its stored statistics: what :func:`evaluate_images`
    compares samples with (computed once and passed back in by who evaluates many times, as the FID in training)."""
    check_statistics_widths(reference.statistics, inception.widths())
    real = inception.of_batches(reference.images.batches(batch_size), reference.images.shape[0],
                                "Inception: reference", progress)
    return {"pool": real["pool"], "spatial": real["spatial"], **reference.statistics}


@full_float32()
def evaluate_images(samples, reference: Reference, inception: InceptionActivations, batch_size: int = 64,
                    progress: bool = True, real: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, Any]:
    """ADM's five numbers of the sample images against the reference, and where each reference statistic came from;
    ``real``: the reference's :func:`reference_activations`, when already computed."""
    check_statistics_widths(reference.statistics, inception.widths())
    fake = inception.of_batches(samples.batches(batch_size), samples.shape[0], "Inception: samples", progress)
    if real is None:
        real = reference_activations(reference, inception, batch_size, progress)
    metrics = adm_metrics(fake, real, device=inception.device)
    sources = {name: f"stored {mean}/{cov}" if mean in reference.statistics else "reference images"
               for name, (_, mean, cov) in FRECHET_INPUTS.items()}
    return {**metrics, "num_samples": int(samples.shape[0]), "num_reference": int(reference.images.shape[0]),
            "reference_statistics": sources}


def check_statistics_widths(statistics: Mapping[str, np.ndarray], widths: Mapping[str, int]) -> None:
    """Stored statistics fit this Inception's activations (checked before hours of Inception passes)."""
    for key, mean, _ in FRECHET_INPUTS.values():
        if mean in statistics and len(statistics[mean]) != widths[key]:
            raise ConfigError(f"the reference's {mean} is {len(statistics[mean])}-d but this Inception's {key} "
                              f"activations are {widths[key]}-d")


def auto_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but no CUDA device is available; use device=cpu or auto")
    return torch.device(name)


def evaluate_samples(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """``tools/evaluate_samples.py``: evaluate, print and write the JSON (``cfg.out``, else beside the samples)."""
    from moh_vision.checkpoints import atomic_write
    samples = read_samples(cfg["samples"])
    reference = read_reference(cfg["ref"], side=samples.shape[1])
    inception = InceptionActivations(cfg["inception"], auto_device(cfg["device"]))
    log.info("evaluating %d samples %s against %s (%d images%s) on %s", samples.shape[0], samples.shape[1:],
             cfg["ref"], reference.images.shape[0],
             f", stored {', '.join(reference.statistics)}" if reference.statistics else "", inception.device)
    found = evaluate_images(samples, reference, inception, int(cfg["batch_size"]), bool(cfg["progress"]))
    summary = {**found, "samples": str(cfg["samples"]), "reference": str(cfg["ref"]),
               "inception_weights": str(cfg["inception"]), "device": str(inception.device),
               "definitions": {k: v for k, v in DEFINITIONS.items() if k in found}}
    out = Path(str(cfg["out"])) if cfg.get("out") else samples.path.with_name(samples.path.stem + "_adm_metrics.json")
    text = json.dumps(summary, indent=2)
    atomic_write(out, lambda f: f.write(text.encode()))
    print(text)
    log.info("wrote %s", out)
    return summary
