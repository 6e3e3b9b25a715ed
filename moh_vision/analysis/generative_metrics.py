"""The five numbers of ADM's evaluation suite (openai/guided-diffusion ``evaluations/evaluator.py``), computed from
Inception activations, with ADM's definitions:

* FID: the Frechet distance between Gaussians fitted to the samples' and the reference's pool_3 activations (2048-d),
  the reference's from its stored ``mu``/``sigma`` when it has them (ADM's reference batches hold the whole training
  set's), else from its own activations;
* sFID: the same on the spatial features (mixed_6/conv, first 7 channels, 17 x 17 x 7 = 2023-d), ``mu_s``/``sigma_s``;
* Inception Score: ``exp(E_x KL(p(y|x) || p(y)))`` of the samples' softmax, the mean over consecutive splits of 5,000;
* precision and recall: k-nearest-neighbour manifolds (k = 3) in pool_3 space. A point's ball has the radius of its k-th
  nearest neighbour within its own set; precision is the share of samples inside some reference ball, recall the share
  of reference images inside some sample ball.

Distances are squared Euclidean, as ADM compares them, in float32 throughout (ADM tries float16 first: a sample within
float16 round-off of a ball's edge may count otherwise), and never in TF32, whatever the caller set
(:func:`~moh_vision.analysis.metrics.full_float32`). :func:`adm_metrics` takes the activations as mappings of
arrays, so each number can be checked without Inception weights (:mod:`moh_vision.analysis.inception` computes them,
:mod:`moh_vision.analysis.adm_evaluation` runs the whole evaluation)."""
from __future__ import annotations

import logging
from typing import Dict, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from moh_vision.analysis.metrics import frechet_distance, full_float32
from moh_vision.errors import ConfigError

log = logging.getLogger(__name__)

Activations = Mapping[str, np.ndarray]
NEIGHBOURS = 3  # ADM's nhood_sizes=(3,)
IS_SPLIT_SIZE = 5000
ORDER_TOLERANCE = 0.1  # IS of ADM's consecutive splits vs of a shuffle: beyond 10% apart the order is to blame
# (activations key, reference mean key, reference covariance key) of each Frechet distance
FRECHET_INPUTS = {"fid": ("pool", "mu", "sigma"), "sfid": ("spatial", "mu_s", "sigma_s")}
DISTANCE_BLOCK = 1024  # rows of a pairwise distance block: 1024 x 50,000 float32 is 200 MB


@full_float32()
def adm_metrics(samples: Activations, reference: Activations, neighbours: int = NEIGHBOURS,
                split_size: int = IS_SPLIT_SIZE, device: Union[str, torch.device] = "cpu") -> Dict[str, float]:
    """``fid``, ``sfid``, ``inception_score``, ``precision`` and ``recall`` of the samples against the reference.

    ``samples`` holds ``pool`` [N, 2048], ``spatial`` [N, 2023] and ``probs`` [N, 1008] (the Inception classifier's
    softmax); ``reference`` holds ``pool`` and ``spatial`` of its images and may hold ``mu``, ``sigma``, ``mu_s``,
    ``sigma_s``. A number whose inputs are missing is left out; inconsistent inputs raise a one-line
    :class:`ConfigError`. Pairwise distances are computed on ``device`` in blocks."""
    check_stored_statistics(reference)
    out: Dict[str, float] = {}
    for name, (key, mean_key, cov_key) in FRECHET_INPUTS.items():
        theirs = reference_statistics(reference, key, mean_key, cov_key)
        if key in samples and theirs is not None:
            ours = statistics(_features(samples, key, "samples"))
            _check_same_width(ours[0], theirs[0], f"samples' {key}", f"reference's {key} statistics")
            out[name] = frechet_distance(*ours, *theirs)
    if "probs" in samples:
        out["inception_score"] = inception_score(samples["probs"], split_size)
        warn_if_ordered(samples["probs"], out["inception_score"], split_size)
    if "pool" in samples and "pool" in reference:
        ref, fake = _features(reference, "pool", "reference"), _features(samples, "pool", "samples")
        _check_same_width(fake[0], ref[0], "samples' pool", "reference's pool")
        out["precision"], out["recall"] = precision_recall(ref, fake, neighbours, device)
    return out


