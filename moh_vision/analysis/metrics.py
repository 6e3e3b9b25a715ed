"""Sample-quality metrics that need no download: a digits classifier trained here, its class accuracy on
class-conditional samples, and the Frechet distance in its feature space.

The classifier is trained once per setting and cached: ``<cache dir>/digits_classifier-<key>.pt`` (:func:`cache_dir`),
where ``<key>`` hashes everything that decides the weights (:data:`CLASSIFIER_SETTINGS`, the image size, the torch and
scikit-learn versions). Files are written atomically; an unreadable or mismatched cache file is retrained and replaced,
never an error. Deleting the directory is always safe."""
from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moh_vision.data import CACHE_ENV, cache_dir  # noqa: F401  (cache_dir: also this module's API)

log = logging.getLogger(__name__)

Tensor = torch.Tensor

# torch's per-backend fp32 precisions (torch >= 2.9; a value "none" defers to the backend's, then the global, one)
_FP32_PRECISIONS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn,
                    torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv, torch.backends.mkldnn.rnn)


@contextmanager
def full_float32() -> Iterator[None]:
    """No TF32 (nor bf16) inside, whatever the caller set: ``allow_tf32`` off for cuBLAS and cuDNN,
    ``torch.get_float32_matmul_precision() == "highest"`` and every per-backend precision ``"ieee"``; the caller's
    settings are restored afterwards. Metric numbers are computed in float32 whatever precision the sampling used
    (TF32 rounds matmul and convolution inputs to 10 mantissa bits on Ampere and later GPUs). The legacy flags are
    set too: torch refuses to run a matmul whose legacy and per-backend settings disagree."""
    matmul, cudnn = _legacy_precision()
    leaves = [owner.fp32_precision for owner in _FP32_PRECISIONS]
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    for owner in _FP32_PRECISIONS:
        owner.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn
        for owner, value in zip(_FP32_PRECISIONS, leaves):
            owner.fp32_precision = value


def _legacy_precision() -> Tuple[str, bool]:
    """The caller's ``get_float32_matmul_precision()`` and cuDNN ``allow_tf32``, also after a mix of legacy and
    per-backend settings that torch refuses to report as one value (e.g. ``set_float32_matmul_precision("high")``,
    then ``allow_tf32 = False``): then cuBLAS's flag and cuDNN's convolution precision."""
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        matmul = "high" if torch.backends.cuda.matmul.allow_tf32 else "highest"
    try:
        cudnn = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        cudnn = torch.backends.cudnn.conv.fp32_precision == "tf32"
    return matmul, cudnn


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """``|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2))`` between two Gaussians (the FID formula). ``S1 S2`` is similar
    to the symmetric ``S1^(1/2) S2 S1^(1/2)``, so the trace of its square root is the sum of the square roots of that
    matrix's eigenvalues: no complex round-off, no dependence on ``scipy.linalg.sqrtm``."""
    diff = mu1 - mu2
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * _trace_sqrt_product(sigma1, sigma2))


def _trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    w, v = np.linalg.eigh((sigma1 + sigma1.T) / 2)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = root1 @ sigma2 @ root1
    return float(np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0, None)).sum())


def feature_stats(features: Tensor) -> Tuple[np.ndarray, np.ndarray]:
    f = features.double().cpu().numpy()
    return f.mean(axis=0), np.cov(f, rowvar=False)


