"""Sample-quality metrics that need no download: a digits classifier trained here, its class
accuracy on class-conditional samples, and the Frechet distance in its feature space."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

Tensor = torch.Tensor


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """``|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2))`` between two Gaussians (the FID formula)."""
    from scipy import linalg

    diff = mu1 - mu2
    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2), disp=False)
    if not np.isfinite(covmean).all():  # near-singular product: regularise, as the reference FID code does
        offset = np.eye(sigma1.shape[0]) * 1e-6
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def feature_stats(features: Tensor) -> Tuple[np.ndarray, np.ndarray]:
    f = features.double().cpu().numpy()
    return f.mean(axis=0), np.cov(f, rowvar=False)


class DigitsClassifier(nn.Module):
    """A small CNN for the digits at the diffusion resolution; ``features`` is its 128-d penultimate layer.

    Inputs are images in [-1, 1] (the diffusion data range), 1 or 3 channels (3 are averaged).
    """

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


def train_digits_classifier(img_size: int, epochs: int = 20, seed: int = 0) -> Tuple[DigitsClassifier, float]:
    """Train the classifier on the digits training split (augmented); returns it and its val accuracy (%)."""
    from moh_vision.data.digits import DigitsData

    data = DigitsData(img_size=img_size, in_chans=1, augment=True)
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DigitsClassifier()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
        n = len(data.train)
        model.train()
        for _ in range(epochs):
            for idx in torch.randperm(n, generator=g).split(128):
                batch = [data.train[int(i)] for i in idx]
                x = torch.stack([b[0] for b in batch])
                y = torch.tensor([b[1] for b in batch])
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    model.eval()
    x, y = real_digits(data.val)
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item() * 100
    return model, acc


def real_digits(dataset) -> Tuple[Tensor, Tensor]:
    items = [dataset[i] for i in range(len(dataset))]
    return torch.stack([b[0] for b in items]), torch.tensor([b[1] for b in items])


def load_or_train_classifier(path: Path, img_size: int) -> DigitsClassifier:
    """The classifier saved at ``path`` for this size, or a freshly trained one saved there (atomically)."""
    from moh_vision.engine.checkpoint import atomic_save

    path = Path(path)
    if path.exists():
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("img_size") == img_size:
            model = DigitsClassifier()
            model.load_state_dict(state["model"])
            return model.eval()
    model, acc = train_digits_classifier(img_size)
    log.info("trained the digits classifier for sample metrics: %.1f%% val top-1 at %dx%d", acc, img_size, img_size)
    atomic_save({"model": model.state_dict(), "img_size": img_size, "val_acc1": acc}, path)
    return model


@torch.no_grad()
def digits_sample_metrics(classifier: DigitsClassifier, samples: Tensor, labels: Tensor,
                          reference: Optional[Tensor] = None) -> Dict[str, float]:
    """``sample/class_acc``: % of samples the classifier labels with their conditioning class;
    ``sample/fd_digits``: Frechet distance of classifier features, samples vs ``reference`` images."""
    classifier = classifier.eval()
    samples = samples.float().cpu().clamp(-1, 1)
    out = {"sample/class_acc": (classifier(samples).argmax(-1) == labels.cpu()).float().mean().item() * 100}
    if reference is not None:
        mu1, s1 = feature_stats(classifier.features(samples))
        mu2, s2 = feature_stats(classifier.features(reference.float().cpu()))
        out["sample/fd_digits"] = frechet_distance(mu1, s1, mu2, s2)
    return out
