"""Class-conditional samples from a trained DiT / MoH-DiT checkpoint, for grids and FID (``tools/sample.py``).

The model and task are rebuilt from the checkpoint's config (EMA weights by default); latents are decoded with the VAE
of ``task.vae.path`` (or ``vae=``). Seeds, labels and order follow DiT's ``sample_ddp.py``: rank ``r`` of ``W`` draws
everything from one stream seeded ``seed * W + r``, each batch's labels (``labels=random``: uniform, so class counts
vary as in the published FID-50K runs) then its noise; sample ``i`` of that rank's batch ``t`` is output sample
``t * B * W + i * W + r`` (``B``: the per-rank batch size); every rank samples the same number of full batches, a
multiple of ``B * W`` in all, and the first ``N`` are kept. So the samples of a seed depend on ``W`` and ``B``, as DiT's
do. ``labels=balanced`` (the default with ``per_class=``): every class ``N // C`` or one more times, in an order
shuffled with the seed, not sorted (ADM's Inception Score takes consecutive splits of 5,000: sorted, each would see a
few classes). Finished batches are kept, with the stream's state after them, in ``out/.parts-<hash>/`` until the end,
so a rerun with the same settings, ranks and ``out`` resumes where it stopped. Rank 0 writes ``samples.npz``
(``arr_0`` uint8 [N, H, W, 3], the input of ADM's evaluation suite), ``labels.npy``, ``samples.png`` (a labelled grid,
rows = classes) and ``sample.json`` (what was sampled and the metrics: the digits proxies for digits checkpoints, ADM's
five numbers with ``fid_ref`` and ``inception_weights``, computed in float32 whatever ``tf32`` sampled with). Every
input of a metric is checked before the first sample. :func:`sample` takes the options of ``tools/sample.py`` (a
mapping with attribute access)."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Mapping

import numpy as np
import torch

from moh_vision.checkpoints import atomic_write
from moh_vision.analysis.adm_evaluation import ADM_METRICS
from moh_vision.config import build_data, group_name
from moh_vision.diffusion.samplers import check_sampler
from moh_vision.errors import ConfigError
from moh_vision.engine.fit_setup import device_settings
from moh_vision.engine.distributed import cleanup, init_distributed
from moh_vision.engine.loggers import write_json
# the rank sharing lives in rank_sampling (the trainer uses it too); its names stay importable from here
from moh_vision.engine.rank_sampling import (  # noqa: F401
    LABEL_STREAM, balanced_labels, batches_per_rank, merge_parts, part_path, rank_seed, sample_images, sample_indices,
    sample_rank)
from .run import rebuild_run, shared_output_dir, weights_of

log = logging.getLogger(__name__)

DEFAULT_OUT = "outputs/sample/%Y-%m-%d/%H-%M-%S"  # strftime pattern; under torchrun rank 0's time decides
LABEL_MODES = ("random", "balanced")
OVERRIDABLE = ("steps", "sampler", "cfg_scale", "clip_denoised", "batch_size")


# -- What to sample ----------------------------------------------------------------------------------------------------
def label_mode(cfg: Mapping[str, Any]) -> str:
    """``labels=``, else balanced with ``per_class=`` and random (DiT's protocol) otherwise."""
    if cfg.per_class is not None:
        if cfg.labels == "random":
            raise ConfigError("per_class= asks for balanced classes, but labels=random: drop one of them (random "
                              "labels: give num_samples=)")
        return "balanced"
    mode = cfg.labels or "random"
    if mode not in LABEL_MODES:
        raise ConfigError(f"labels={mode}: use {' or '.join(LABEL_MODES)}")
    return mode


def sample_count(cfg: Mapping[str, Any], num_classes: int) -> int:
    if cfg.num_samples is not None and cfg.per_class is not None:
        raise ConfigError("give num_samples= or per_class=, not both")
    n = int(cfg.num_samples) if cfg.num_samples is not None else int(cfg.per_class or 8) * num_classes
    if n < 1:
        raise ConfigError(f"num_samples={n}: nothing to sample")
    return n


# -- Rebuilding the model from a training checkpoint -------------------------------------------------------------------
def shape_from_weights(weights: Dict[str, torch.Tensor], class_dropout_prob: float) -> SimpleNamespace:
    """Data shape of a DiT from its (official-layout) state dict, for when the data are not at hand."""
    try:
        proj = weights["x_embedder.proj.weight"]  # [hidden, in_channels, p, p]
        tokens = weights["pos_embed"].shape[1]
        rows = weights["y_embedder.embedding_table.weight"].shape[0]
    except KeyError as err:
        raise ConfigError(f"the checkpoint's weights are not a DiT's (no {err})") from err
    side = math.isqrt(tokens) * proj.shape[-1]
    return SimpleNamespace(num_classes=rows - int(class_dropout_prob > 0), in_chans=proj.shape[1], img_size=side,
                           class_names=None)


def load_model(cfg: Mapping[str, Any], device: torch.device):
    """(task, model, data, checkpoint info) from ``cfg.ckpt``, with the sampling overrides applied."""
    if cfg.ckpt is None:
        raise ConfigError("ckpt= is required (a diffusion checkpoint written by train.py), or model=<preset> "
                          "pretrained=<file | hub id | true> for released weights")
    if cfg.pretrained:
        raise ConfigError(f"pretrained={cfg.pretrained} goes with model=<preset> (released weights), not with ckpt=")
    run = rebuild_run(cfg.ckpt, with_data=False)
    state, used, container, task = run.state, run.path, run.config, run.task
    if group_name(container["task"]) != "diffusion":
        raise ConfigError(f"{used} is not a diffusion training checkpoint (no task=diffusion config inside)")
    key = "model_ema" if cfg.ema else "model"
    weights = weights_of(run, bool(cfg.ema), off_switch="ema=false")
    try:
        data = build_data(container["data"])
    except Exception as err:  # e.g. the latents directory lives on another machine: only the shape is needed
        log.warning("data of the checkpoint unavailable (%s); taking the shape from the weights", err)
        data = shape_from_weights(weights, task.class_dropout_prob)
    model = task.build_model(data)
    model.load_state_dict(weights)
    apply_overrides(task, cfg)
    info = {"checkpoint": str(used), "step": state.get("step"), "model": container["model"]["name"],
            "weights": key, "attention": (container.get("attention") or {}).get("name") or "preset"}
    return task, model.to(device).eval(), data, info


# DiT's sample_ddp.py: 250 DDPM steps, guidance 1.5 on the first 3 latent channels (the defaults for released weights)
RELEASED_SAMPLE = {"steps": "250", "sampler": "ddpm", "cfg_scale": 1.5, "guidance_channels": 3}


def load_released_model(cfg: Mapping[str, Any], device: torch.device):
    """(task, model, data, info) for released DiT / MoH-DiT weights (``model=<preset> pretrained=<weights>``): the data
    shape comes from the weights, the sampling defaults from DiT's ``sample_ddp.py`` (:data:`RELEASED_SAMPLE`)."""
    from moh_vision.tasks.diffusion import DiffusionTask
    from .released import load_strictly, read_released
    if cfg.ckpt is not None:
        raise ConfigError("give ckpt=<train.py checkpoint> or model=<preset> pretrained=<weights>, not both")
    if not cfg.pretrained:
        raise ConfigError(f"model={cfg.model} needs pretrained=<file | hub id | true>: the released weights to sample")
    path, weights = read_released(cfg.model, cfg.pretrained)
    task = DiffusionTask(model={"name": cfg.model, "checkpoint_path": None, "init_from": None, "kwargs": {}},
                         attention={"name": None, "aux_loss_weight": 0.0}, sample=RELEASED_SAMPLE,
                         vae={"path": str(cfg.vae) if cfg.vae else None})
    data = shape_from_weights(weights, task.class_dropout_prob)
    if data.in_chans not in (1, 3) and not cfg.vae:
        raise ConfigError(f"{cfg.model} makes {data.in_chans}-channel latents: give vae=<local AutoencoderKL dir> "
                          f"(DiT: sd-vae-ft-ema) to decode them")
    if data.in_chans <= 3:  # DiT guides 3 of its 4 latent channels; a pixel-space model: every channel
        task.sample_cfg["guidance_channels"] = None
    model = task.build_model(data)
    load_strictly(model, weights, f"pretrained={cfg.pretrained} ({path})")
    apply_overrides(task, cfg)
    info = {"checkpoint": str(path), "step": None, "model": cfg.model, "weights": "released", "attention": "preset"}
    return task, model.to(device).eval(), data, info


def apply_overrides(task, cfg: Mapping[str, Any]) -> None:
    for name in OVERRIDABLE:
        if cfg.get(name) is not None:
            task.sample_cfg[name] = cfg[name]
    if cfg.guidance_channels is not None:
        gc = str(cfg.guidance_channels)
        if gc != "all" and not gc.isdigit():
            raise ConfigError(f"guidance_channels={gc}: use a channel count (3: DiT's quirk) or all")
        task.sample_cfg["guidance_channels"] = None if gc == "all" else int(gc)
    check_sampler(task.sample_cfg["sampler"], task.sample_cfg["steps"], task.diffusion.num_timesteps)
    if float(task.sample_cfg["cfg_scale"]) < 1:
        raise ConfigError(f"cfg_scale={task.sample_cfg['cfg_scale']} must be >= 1 (1 = no guidance)")
    if cfg.vae:
        task.vae_cfg = {**task.vae_cfg, "path": str(cfg.vae)}


# -- Sampling (every rank) and merging (rank 0) ------------------------------------------------------------------------
def run_digest(info: Dict[str, Any], settings: Dict[str, Any]) -> str:
    text = json.dumps({**info, **settings}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# -- Outputs and metrics (rank 0) --------------------------------------------------------------------------------------
def to_float(images: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> float [-1, 1] NCHW (exactly invertible by ``to_uint8``)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def write_grid(images: np.ndarray, labels: np.ndarray, path: Path, num_classes: int, grid_classes: int,
               per_class: int, class_names=None) -> Path:
    from moh_vision.analysis.grids import save_class_grid
    rows = np.unique(np.linspace(0, num_classes - 1, min(grid_classes, num_classes)).round().astype(int))
    rows = [c for c in rows if (labels == c).any()]
    per_row = max(1, min([per_class] + [int((labels == c).sum()) for c in rows]))
    pick = np.concatenate([np.flatnonzero(labels == c)[:per_row] for c in rows])
    return save_class_grid(to_float(images[pick]), torch.from_numpy(labels[pick]), path, per_row=per_row,
                           class_names=class_names)


def digits_metrics(task, data, images: np.ndarray, labels: np.ndarray, classifier_path: Path) -> Dict[str, float]:
    from moh_vision.analysis.metrics import digits_sample_metrics, load_or_train_classifier, real_digits
    classifier = load_or_train_classifier(classifier_path, data.img_size)
    reference, _ = real_digits(data.val)
    return digits_sample_metrics(classifier, to_float(images), torch.from_numpy(labels), reference)


def check_metric_inputs(cfg: Mapping[str, Any]) -> None:
    """Fail before sampling, not after hours of it, when the metric inputs are wrong: torch-fidelity, the Inception
    weights (the network ADM's evaluator uses, built once), the reference and its statistics."""
    if cfg.fid_ref is None:
        return
    from moh_vision.analysis.adm_evaluation import check_evaluation_inputs
    check_evaluation_inputs(cfg.fid_ref, cfg.inception_weights, ref_option="fid_ref",
                            weights_option="inception_weights")


def adm_sample_metrics(images: np.ndarray, cfg: Mapping[str, Any], device: torch.device) -> Dict[str, float]:
    """ADM's FID, sFID, Inception Score, precision and recall of the samples against ``fid_ref``."""
    from moh_vision.analysis.adm_evaluation import ArrayImages, evaluate_images, read_reference
    from moh_vision.analysis.inception import InceptionActivations
    reference = read_reference(cfg.fid_ref, side=images.shape[1], option="fid_ref")
    inception = InceptionActivations(cfg.inception_weights, device, option="inception_weights")
    found = evaluate_images(ArrayImages(images), reference, inception, int(cfg.metrics_batch_size), bool(cfg.progress))
    return {name: found[name] for name in ADM_METRICS if name in found}


def sample(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    from moh_vision.analysis.grids import save_adm_npz
    start = time.time()
    dist = init_distributed(cfg.device)
    try:
        out = shared_output_dir(Path(cfg.out or time.strftime(DEFAULT_OUT)), dist)
        device = dist.device
        check_metric_inputs(cfg)
        task, model, data, info = (load_released_model if cfg.model else load_model)(cfg, device)
        if cfg.compile:  # the first call compiles; the other steps reuse it (a smaller last batch compiles once more)
            from moh_vision.attention.recorder import compile_model
            model = compile_model(model)
        if task.vae_cfg["path"]:
            from moh_vision.data.latents import load_vae
            load_vae(task.vae_cfg["path"], device)  # fail now if missing; cached for decoding
        num_samples = sample_count(cfg, task.null_class)
        settings = {"num_samples": num_samples, "labels": label_mode(cfg), "seed": int(cfg.seed),
                    "vae": task.vae_cfg["path"], **{k: task.sample_cfg[k] for k in (*OVERRIDABLE, "guidance_channels")}}
        parts = out / f".parts-{run_digest(info, {**settings, 'world_size': dist.world_size})}"
        size = int(task.sample_cfg["batch_size"])
        sampled = batches_per_rank(num_samples, size, dist.world_size) * size * dist.world_size
        if dist.is_main:
            log.info("sampling %d images (%d classes; %d in full batches of %d on %d ranks) from %s [%s weights, step "
                     "%s]: %s", num_samples, task.null_class, sampled, size, dist.world_size, info["checkpoint"],
                     info["weights"], info["step"], ", ".join(f"{k}={v}" for k, v in settings.items()
                                                               if k != "num_samples"))
        with device_settings(bool(cfg.tf32), deterministic=True, device=device):  # TF32 while sampling only; restored
            merged = sample_images(task, model, settings["labels"], num_samples, task.null_class, int(cfg.seed),
                                   device, parts, dist, bool(cfg.progress), int(cfg.decode_batch_size))
        if merged is None:
            return {}
        images, labels = merged
        files = {"npz": str(save_adm_npz(images, out / "samples.npz")),
                 "labels": str(atomic_write(out / "labels.npy", lambda f: np.save(f, labels))),
                 "grid": str(write_grid(images, labels, out / "samples.png", task.null_class, int(cfg.grid_classes),
                                        int(cfg.grid_per_class), getattr(data, "class_names", None)))}
        metrics: Dict[str, float] = {}
        if task.is_digits:
            path = Path(str(cfg.digits_classifier or Path(info["checkpoint"]).parent.parent / "digits_classifier.pt"))
            metrics.update(digits_metrics(task, data, images, labels, path))
        if cfg.fid_ref is not None:
            metrics.update({f"sample/{k}": v for k, v in adm_sample_metrics(images, cfg, device).items()})
        counts = np.bincount(labels, minlength=task.null_class)
        summary = {**info, **settings, "num_classes": task.null_class, "per_class_min": int(counts.min()),
                   "per_class_max": int(counts.max()), "image_shape": list(images.shape[1:]),
                   "space": "latent (decoded)" if task.vae_cfg["path"] else "pixel", "world_size": dist.world_size,
                   "rank_seeds": [rank_seed(int(cfg.seed), r, dist.world_size) for r in range(dist.world_size)],
                   "num_sampled": sampled,
                   "files": files, "metrics": metrics, "wall_time_s": time.time() - start}
        write_json(out / "sample.json", summary)
        shutil.rmtree(parts, ignore_errors=True)
        if metrics:
            log.info("metrics: %s", ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        log.info("wrote %s (%s) to %s", Path(files["npz"]).name, "x".join(map(str, images.shape)), out)
        return summary
    finally:
        cleanup(dist)
