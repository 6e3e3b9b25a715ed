"""What ``train.py`` and ``eval.py`` do, given a composed Hydra config."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moh_vision import checkpoints as ckpt_io
from moh_vision.config import EvalConfig, TrainConfig, build_data, build_task, group_name, validate
from moh_vision.cli import user_error_in
from moh_vision.errors import ConfigError, RunError, os_error_line
from moh_vision.tasks.protocols import EpochContext
from moh_vision.engine.distributed import broadcast_object, cleanup, init_distributed, settle_failure
from moh_vision.engine.loggers import Loggers, write_json
from moh_vision.checkpoints import RunLock
from moh_vision.engine.trainer import Preempted, Trainer, load_resume

log = logging.getLogger(__name__)

# Exit status after a preemption signal: the checkpoint is saved and the job should be requeued.
REQUEUE_EXIT_CODE = 124


class StoppedForRequeue(SystemExit):
    """The exit after a preemption: saved, the run directory's lock to be released, then the requeue asked."""

    def __init__(self, requeue: bool):
        super().__init__(REQUEUE_EXIT_CODE)
        self.requeue = requeue


def hydra_output_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # called outside @hydra.main (tests)
        return Path(os.getcwd())


def run_group_and_name(logger: Any, tag: Optional[str]) -> Dict[str, Optional[str]]:
    """wandb group: logger.group, else the experiment / sweep / tag name; wandb run name: the command-line overrides."""
    try:
        hc = HydraConfig.get()
        choices = hc.runtime.choices
        overrides = hc.job.override_dirname or None
    except ValueError:
        choices, overrides = {}, None
    group = logger.group or choices.get("experiment") or choices.get("sweep") or tag
    return {"group": group, "name": overrides or "default"}


def make_loggers(logger: Any, tag: Optional[str], out_dir: Path, is_main: bool, config: Dict[str, Any],
                 run_id: Optional[str], job_type: str) -> Loggers:
    """The run's loggers from its typed ``logger`` config (csv, none or wandb)."""
    wandb_options = None
    if logger.name == "wandb":
        names = run_group_and_name(logger, tag)
        wandb_options = {"project": logger.project, "entity": logger.entity, "group": names["group"],
                         "name": names["name"], "tags": list(logger.tags), "mode": logger.mode}
    return Loggers(out_dir, kind=logger.name, enabled=is_main, wandb_options=wandb_options, config=config,
                   run_id=run_id, job_type=job_type)


def shared_output_dir(out_dir: Path, dist) -> Path:
    """Under torchrun all ranks use rank 0's directory; a stray per-rank Hydra dir is removed."""
    shared = Path(broadcast_object(str(out_dir), dist))
    if shared != out_dir and out_dir.exists():
        leftovers = [p for p in out_dir.iterdir() if p.name != ".hydra"]
        if not leftovers:
            shutil.rmtree(out_dir, ignore_errors=True)
    return shared