# -- Frechet distances -------------------------------------------------------------------------------------------------
def statistics(activations: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Mean and covariance (rows are observations) in float64."""
    if len(activations) < 2:
        raise ConfigError(f"a covariance needs at least 2 activations, got {len(activations)}")
    values = np.asarray(activations, dtype=np.float64)
    return values.mean(axis=0), np.cov(values, rowvar=False)


def check_stored_statistics(reference: Activations, owner: str = "the reference") -> None:
    """Stored statistics come in pairs, a [D] mean with its [D, D] covariance; a one-line error otherwise."""
    for _, mean, cov in FRECHET_INPUTS.values():
        if (mean in reference) != (cov in reference):
            held, missing = (mean, cov) if mean in reference else (cov, mean)
            raise ConfigError(f"{owner} holds {held} but not {missing}; expected both or neither")
        if mean in reference:
            mean_shape, cov_shape = np.shape(reference[mean]), np.shape(reference[cov])
            if len(mean_shape) != 1 or cov_shape != mean_shape * 2:
                raise ConfigError(f"{owner}: {mean} {mean_shape} and {cov} {cov_shape} are not a [D] mean and its "
                                  f"[D, D] covariance")


def reference_statistics(reference: Activations, key: str, mean_key: str, cov_key: str
                         ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """The stored ``mean_key``/``cov_key`` (ADM's precedence), else the ``key`` activations' statistics, else None."""
    if mean_key in reference:
        return np.asarray(reference[mean_key], dtype=np.float64), np.asarray(reference[cov_key], dtype=np.float64)
    if key in reference:
        return statistics(_features(reference, key, "reference"))
    return None


def _features(activations: Activations, key: str, owner: str) -> np.ndarray:
    values = np.asarray(activations[key])
    if values.ndim != 2 or not np.issubdtype(values.dtype, np.floating):
        raise ConfigError(f"the {owner}' {key} activations must be a float [N, D] array, got {values.dtype} "
                          f"{values.shape}")
    return values


def _check_same_width(ours: np.ndarray, theirs: np.ndarray, our_name: str, their_name: str) -> None:
    if ours.shape[-1] != theirs.shape[-1]:
        raise ConfigError(f"the {our_name} activations are {ours.shape[-1]}-d but the {their_name} are "
                          f"{theirs.shape[-1]}-d (different Inception layers or input sizes?)")


# -- Inception Score ---------------------------------------------------------------------------------------------------
def inception_score(probs: np.ndarray, split_size: int = IS_SPLIT_SIZE) -> float:
    """ADM's Inception Score: consecutive splits of ``split_size`` rows (the last one may be shorter), each
    ``exp(mean_i sum_y p_iy (log p_iy - log mean_j p_jy))``, averaged over the splits. A zero probability adds nothing
    (the limit of ``p log p``), where ADM's ``0 * log 0`` would give NaN."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or len(probs) == 0 or (probs < 0).any():
        raise ConfigError(f"probs must be non-negative softmax rows [N, classes], got shape {probs.shape}")
    scores = []
    for start in range(0, len(probs), split_size):
        part = probs[start:start + split_size]
        marginal = part.mean(axis=0, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(part > 0, part * (np.log(part) - np.log(marginal)), 0.0)
        scores.append(np.exp(terms.sum(axis=1).mean()))
    return float(np.mean(scores))


def warn_if_ordered(probs: np.ndarray, score: float, split_size: int = IS_SPLIT_SIZE, seed: int = 0) -> Optional[float]:
    """Warn, and return the shuffled score, when ``score`` (ADM's consecutive splits) and the Inception Score of the
    same rows in a fixed-seed shuffle are more than :data:`ORDER_TOLERANCE` apart: samples sorted by class give each
    split a few classes and a score several times too low (ADM's evaluator gives it too). One split: no order."""
    if len(probs) <= split_size:
        return None
    shuffled = inception_score(np.asarray(probs)[np.random.default_rng(seed).permutation(len(probs))], split_size)
    if abs(score - shuffled) <= ORDER_TOLERANCE * shuffled:
        return None
    log.warning("the Inception Score over ADM's consecutive splits of %d samples is %.4g but %.4g over the same samples "
                "shuffled: they are ordered (by class?), so each split sees a few classes; shuffle arr_0 before "
                "evaluating (tools/sample.py writes its samples shuffled)", split_size, score, shuffled)
    return shuffled


# -- Precision and recall: k-nearest-neighbour manifolds ---------------------------------------------------------------
@full_float32()
def precision_recall(reference: np.ndarray, samples: np.ndarray, neighbours: int = NEIGHBOURS,
                     device: Union[str, torch.device] = "cpu") -> Tuple[float, float]:
    """(share of samples inside the reference manifold, share of reference points inside the samples' manifold)."""
    smallest = min(len(reference), len(samples))
    if smallest <= neighbours:
        raise ConfigError(f"precision and recall with k={neighbours} neighbours need more than {neighbours} samples "
                          f"and reference images (got {len(samples)} and {len(reference)})")
    ref = torch.as_tensor(np.asarray(reference), dtype=torch.float32, device=device)
    fake = torch.as_tensor(np.asarray(samples), dtype=torch.float32, device=device)
    precision = manifold_coverage(fake, ref, manifold_radii(ref, neighbours))
    recall = manifold_coverage(ref, fake, manifold_radii(fake, neighbours))
    return precision, recall


def squared_distances(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``|r_i - c_j|^2`` for every pair, as ``|r|^2 - 2 r.c + |c|^2`` (clamped at 0, as ADM does)."""
    return (rows.square().sum(1, keepdim=True) - 2 * rows @ columns.T + columns.square().sum(1)).clamp_min(0)


def manifold_radii(features: torch.Tensor, neighbours: int) -> torch.Tensor:
    """Each point's squared distance to its ``neighbours``-th nearest point of the same set (itself, at distance 0, is
    the nearest: ADM takes index k of each sorted row)."""
    radii = [squared_distances(block, features).topk(neighbours + 1, dim=1, largest=False).values[:, -1]
             for block in features.split(DISTANCE_BLOCK)]
    return torch.cat(radii)


def manifold_coverage(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor) -> float:
    """The share of ``points`` within (``<=``) the radius of at least one centre."""
    inside = [(squared_distances(block, centres) <= radii).any(dim=1) for block in points.split(DISTANCE_BLOCK)]
    return float(torch.cat(inside).double().mean())
