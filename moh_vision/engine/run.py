"""What ``train.py`` and ``eval.py`` do, given a composed Hydra config."""
from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from moh_vision.errors import ConfigError
from moh_vision import checkpoints as ckpt_io
from .distributed import broadcast_object, cleanup, init_distributed
from .loggers import Loggers, write_json
from .trainer import Preempted, Trainer

log = logging.getLogger(__name__)

# Exit status after a preemption signal: the checkpoint is saved and the job should be requeued.
REQUEUE_EXIT_CODE = 124


def hydra_output_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # called outside @hydra.main (tests)
        return Path(os.getcwd())


def run_group_and_name(cfg: DictConfig) -> Dict[str, Optional[str]]:
    """wandb group = experiment / sweep / tag name; wandb run name = the command-line overrides."""
    try:
        hc = HydraConfig.get()
        choices = hc.runtime.choices
        overrides = hc.job.override_dirname or None
    except ValueError:
        choices, overrides = {}, None
    group = (cfg.logger.get("group") if "logger" in cfg else None) or choices.get("experiment") \
        or choices.get("sweep") or cfg.get("tag")
    return {"group": group, "name": overrides or "default"}


def make_loggers(cfg: DictConfig, out_dir: Path, is_main: bool, config: Dict[str, Any], run_id: Optional[str],
                 job_type: str) -> Loggers:
    logger_cfg = OmegaConf.to_container(cfg.logger, resolve=True) if "logger" in cfg else {"name": "csv"}
    kind = logger_cfg.pop("name", "csv")
    wandb_options = None
    if kind == "wandb":
        names = run_group_and_name(cfg)
        wandb_options = {"project": logger_cfg.get("project", "moh-vision"), "entity": logger_cfg.get("entity"),
                         "group": names["group"], "name": names["name"], "tags": logger_cfg.get("tags") or [],
                         "mode": logger_cfg.get("mode", "auto")}
    return Loggers(out_dir, kind=kind, enabled=is_main, wandb_options=wandb_options, config=config,
                   run_id=run_id, job_type=job_type)


def _previous_wandb_id(trainer_cfg: DictConfig, out_dir: Path) -> Optional[str]:
    """Continue the same wandb run when resuming."""
    try:
        path = ckpt_io.resolve_resume(trainer_cfg.get("resume", "auto"), out_dir)
        if path is None:
            return None
        state, _ = ckpt_io.load_with_fallback(path)
        return state.get("wandb_run_id")
    except ConfigError:
        return None


def shared_output_dir(out_dir: Path, dist) -> Path:
    """Under torchrun all ranks use rank 0's directory; a stray per-rank Hydra dir is removed."""
    shared = Path(broadcast_object(str(out_dir), dist))
    if shared != out_dir and out_dir.exists():
        leftovers = [p for p in out_dir.iterdir() if p.name != ".hydra"]
        if not leftovers:
            shutil.rmtree(out_dir, ignore_errors=True)
    return shared