def requeue_slurm_job() -> None:
    """Inside a plain sbatch job (not submitit, which requeues itself): ``scontrol requeue`` this job, so it restarts
    and resumes from last.pt (needs ``#SBATCH --requeue``)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or "SUBMITIT_EXECUTOR" in os.environ or shutil.which("scontrol") is None:
        return
    import subprocess
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    log.warning("scontrol requeue %s: %s", job, "ok" if result.returncode == 0 else result.stderr.strip())


def train(cfg: DictConfig) -> Dict[str, Any]:
    run: TrainConfig = validate(cfg)  # every value checked: nothing is built or written before this
    config = OmegaConf.to_container(cfg, resolve=True)
    dist = init_distributed(run.trainer.device, run.trainer.dist_timeout_s)
    out_dir = shared_output_dir(hydra_output_dir(), dist)
    lock = RunLock(out_dir)  # rank 0 holds it for all ranks
    problem = None
    if dist.is_main:
        try:
            lock.acquire()
        except ConfigError as err:
            problem = str(err)
    problem = broadcast_object(problem, dist)
    if problem:
        cleanup(dist)
        raise ConfigError(problem)
    try:
        return _train_in(out_dir, run, config, dist)
    except StoppedForRequeue as stop:
        lock.release()  # before the requeue: the requeued job may start on another node at once
        if stop.requeue:
            requeue_slurm_job()
        raise
    finally:
        lock.release()


def one_line(err: BaseException) -> str:
    """What a rank's failure says to the other ranks: its ``error:`` line, or the exception's first line."""
    user_error = user_error_in(err)
    if user_error is not None:
        return str(user_error)
    text = str(err).strip().splitlines()
    return os_error_line(err) or f"{type(err).__name__}{': ' + text[0] if text else ''}"


def _train_in(out_dir: Path, run: TrainConfig, config: Dict[str, Any], dist) -> Dict[str, Any]:
    """``train`` once this process holds the run directory. A failure here is settled with the other ranks before
    this one leaves the process group (:func:`~moh_vision.engine.distributed.settle_failure`)."""
    loggers = None
    try:
        data = build_data(run.data)
        task = build_task(run.task, model=config["model"], attention=config["attention"], kernels=config["kernels"])
        resumed = load_resume(run.trainer.resume, out_dir)  # read once: the wandb run id, then the trainer's state
        loggers = make_loggers(run.logger, run.tag, out_dir, dist.is_main, config,
                               resumed[0].get("wandb_run_id") if resumed else None, "train")  # the same wandb run
        trainer = Trainer(run.trainer, out_dir, dist, loggers, optim=run.optim, sched=run.sched, config=config,
                          seed=run.seed, resumed=resumed)
        summary = trainer.fit(task, data)
    except Preempted as stop:
        loggers.finish(exit_code=REQUEUE_EXIT_CODE)
        log.warning("stopped by %s at step %d; checkpoint saved to %s; resume with trainer.resume=auto "
                    "(same output dir) or trainer.resume=%s", stop, trainer.step, trainer.last_good_checkpoint,
                    trainer.last_good_checkpoint)
        cleanup(dist)
        raise StoppedForRequeue(dist.is_main and run.trainer.requeue_on_preempt) from None
    except BaseException as err:
        if loggers is not None:
            loggers.finish(exit_code=1)
        cause = None if isinstance(err, SystemExit) else settle_failure(err, dist, one_line(err))
        cleanup(dist)
        if cause is not None:
            raise RunError(cause) from err
        raise
    loggers.finish(summary=summary)
    cleanup(dist)
    if dist.is_main:
        log.info("done: %s", ", ".join(f"{k}={v:.4g}" for k, v in summary.items()
                                      if isinstance(v, float) and k.startswith(("val", "best", "sample"))))
        log.info("outputs in %s", out_dir)
    return summary


class RebuiltRun(SimpleNamespace):
    """What a checkpoint's own config rebuilds: ``state``, ``path``, ``config`` (plain dict), ``task`` and ``data``
    (None when ``with_data=False``)."""


def rebuild_run(ckpt: str, data: Optional[DictConfig] = None, with_data: bool = True,
                splits: Optional[tuple] = None) -> RebuiltRun:
    """Load ``ckpt`` and rebuild its task (and data) from the config inside it, as it was trained. ``data`` replaces
    the saved data config (another data group) or updates it (single keys). The model's ``checkpoint_path`` /
    ``init_from`` are cleared: the weights come from this checkpoint, the files that seeded the run may be gone."""
    state, used = ckpt_io.load_with_fallback(Path(str(ckpt)).expanduser())
    saved = OmegaConf.create(state.get("config") or {})
    if "task" not in saved or "model" not in saved:
        raise ConfigError(f"{used} carries no training config (was it written by train.py?); load its weights "
                          f"with timm.create_model(..., checkpoint_path=)")
    if data is not None:  # data=<name> replaces the saved data config; data.<key>=... updates it
        saved.data = data if "name" in data and group_name(dict(data)) != group_name(dict(saved.data)) \
            else OmegaConf.merge({k: v for k, v in saved.data.items() if k != "_target_"}, data)
    config = OmegaConf.to_container(saved, resolve=True)
    config["model"]["checkpoint_path"] = config["model"]["init_from"] = None
    task = build_task(config["task"], model=config["model"], attention=config["attention"],
                      kernels=config.get("kernels"))  # runs written before the kernels config: every op auto
    return RebuiltRun(state=state, path=used, config=config, task=task,
                      data=build_data(config["data"], splits=splits) if with_data else None)


def weights_of(run: RebuiltRun, use_ema: bool, off_switch: str = "eval.use_ema=false") -> Dict[str, torch.Tensor]:
    """The checkpoint's EMA or raw weights; ``off_switch`` names the option that asks for raw ones."""
    key = "model_ema" if use_ema else "model"
    if key not in run.state:
        raise ConfigError(f"EMA weights requested, but {run.path} has no EMA weights (trainer.ema.enabled was "
                          f"false); use {off_switch}")
    return run.state[key]