class DigitsClassifier(nn.Module):
    """A small CNN for the digits at the diffusion resolution; ``features`` is its 128-d penultimate layer. Inputs are
    images in [-1, 1] (the diffusion data range), 1 or 3 channels (3 are averaged)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, 10)

    def features(self, x: Tensor) -> Tensor:
        if x.shape[1] == 3:
            x = x.mean(dim=1, keepdim=True)
        return self.body(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


# What decides the classifier's weights besides the image size and library versions. Change the training below -> bump
# "version", so that cached classifiers of the old recipe are not reused.
CLASSIFIER_SETTINGS = {"version": 1, "arch": "conv32-64-128", "epochs": 20, "seed": 0, "batch_size": 128,
                       "lr": 2e-3, "weight_decay": 1e-4, "augment": True, "data": "sklearn digits, val 0.2, split 0"}
def classifier_key(img_size: int) -> str:
    """A short hash of everything that determines the trained classifier."""
    from importlib import metadata
    try:
        sklearn_version = metadata.version("scikit-learn")  # its __version__, without importing it (2.4 s)
    except metadata.PackageNotFoundError:  # pragma: no cover - the digits come from scikit-learn
        sklearn_version = None
    what = {**CLASSIFIER_SETTINGS, "img_size": int(img_size), "torch": str(torch.__version__),
            "sklearn": sklearn_version}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def classifier_cache_path(img_size: int) -> Path:
    return cache_dir() / f"digits_classifier-{classifier_key(img_size)}.pt"


def train_digits_classifier(img_size: int, epochs: int = CLASSIFIER_SETTINGS["epochs"],
                            seed: int = CLASSIFIER_SETTINGS["seed"], progress: bool = True
                            ) -> Tuple[DigitsClassifier, float]:
    """The classifier trained on the digits training split (augmented), and its val accuracy (%)."""
    from tqdm.auto import tqdm

    from moh_vision.data.digits import DigitsData
    data = DigitsData(img_size=img_size, in_chans=1, augment=True)
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DigitsClassifier()
        opt = torch.optim.AdamW(model.parameters(), lr=CLASSIFIER_SETTINGS["lr"],
                                weight_decay=CLASSIFIER_SETTINGS["weight_decay"])
        n = len(data.train)
        model.train()
        for _ in tqdm(range(epochs), desc="digits proxy classifier", unit="epoch", disable=not progress, leave=False):
            for idx in torch.randperm(n, generator=g).split(CLASSIFIER_SETTINGS["batch_size"]):
                batch = [data.train[int(i)] for i in idx]
                x = torch.stack([b[0] for b in batch])
                y = torch.tensor([b[1] for b in batch])
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    model.eval()
    x, y = real_digits(data.val)
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item() * 100
    return model, acc


def real_digits(dataset) -> Tuple[Tensor, Tensor]:
    items = [dataset[i] for i in range(len(dataset))]
    return torch.stack([b[0] for b in items]), torch.tensor([b[1] for b in items])


def _load_classifier(path: Path, img_size: int, key: Optional[str] = None) -> Optional[DigitsClassifier]:
    """The classifier in ``path`` if it is a readable one for ``img_size`` (and ``key``), else None."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("img_size") != img_size or key not in (None, state.get("key")):
            return None
        model = DigitsClassifier()
        model.load_state_dict(state["model"])
    except Exception as err:  # a truncated / corrupt / foreign file: retrain rather than crash
        log.warning("ignoring unreadable digits classifier %s (%s: %s); training a new one",
                    path, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None
    return model.eval()


def load_or_train_classifier(path: Optional[Path], img_size: int) -> DigitsClassifier:
    """The digits classifier for ``img_size``: the one saved at ``path`` (a run's copy, or one given to
    tools/sample.py), else the cached one (see the module docstring), else a freshly trained one that is cached.
    ``path``, when given and missing, receives a copy. All writes are atomic."""
    from moh_vision.checkpoints import atomic_save
    path = Path(path) if path is not None else None
    model = _load_classifier(path, img_size) if path is not None else None
    if model is not None:
        return model
    key = classifier_key(img_size)
    cached = classifier_cache_path(img_size)
    model = _load_classifier(cached, img_size, key)
    state = None
    if model is None:
        log.warning("training the digits proxy classifier for the sample metrics (once per image size and library "
                    "versions, a few minutes on a CPU; cached in %s for every later run)", cached)
        model, acc = train_digits_classifier(img_size)
        log.info("trained the digits classifier for sample metrics: %.1f%% val top-1 at %dx%d; cached in %s",
                 acc, img_size, img_size, cached)
        state = {"model": model.state_dict(), "img_size": img_size, "val_acc1": acc, "key": key,
                 "settings": {**CLASSIFIER_SETTINGS, "torch": str(torch.__version__)}}
        try:
            atomic_save(state, cached)
        except Exception as err:  # an unwritable cache costs time, not the run
            log.warning("could not cache the digits classifier in %s (%s); set %s to a writable folder",
                        cached, err, CACHE_ENV)
    if path is not None:
        if state is None:
            state = {"model": model.state_dict(), "img_size": img_size, "key": key}
        try:
            atomic_save(state, path)
        except Exception as err:
            log.warning("could not write the digits classifier copy %s (%s)", path, err)
    return model


@torch.no_grad()
@full_float32()
def digits_sample_metrics(classifier: DigitsClassifier, samples: Tensor, labels: Tensor,
                          reference: Optional[Tensor] = None) -> Dict[str, float]:
    """``sample/class_acc``: % of samples the classifier labels with their conditioning class; ``sample/fd_digits``:
    Frechet distance of classifier features, samples vs ``reference`` images."""
    classifier = classifier.eval()
    samples = samples.float().cpu().clamp(-1, 1)
    out = {"sample/class_acc": (classifier(samples).argmax(-1) == labels.cpu()).float().mean().item() * 100}
    if reference is not None:
        mu1, s1 = feature_stats(classifier.features(samples))
        mu2, s2 = feature_stats(classifier.features(reference.float().cpu()))
        out["sample/fd_digits"] = frechet_distance(mu1, s1, mu2, s2)
    return out
