"""Routing analysis of a training checkpoint (``tools/analyze_routing.py``): rebuild the run from the config inside the
checkpoint as ``eval.py`` does, run :mod:`moh_vision.analysis.routing_analysis` on validation images, write the figures
and ``routing_analysis.json``, and log them into the run's own wandb run."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from moh_vision.analysis.routing_analysis import analyse, default_out, layer_statistics, wandb_metrics, write_outputs
from moh_vision.attention import routed_layer_names
from moh_vision.config import compose
from moh_vision.errors import ConfigError
from moh_vision.tasks.classification import split_batch
from moh_vision.engine.distributed import pick_device
from .run import rebuild_run, weights_of

log = logging.getLogger(__name__)


def load_run(ckpt: str, data_overrides: Sequence[str], weights: str):
    """(rebuilt run, model with the checkpoint's ``weights``: ``model`` or ``ema``); ``data=...`` / ``data.<key>=...``
    overrides replace or update the saved data config, as in ``eval.py``."""
    data_cfg = None
    if data_overrides:
        if not any(o.startswith("data=") for o in data_overrides):  # eval.yaml has no data group: add keys
            data_overrides = [f"+{o}" if o.startswith("data.") else o for o in data_overrides]
        data_cfg = compose("eval", [f"ckpt={ckpt}", *data_overrides]).get("data")
    run = rebuild_run(ckpt, data_cfg)
    model = run.task.build_model(run.data)
    model.load_state_dict(weights_of(run, weights == "ema", off_switch="weights=model"))
    return run, model


def task_forward(task, model: torch.nn.Module, device: torch.device, timestep: Optional[int] = None
                 ) -> Callable[[Any], torch.Tensor]:
    """``forward(batch) -> images``: the task's model on one validation batch (diffusion: the images noised to
    ``timestep``, default half the schedule, with fixed noise)."""
    generator = torch.Generator().manual_seed(0)
    diffusion = getattr(task, "diffusion", None)
    if diffusion is not None and timestep is not None and not 0 <= int(timestep) < diffusion.num_timesteps:
        raise ConfigError(f"timestep={timestep} is outside 0..{diffusion.num_timesteps - 1}")

    def forward(batch) -> torch.Tensor:
        x, y, _ = split_batch(batch)
        x, y = x.to(device), y.to(device)
        if diffusion is None:
            model(x)
            return x
        t = torch.full((x.shape[0],), diffusion.num_timesteps // 2 if timestep is None else int(timestep),
                       dtype=torch.long, device=device)
        noise = torch.randn(x.shape, generator=generator).to(device)
        model(diffusion.q_sample(x, t, noise), t, y)
        return x
    return forward


def log_to_wandb(mode: str, container: Dict[str, Any], state: Dict[str, Any], out: Path, stats, files,
                 summary: Dict[str, Any]) -> Optional[str]:
    """Log the figures and per-layer numbers (keys ``routing_analysis/...``) into the training run's own wandb run
    (resumed by the id its checkpoint recorded), or, for a run that had none, a new run of job type ``routing_analysis``
    in its project and group. Returns the run id, or None when wandb is off or unusable."""
    from moh_vision.config import WandbLogger as WandbOptions
    saved = dict(container["logger"])
    if mode == "none" or (mode == "auto" and saved["name"] != "wandb"):
        return None
    options = WandbOptions(**{**saved, "name": "wandb"})  # a csv run's analysis: the schema's defaults
    run_id = state.get("wandb_run_id")
    try:
        from moh_vision.engine.loggers import WandbLogger
        run = WandbLogger(out.parent if run_id else out, {"trained": container},
                          project=options.project, entity=options.entity,
                          group=options.group, name=None if run_id else f"routing-{summary['model']}",
                          job_type="train" if run_id else "routing_analysis", mode=options.mode, run_id=run_id)
    except Exception as err:  # wandb missing or failing: the files are the result anyway
        log.warning("wandb logging skipped (%s: %s)", type(err).__name__, err)
        return None
    step = int(state.get("step") or 0)
    for key, name in files.items():
        if name.endswith(".png"):
            run.log_image(f"routing_analysis/{key}", out / name, step=step)
    run.log(wandb_metrics(stats), step=step)
    run.summary({f"routing_analysis/{k}": v for k, v in summary.items() if isinstance(v, (int, float, str))})
    run_id = run.run_id
    run.finish()
    return run_id


def analyze_checkpoint(ckpt: str, data_overrides: Sequence[str] = (), num_images: int = 8, map_images: int = 4,
                       batch_size: int = 32, device: str = "auto", weights: str = "model",
                       timestep: Optional[int] = None, max_map_layers: int = 8, out: Optional[str] = None,
                       logger: str = "auto") -> Dict[str, Any]:
    """Analyse ``ckpt`` on ``num_images`` validation images; writes into ``out`` (default
    ``<run dir>/routing_analysis``) and returns what ``routing_analysis.json`` holds plus ``wandb_run_id``."""
    run, model = load_run(ckpt, data_overrides, weights)
    data, task, container, state = run.data, run.task, run.config, run.state
    where = pick_device(str(device))
    model = model.to(where)
    loader = DataLoader(data.val, batch_size=min(batch_size, num_images), shuffle=False, num_workers=0,
                        collate_fn=data.collate_fn)
    sums, maps, images, seen = analyse(model, loader, task_forward(task, model, where, timestep), num_images,
                                       map_images)
    stats = layer_statistics(model, sums)
    out_dir = Path(out) if out else default_out(Path(run.path))
    files = write_outputs(out_dir, stats, maps, images, max_map_layers)
    diffusion = getattr(task, "diffusion", None)
    summary = {"checkpoint": str(run.path), "model": container["model"]["name"], "task": getattr(task, "name", "?"),
               "data": data.describe() if hasattr(data, "describe") else type(data).__name__,
               "weights": weights, "num_images": seen, "step": state.get("step"),
               "timestep": None if diffusion is None else
               (diffusion.num_timesteps // 2 if timestep is None else int(timestep))}
    result = {**summary, "layers": stats, "files": files}
    (out_dir / "routing_analysis.json").write_text(json.dumps(result, indent=1))
    result["wandb_run_id"] = log_to_wandb(logger, container, state, out_dir, stats, files, summary)
    print(f"routing analysis of {summary['model']} on {seen} validation images: "
          f"{len(routed_layer_names(model))} routed layers -> {out_dir}")
    return result