def requeue_slurm_job() -> None:
    """Inside a plain sbatch job (not submitit, which requeues itself): ``scontrol requeue`` this job,
    so it restarts and resumes from last.pt (needs ``#SBATCH --requeue``)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or "SUBMITIT_EXECUTOR" in os.environ or shutil.which("scontrol") is None:
        return
    import subprocess
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    log.warning("scontrol requeue %s: %s", job, "ok" if result.returncode == 0 else result.stderr.strip())


def train(cfg: DictConfig) -> Dict[str, Any]:
    dist = init_distributed(cfg.trainer.get("device", "auto"))
    out_dir = shared_output_dir(hydra_output_dir(), dist)
    config = OmegaConf.to_container(cfg, resolve=True)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    data = instantiate(cfg.data)
    task = instantiate(cfg.task, model=config["model"], attention=config["attention"], _recursive_=False)
    loggers = make_loggers(cfg, out_dir, dist.is_main, config, _previous_wandb_id(cfg.trainer, out_dir), "train")
    trainer = Trainer(config["trainer"], out_dir, dist, loggers, optim=config["optim"], sched=config["sched"],
                      config=config, seed=int(cfg.seed))
    try:
        summary = trainer.fit(task, data)
    except Preempted as stop:
        loggers.finish(exit_code=REQUEUE_EXIT_CODE)
        if dist.is_main and cfg.trainer.get("requeue_on_preempt", True):
            requeue_slurm_job()
        log.warning("stopped by %s at step %d; checkpoint saved to %s; resume with trainer.resume=auto "
                    "(same output dir) or trainer.resume=%s", stop, trainer.step, trainer.last_good_checkpoint,
                    trainer.last_good_checkpoint)
        cleanup(dist)
        sys.exit(REQUEUE_EXIT_CODE)
    except BaseException:
        loggers.finish(exit_code=1)
        cleanup(dist)
        raise
    loggers.finish(summary=summary)
    cleanup(dist)
    if dist.is_main:
        log.info("done: %s", ", ".join(f"{k}={v:.4g}" for k, v in summary.items()
                                      if isinstance(v, float) and k.startswith(("val", "best", "sample"))))
        log.info("outputs in %s", out_dir)
    return summary


class RebuiltRun(SimpleNamespace):
    """What a checkpoint's own config rebuilds: ``state``, ``path``, ``config`` (plain dict), ``task``
    and ``data`` (None when ``build_data=False``)."""


def rebuild_run(ckpt: str, data: Optional[DictConfig] = None, build_data: bool = True) -> RebuiltRun:
    """Load ``ckpt`` and rebuild its task (and data) from the config inside it, as it was trained.

    ``data`` replaces the saved data config (a full group config with ``_target_``) or updates it
    (single keys). The model's ``checkpoint_path``/``init_from`` are cleared: the weights come from
    this checkpoint, and the files that seeded the run need not exist any more.
    """
    state, used = ckpt_io.load_with_fallback(Path(str(ckpt)).expanduser())
    saved = OmegaConf.create(state.get("config") or {})
    if "task" not in saved or "model" not in saved:
        raise ConfigError(f"{used} carries no training config (was it written by train.py?); load its weights "
                          f"with timm.create_model(..., checkpoint_path=)")
    if data is not None:
        saved.data = OmegaConf.merge(saved.data, data) if "_target_" not in data else data
    config = OmegaConf.to_container(saved, resolve=True)
    config["model"]["checkpoint_path"] = None
    config["model"]["init_from"] = None
    task = instantiate(OmegaConf.create(config["task"]), model=config["model"], attention=config["attention"],
                       _recursive_=False)
    return RebuiltRun(state=state, path=used, config=config, task=task,
                      data=instantiate(OmegaConf.create(config["data"])) if build_data else None)


def weights_of(run: RebuiltRun, use_ema: bool, off_switch: str = "eval.use_ema=false") -> Dict[str, torch.Tensor]:
    """The checkpoint's EMA or raw weights; ``off_switch`` names the option that asks for raw ones."""
    key = "model_ema" if use_ema else "model"
    if key not in run.state:
        raise ConfigError(f"EMA weights requested, but {run.path} has no EMA weights (trainer.ema.enabled was "
                          f"false); use {off_switch}")
    return run.state[key]


def evaluate(cfg: DictConfig) -> Dict[str, Any]:
    """Top-1/top-5 (or the diffusion task's metrics) of a checkpoint; its config travels inside it."""
    from moh_vision.engine.distributed import pick_device

    run = rebuild_run(cfg.ckpt, cfg.get("data"))
    out_dir = hydra_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.eval.device)
    data, task, container, state, used = run.data, run.task, run.config, run.state, run.path
    use_ema = bool(cfg.eval.use_ema)
    model = task.build_model(data)
    model.load_state_dict(weights_of(run, use_ema))
    model = model.to(device)
    trainer_like = _EvalRunner(cfg, device, data, task)
    metrics = trainer_like.run(model)
    summary = {"checkpoint": str(used), "use_ema": use_ema, "model": container["model"]["name"],
               "params": sum(p.numel() for p in model.parameters()), "step": state.get("step"), **metrics}
    write_json(out_dir / "summary.json", summary)
    OmegaConf.save(OmegaConf.create({"eval": OmegaConf.to_container(cfg, resolve=True), "trained": container}),
                   out_dir / "config.yaml")
    loggers = make_loggers(cfg, out_dir, True, {"eval": OmegaConf.to_container(cfg, resolve=True)},
                           None, "eval")
    loggers.log_epoch({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=int(state.get("step") or 0))
    loggers.finish(summary=summary)
    log.info("%s", ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
    return summary


class _EvalRunner:
    """The bits of the trainer that evaluation needs: a val loader, AMP, and the task's metrics."""

    def __init__(self, cfg: DictConfig, device: torch.device, data, task):
        from torch.utils.data import DataLoader
        self.cfg, self.device, self.data, self.task = cfg, device, data, task
        self.loader = DataLoader(data.val, batch_size=int(cfg.eval.batch_size), shuffle=False,
                                 num_workers=int(cfg.eval.num_workers), collate_fn=data.collate_fn)
        amp = cfg.eval.get("amp", "none")
        if amp in ("bf16", "fp16"):
            dtype = torch.bfloat16 if amp == "bf16" else torch.float16
            self.amp = lambda: torch.autocast(device.type, dtype=dtype)
        else:
            import contextlib
            self.amp = contextlib.nullcontext

    def run(self, model) -> Dict[str, Any]:
        sums = self.task.evaluate(model, self.loader, self.device, amp=self.amp)
        return self.task.finalize(sums, prefix="val")
