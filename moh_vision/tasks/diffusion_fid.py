"""FID during training: ADM's FID, sFID, Inception Score, precision and recall of samples of the EMA weights.

``task.sample.fid_every_steps=N`` (every N optimizer steps) and/or ``task.sample.fid_at_checkpoints=true`` (at every
numbered checkpoint, ``checkpoints/step_<step>.pt``) against the ADM reference batch ``task.sample.fid_ref`` with the
local Inception weights ``task.sample.inception_weights``. Each evaluation draws ``fid_samples`` samples with random
labels (DiT's protocol), every rank its share with DiT's per-rank seeding (``task.sample.seed``: the same noise at every
evaluation, so that two steps differ by their weights, not by their draw), with ``fid_sampler`` in ``fid_steps``
(default DPM-Solver++, 25 steps) at guidance ``fid_cfg_scale`` (null: ``cfg_scale``). Rank 0 computes the numbers in
float32 (the reference's activations once per run) and every rank returns them: ``fid/fid``, ``fid/sfid``,
``fid/inception_score``, ``fid/precision``, ``fid/recall``, with ``fid/seconds`` (its cost, sampling included) and
``fid/num_samples``. What the metrics need is checked before the first training step."""
from __future__ import annotations

import copy
import logging
import shutil
import time
from typing import Any, Dict, Optional

from moh_vision.analysis.adm_evaluation import (ADM_METRICS, ArrayImages, check_evaluation_inputs, evaluate_images,
                                                read_reference, reference_activations)
from moh_vision.diffusion.samplers import check_sampler
from moh_vision.errors import ConfigError
from .protocols import StepContext

log = logging.getLogger(__name__)


class TrainingFid:
    """The work between steps of a diffusion task with FID configured (``DiffusionTask.step_hook``)."""

    def __init__(self, task):
        cfg = task.sample_cfg
        self.task, self.every, self.at_checkpoints = task, int(cfg["fid_every_steps"]), bool(cfg["fid_at_checkpoints"])
        self.num_samples = int(cfg["fid_samples"])
        if not cfg["fid_ref"] or not cfg["inception_weights"]:
            missing = [f"task.sample.{k}" for k in ("fid_ref", "inception_weights") if not cfg[k]]
            raise ConfigError(f"FID during training needs {' and '.join(missing)} (an ADM reference batch .npz and a "
                              f"local torch-fidelity Inception weights file; nothing is downloaded)")
        check_sampler(cfg["fid_sampler"], cfg["fid_steps"], task.diffusion.num_timesteps)
        check_evaluation_inputs(cfg["fid_ref"], cfg["inception_weights"], ref_option="task.sample.fid_ref",
                                weights_option="task.sample.inception_weights")
        self.settings = {"sampler": cfg["fid_sampler"], "steps": str(cfg["fid_steps"]),
                         "cfg_scale": float(cfg["cfg_scale"] if cfg["fid_cfg_scale"] is None else cfg["fid_cfg_scale"])}
        self.inception = self.real = None  # rank 0's, built at the first evaluation
        self.done_at: Optional[int] = None

    def due(self, ctx: StepContext) -> bool:
        return ctx.step != self.done_at and bool(self.every and ctx.step % self.every == 0
                                                 or self.at_checkpoints and ctx.numbered)

    def __call__(self, ctx: StepContext) -> Dict[str, float]:
        if not self.due(ctx):
            return {}
        self.done_at, start = ctx.step, time.time()
        task, cfg = self.task, self.task.sample_cfg
        sampling = copy.copy(task)  # the task, sampling with the FID's sampler, steps and guidance
        sampling.sample_cfg = {**cfg, **self.settings}
        if ctx.is_main:
            log.info("FID at step %d: sampling %d images (%s, %s steps, guidance %g) on %d rank(s), then ADM's numbers "
                     "against %s", ctx.step, self.num_samples, self.settings["sampler"], self.settings["steps"],
                     self.settings["cfg_scale"], ctx.world_size, cfg["fid_ref"])
        parts = ctx.out_dir / "fid" / f".parts-step{ctx.step:08d}"
        merged = ctx.sample_images(sampling, ctx.model_for_eval.eval(), "random", self.num_samples, task.null_class,
                                   int(cfg["seed"]), parts=parts, progress=ctx.progress)
        metrics: Optional[Dict[str, float]] = None
        if ctx.is_main:
            metrics = self._metrics(merged[0], ctx)
            metrics.update({"fid/seconds": time.time() - start, "fid/num_samples": float(self.num_samples)})
            shutil.rmtree(parts, ignore_errors=True)
            log.info("FID at step %d: %s", ctx.step, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return ctx.share(metrics)

    def _metrics(self, images, ctx: StepContext) -> Dict[str, Any]:
        from moh_vision.analysis.inception import InceptionActivations
        cfg = self.task.sample_cfg
        batch = int(cfg["fid_metrics_batch_size"])
        reference = read_reference(cfg["fid_ref"], side=images.shape[1], option="task.sample.fid_ref")
        if self.inception is None:
            self.inception = InceptionActivations(cfg["inception_weights"], ctx.device,
                                                  option="task.sample.inception_weights")
            self.real = reference_activations(reference, self.inception, batch, ctx.progress)
        found = evaluate_images(ArrayImages(images), reference, self.inception, batch, ctx.progress, real=self.real)
        return {f"fid/{name}": float(found[name]) for name in ADM_METRICS if name in found}
