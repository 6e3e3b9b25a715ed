"""The run directory's own rules: its name in a SLURM job (:func:`run_name`), one run at a time (:class:`RunLock`),
what a resumed run may change in its config (:func:`config_changes`), and the record of every config the run was trained
with (:func:`record_config`)."""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import yaml

from moh_vision.checkpoints import atomic_write
from moh_vision.config import slurm_job
from moh_vision.errors import ConfigError, storage_problem

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
HISTORY_DIR = "config_history"

# Options a resumed run may change freely: they change how a run is executed, logged or checkpointed, not its weights,
# optimizer, schedule or data order. Any other change needs trainer.extend=true.
FREE_TO_CHANGE = (
    "trainer.resume", "trainer.extend", "trainer.progress", "trainer.log_every", "trainer.ckpt_every_steps",
    "trainer.num_workers", "trainer.val_every_epochs", "trainer.val_batch_size", "trainer.val_at_start",
    "trainer.count_flops", "trainer.requeue_on_preempt", "trainer.dist_timeout_s", "trainer.throughput_warmup_steps",
    "trainer.max_nonfinite_in_a_row", "trainer.device", "trainer.compile", "trainer.compile_mode", "trainer.tf32",
    "trainer.grad_checkpointing", "logger", "tag",
    "model.checkpoint_path", "model.init_from", "data.root", "task.sample", "task.vae",
    "trainer.ckpt_history_every_steps", "trainer.ckpt_history_every_epochs", "trainer.ckpt_keep", "trainer.profile",
    "data.index_cache", "trainer.ddp.broadcast_buffers", "trainer.ddp.gradient_as_bucket_view",
    "trainer.ddp.bucket_cap_mb", "trainer.ckpt_async",
)

# Options added after runs were saved without them, with the value that keeps the training as it was then: a config
# without one (a checkpoint of an earlier release) is compared as if it held that value.
ADDED_LATER = {"optim.momentum": 0.9, "optim.layer_decay": None, "optim.kwargs": {}, "sched.cooldown_epochs": 0,
               "data.source": "auto", "data.class_order": "sorted", "data.class_map": None, "data.val_labels": None}


# -- One run per directory ---------------------------------------------------------------------------------------------
class RunLock:
    """``<run dir>/.run.lock``, holding the owner's pid, host, start time and SLURM job, while a run trains there
    (``with RunLock(dir):``). A second run on the directory stops with a :class:`ConfigError` naming the first; a lock
    whose process is gone (same host, dead pid) is taken over with a warning, and so is one left by an earlier run of
    this SLURM job on any host (killed with its node, then requeued); a lock from another host and job cannot be checked
    (the error says how to remove it). Creating the lock is the run's first write: an unwritable directory fails here,
    by its cause."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK_NAME
        self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "slurm_job": slurm_job()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(3):  # a stale lock is removed, then taken like a free one
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    self._remove_stale(me["host"], me["slurm_job"])
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                self.held = True
                return
        except OSError as err:
            raise ConfigError(f"cannot use the run directory {self.path.parent}: {storage_problem(err)}") from None
        raise ConfigError(f"cannot take the lock {self.path}: other runs keep taking it")

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.held and (self._owner() or {}).get("pid") == os.getpid():
            try:
                self.path.unlink()
            except OSError as err:
                log.warning("could not remove the run lock (%s)", storage_problem(err))
        self.held = False

    def _owner(self) -> Optional[Dict[str, Any]]:
        try:
            owner = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or damaged: nobody can say whose it is
        return owner if isinstance(owner, dict) else {}

    def _remove_stale(self, host: str, job: Optional[str]) -> None:
        owner = self._owner()
        if owner is None:  # released meanwhile
            return
        pid, where, owner_job = owner.get("pid"), owner.get("host"), owner.get("slurm_job")
        here = where == host and isinstance(pid, int)
        same_job = job is not None and owner_job == job  # a requeued job: its earlier run is gone, wherever it ran
        if (here or same_job) and not (here and _alive(pid)):
            why = f"an earlier run of SLURM job {job}" if same_job else "a run that is gone"
            log.warning("taking over the lock of %s (pid %s on %s, started %s): %s", why, pid, where,
                        owner.get("started", "?"), self.path)
            self.path.unlink(missing_ok=True)
            return
        of_job = f", SLURM job {owner_job}" if owner_job else ""
        who = f"pid {pid} on {where}{of_job}, started {owner.get('started', '?')}" if owner else "an unreadable lock"
        check = "" if where == host else "; if that run is gone, delete the lock"
        raise ConfigError(f"another run is using {self.path.parent} ({who}): use another output directory "
                          f"(hydra.run.dir=...) or wait for it to finish{check} ({self.path})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# -- A resumed run's config --------------------------------------------------------------------------------------------
def _flat(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _free(key: str) -> bool:
    return any(key == free or key.startswith(free + ".") for free in FREE_TO_CHANGE)


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """``key: old -> new`` of each option (but :data:`FREE_TO_CHANGE`) that differs between a saved config and this."""
    old, new = ({**ADDED_LATER, **_flat(config)} for config in (saved, current))
    keys = sorted(k for k in set(old) | set(new) if not _free(k) and old.get(k) != new.get(k))
    return [f"{k}: {_text(old.get(k))} -> {_text(new.get(k))}" for k in keys]


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def record_config(out_dir: Path, config: Dict[str, Any], step: int) -> None:
    """Write ``config.yaml``: the config the run trains with now. When it replaces a different one (a resume with
    changed options), both stay in ``config_history/<n>_step<first step>.yaml``."""
    current = Path(out_dir) / "config.yaml"
    previous = yaml.safe_load(current.read_text()) if current.is_file() else None
    if previous is not None and previous != config:
        history = Path(out_dir) / HISTORY_DIR
        count = len(list(history.glob("*_step*.yaml")))
        if count == 0:  # the run's first config, trained from step 0
            _write_yaml(history / "0_step0.yaml", previous)
            count = 1
        _write_yaml(history / f"{count}_step{step}.yaml", config)
    _write_yaml(current, config)


def _write_yaml(path: Path, config: Dict[str, Any]) -> None:
    from omegaconf import OmegaConf
    text = OmegaConf.to_yaml(OmegaConf.create(config))
    atomic_write(path, lambda f: f.write(text.encode()), what="config")