def evaluate(cfg: DictConfig) -> Dict[str, Any]:
    """Top-1/top-5 (or the diffusion task's metrics) of a checkpoint, whose config travels inside it, and the task's
    end-of-run work (diffusion: a sample grid in ``samples/``, the sample metrics); the weights used (EMA or raw) are
    logged and in ``summary.json``. Released weights (``model=<preset> pretrained=...``):
    :mod:`moh_vision.apps.released`."""
    from moh_vision.engine.distributed import pick_device

    options: EvalConfig = validate(cfg)
    out_dir = hydra_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    if options.pretrained is not None:  # released weights, evaluated as timm's validate.py does
        from .released import evaluate_released
        return evaluate_released(cfg, out_dir, options)
    run = rebuild_run(options.ckpt, cfg.data, splits=("val",))
    device = pick_device(options.eval.device)
    data, task, container, state, used = run.data, run.task, run.config, run.state, run.path
    use_ema = options.eval.use_ema
    has_ema = "model_ema" in state
    log.info("evaluating the %s weights of %s%s", "EMA" if use_ema else "raw (non-EMA)", used,
             "" if use_ema or not has_ema else " (the checkpoint also holds EMA weights: eval.use_ema=true)")
    model = task.build_model(data)
    problem = ckpt_io.state_dict_mismatch(model.state_dict(), weights_of(run, use_ema))
    if problem:
        raise ConfigError(f"{used} does not fit the model built for these data "
                          f"({getattr(data, 'num_classes', '?')} classes): {problem}")
    model.load_state_dict(weights_of(run, use_ema))
    model = model.to(device)
    metrics = _EvalRunner(options, device, data, task).run(model)
    if options.eval.sets:
        from moh_vision.engine.fit_setup import amp_context
        from .released import evaluate_sets
        metrics.update(evaluate_sets(model, options, data.val, data.val.transform, device,
                                     amp_context(options.eval.amp, device)))
    step = int(state.get("step") or 0)
    loggers = make_loggers(options.logger, None, out_dir, True, {"eval": OmegaConf.to_container(cfg, resolve=True)},
                           None, "eval")
    # the task's end-of-run work on these weights (diffusion: a sample grid and the sample metrics)
    metrics.update(task.on_epoch_end(EpochContext(
        epoch=int(state.get("epoch") or 0), step=step, last_epoch=True, is_main=True, device=device, out_dir=out_dir,
        model_for_eval=model.eval(), log_image=lambda *args, **kwargs: loggers.log_image(*args, step=step, **kwargs))))
    summary = {"checkpoint": str(used), "use_ema": use_ema, "weights": "ema" if use_ema else "model",
               "ema_available": has_ema, "model": container["model"]["name"],
               "params": sum(p.numel() for p in model.parameters()), "step": state.get("step"), **metrics}
    write_json(out_dir / "summary.json", summary)
    OmegaConf.save(OmegaConf.create({"eval": OmegaConf.to_container(cfg, resolve=True), "trained": container}),
                   out_dir / "config.yaml")
    loggers.log_epoch({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
    loggers.finish(summary=summary)
    log.info("%s", ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
    return summary


class _EvalRunner:
    """The bits of the trainer that evaluation needs: a val loader, AMP, and the task's metrics."""

    def __init__(self, options: EvalConfig, device: torch.device, data, task):
        from torch.utils.data import DataLoader

        from moh_vision.engine.fit_setup import amp_context
        self.device, self.data, self.task = device, data, task
        self.loader = DataLoader(data.val, batch_size=options.eval.batch_size, shuffle=False,
                                 num_workers=options.eval.num_workers, collate_fn=data.collate_fn)
        self.amp = amp_context(options.eval.amp, device)

    def run(self, model) -> Dict[str, Any]:
        sums = self.task.evaluate(model, self.loader, self.device, amp=self.amp)
        return self.task.finalize(sums, prefix="val")
