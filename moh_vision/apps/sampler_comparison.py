"""Samplers side by side on a digits checkpoint: quality (the digits proxies) and time (``tools/compare_samplers.py``).

Every arm (``sampler:steps``, e.g. ``ddpm:250`` and ``dpm++:25``) samples the same balanced labels (``per_class`` of
each class) from the same starting noise x_T (one batch, one seeded stream per arm), in one process, one after the
other; each is timed (wall seconds, and per model call) and scored with the digits classifier: ``sample/class_acc``
and ``sample/fd_digits`` against the validation digits. ``seeds`` repeats the arms with other streams, which gives
the draw-to-draw spread a difference between samplers is read against. The first arm is the reference: every other
arm's ``vs_reference`` says by how much its numbers differ, and whether within ``acc_tolerance`` (points) and
``fd_tolerance`` (absolute), and its speed-up against the step ratio."""
from __future__ import annotations

import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import torch

from moh_vision.cli import Options
from moh_vision.diffusion.samplers import SOLVERS, check_sampler
from moh_vision.errors import ConfigError
from moh_vision.engine.loggers import write_json
from .sampling import load_model

log = logging.getLogger(__name__)


def parse_arm(text: str) -> Tuple[str, str]:
    sampler, _, steps = str(text).partition(":")
    if not steps:
        raise ConfigError(f"arms={text}: each arm is sampler:steps, e.g. ddpm:250 or dpm++:25")
    return sampler, steps


def model_calls(sampler: str, steps: str) -> int:
    """Model calls of one sample (each a guided pair when cfg_scale > 1)."""
    from moh_vision.diffusion.schedule import space_timesteps
    return int(steps) if sampler in SOLVERS else len(space_timesteps(1000, steps))


def compare_samplers(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """Run the arms of ``cfg`` (``tools/compare_samplers.py``'s options) and write the record to ``cfg.out``."""
    from moh_vision.analysis.metrics import digits_sample_metrics, load_or_train_classifier, real_digits
    device = torch.device(cfg.device)
    arms = [parse_arm(a) for a in cfg.arms]
    task, model, data, info = load_model(_sampling_options(cfg), device)
    if not task.is_digits:
        raise ConfigError(f"{info['checkpoint']} is not a digits checkpoint: the comparison scores with the digits "
                          f"classifier")
    for sampler, steps in arms:
        check_sampler(sampler, steps, task.diffusion.num_timesteps)
    classifier = load_or_train_classifier(
        Path(str(cfg.digits_classifier or Path(info["checkpoint"]).parent.parent / "digits_classifier.pt")),
        data.img_size)
    reference, _ = real_digits(data.val)
    labels = torch.arange(task.null_class).repeat_interleave(int(cfg.per_class))
    task.sample_cfg["batch_size"] = len(labels)  # one batch: every arm starts from the same x_T
    results: List[Dict[str, Any]] = []
    for seed in cfg.seeds:
        for sampler, steps in arms:
            task.sample_cfg.update(sampler=sampler, steps=steps)
            start = time.perf_counter()
            samples = task.sample(model, labels, device, seed=int(seed))
            seconds = time.perf_counter() - start
            calls = model_calls(sampler, steps)
            row = {"sampler": sampler, "steps": steps, "seed": int(seed), "model_calls": calls,
                   "seconds": seconds, "seconds_per_call": seconds / calls,
                   **digits_sample_metrics(classifier, samples, labels, reference)}
            log.info("%s %s (seed %s): %.1f s, class_acc %.1f%%, fd_digits %.2f", sampler, steps, seed, seconds,
                     row["sample/class_acc"], row["sample/fd_digits"])
            results.append(row)
    record = {**info, "num_samples": len(labels), "per_class": int(cfg.per_class),
              "cfg_scale": float(task.sample_cfg["cfg_scale"]), "arms": [f"{s}:{n}" for s, n in arms],
              "seeds": [int(s) for s in cfg.seeds], "results": results,
              "vs_reference": _versus_reference(results, arms, cfg), "acc_tolerance": float(cfg.acc_tolerance),
              "fd_tolerance": float(cfg.fd_tolerance), "threads": torch.get_num_threads(),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "device": str(device)}
    if cfg.out:
        write_json(Path(str(cfg.out)), record)
        log.info("wrote %s", cfg.out)
    return record


def _sampling_options(cfg: Mapping[str, Any]) -> Options:
    """What :func:`~.sampling.load_model` reads: the checkpoint, its EMA weights or not, the guidance override."""
    return Options(ckpt=cfg.ckpt, pretrained=None, ema=bool(cfg.ema), cfg_scale=cfg.cfg_scale, guidance_channels=None,
                   vae=None, **{name: None for name in ("steps", "sampler", "clip_denoised", "batch_size")})


def _versus_reference(results: List[Dict[str, Any]], arms, cfg) -> Dict[str, Any]:
    """Each arm against the first, seed by seed (the same x_T): differences, tolerances met, speed-up."""
    first = f"{arms[0][0]}:{arms[0][1]}"
    out: Dict[str, Any] = {"reference": first}
    by = {(r["sampler"], r["steps"], r["seed"]): r for r in results}
    for sampler, steps in arms[1:]:
        rows = []
        for seed in cfg.seeds:
            ref, arm = by[(*arms[0], int(seed))], by[(sampler, steps, int(seed))]
            acc = arm["sample/class_acc"] - ref["sample/class_acc"]
            fd = arm["sample/fd_digits"] - ref["sample/fd_digits"]
            rows.append({"seed": int(seed), "class_acc_diff": acc, "fd_digits_diff": fd,
                         "speedup": ref["seconds"] / arm["seconds"],
                         "step_ratio": ref["model_calls"] / arm["model_calls"],
                         "within_tolerance": abs(acc) <= float(cfg.acc_tolerance)
                         and abs(fd) <= float(cfg.fd_tolerance)})
        out[f"{sampler}:{steps}"] = rows
    return out
