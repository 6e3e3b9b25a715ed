"""The run directory under stress (issue 32): a rank stopped mid-epoch under DDP, a full or read-only
disk, two runs on one directory, a resume with other options, unreadable images under DDP, and
constructor arguments given twice. Each ends exactly as an uninterrupted run, or in one ``error:`` line."""
import csv
import errno
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from helpers import ATTENTION_PRESET, model_config, trainer_config
from step_waits import counting_trainer, waits_outside
from moh_vision import checkpoints as ckpt_io
from moh_vision.config import ConstantSched, OptimConfig
from moh_vision.engine.bookkeeping import MEASURED
from moh_vision.engine.distributed import DistInfo
from moh_vision.engine.loggers import Loggers
from moh_vision.engine.trainer import Preempted, Trainer
from moh_vision.errors import ConfigError, RunError
from moh_vision.tasks.classification import ClassificationTask

# Deterministic, small, checkpoint every 2 steps (the digits: 1438 training images, 11 steps of 128), the ViT cut to 2
# blocks (the runs' behaviour is the subject, not the model).
RUN = ("trainer.deterministic=true", "trainer.progress=false", "trainer.num_workers=0", "trainer.epochs=1",
       "trainer.batch_size=128", "trainer.count_flops=false", "trainer.ckpt_every_steps=2", "model=plain_vit_nano",
       "+model.kwargs.depth=2", "data.img_size=16")
VIT = {"kwargs": {"depth": 2}}
MOH = {"name": "moh", "aux_loss_weight": 0.01, "activation_ratio": 0.5}


def vit_task(attention=MOH) -> ClassificationTask:
    return ClassificationTask(model_config("plain_vit_nano", **VIT), attention)


LOCK_NAME = ".run.lock"


def epoch_rows(out_dir: Path):
    """metrics.csv's epoch rows (those with validation), without the wall-clock columns."""
    rows = [r for r in csv.DictReader(open(out_dir / "metrics.csv")) if r.get("val/acc1")]
    return [{k: v for k, v in r.items() if k.rpartition("/")[2] not in MEASURED} for r in rows]


# ----------------------------------------------------------------------------------------------
# DDP: 2 gloo processes, in this test's own spawn
# ----------------------------------------------------------------------------------------------
class StopOnRank1(Trainer):
    """A trainer whose rank 1 receives SIGTERM (as a preempted or dying worker does) after ``signal_at`` steps:
    every rank stops one step later (the flag's all-reduce is read a step after it was issued)."""

    signal_at = 3

    def _optimizer_step(self, finite):
        norm = super()._optimizer_step(finite)
        if self.dist.rank == 1 and self.step == self.signal_at:
            self.signals.received = "SIGTERM"
        return norm


def _fit(out_dir, dist, task, data, trainer_class=Trainer, **overrides):
    cfg = trainer_config(**{"epochs": 1, "batch_size": 128, "log_every": 2, "ckpt_every_steps": 2,
                            "deterministic": True, **overrides})
    config = {"attention": dict(task.attention_cfg), "model": dict(task.model_cfg)}
    out_dir.mkdir(exist_ok=True)
    trainer = trainer_class(cfg, out_dir, dist, Loggers(out_dir, enabled=dist.is_main), optim=OptimConfig(lr=1e-3),
                            sched=ConstantSched(warmup_epochs=0), config=config, seed=0)
    trainer.fit(task, data)
    return trainer


class NaNLossOnRank1(ClassificationTask):
    """Classification whose loss is NaN on rank 1 alone at its 4th and 5th steps, by a constant term: its
    gradients stay finite, and only the skip decision keeps the ranks' weights equal."""

    def __init__(self, rank: int):
        super().__init__(model_config("plain_vit_nano", **VIT), MOH)
        self.rank, self.calls = rank, 0

    def training_step(self, model, batch, device):
        out = super().training_step(model, batch, device)
        self.calls += 1
        if self.rank == 1 and self.calls in (4, 5):
            out["loss"] = out["loss"] + float("nan")
        return out


def _image_tree(root: Path) -> None:
    """3 classes of 6 images per split, and unreadable files: 4 in train, 1 in val (met by rank 1)."""
    for split in ("train", "val"):
        for c in range(3):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(6):
                Image.new("RGB", (36, 36), (40 * c + 20, 200 - 30 * c, 17 * i)).save(folder / f"img{i}.png")
    for c in range(3):
        (root / "train" / f"class{c}" / f"broken{c}.jpg").write_bytes(b"not a jpeg")
    (root / "train" / "class1" / "broken9.jpg").write_bytes(b"not a jpeg")
    (root / "val" / "class2" / "zbroken.jpg").write_bytes(b"not a jpeg")  # the last val file: rank 1's


def _ddp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as tdist

    from moh_vision.data.digits import DigitsData
    from moh_vision.data.imagefolder import ImageFolderData

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dist, out = DistInfo(rank=rank, world_size=world), Path(out)
    handler = logging.FileHandler(out / "train.log")  # both ranks write the run's log, as under torchrun
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        digits = DigitsData(img_size=16)
        task = lambda: vit_task(MOH)  # noqa: E731
        tables = []
        _fit(out / "whole", dist, task(), digits, trainer_class=counting_trainer(Trainer, tables))
        (out / f"waits_rank{rank}.json").write_text(json.dumps(tables[0]))
        nan = _fit(out / "nan_on_rank1", dist, NaNLossOnRank1(rank), digits, max_steps=6, ckpt_every_steps=0)
        weights = sum(float(p.double().sum()) for p in nan.parts.model.parameters())
        (out / f"nan_rank{rank}.json").write_text(json.dumps({"counters": nan.counters, "weights": weights}))
        try:
            _fit(out / "stopped", dist, task(), digits, trainer_class=StopOnRank1)
        except Preempted:
            if dist.is_main:  # kept for the tests: last.pt moves on
                shutil.copy(out / "stopped" / "checkpoints" / "last.pt", out / "mid_epoch.pt")
        _fit(out / "stopped", dist, task(), digits)
        images = ImageFolderData(root=str(out / "images"), img_size=32, repeated_aug=1, mixup=None, cutmix=None,
                                 auto_augment=None, re_prob=None)
        _fit(out / "images_run", dist, vit_task(ATTENTION_PRESET), images, epochs=2, batch_size=4, ckpt_every_steps=0)
    finally:
        handler.close()
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Both ranks of: an uninterrupted epoch (its host reads and collectives counted per step); 6 steps of which
    two have a NaN loss on rank 1; the same epoch stopped at step 4 by SIGTERM on rank 1, then resumed; two
    epochs on images of which 5 are unreadable."""
    out = tmp_path_factory.mktemp("ddp")
    _image_tree(out / "images")
    # forked, not spawned: the two ranks are processes of their own from the start, without 5 s each of importing
    # torch, timm and the tests again
    torch.multiprocessing.start_processes(_ddp_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True,
                                          start_method="fork")
    return out


def test_ddp_resumed_epoch_equals_the_uninterrupted_one(ddp_runs):
    whole, resumed = epoch_rows(ddp_runs / "whole"), epoch_rows(ddp_runs / "stopped")
    assert len(whole) == len(resumed) == 1
    assert "train/epoch_loss" in whole[0] and any(k.startswith("routing/") for k in whole[0])
    assert resumed == whole, "every logged number of the resumed epoch (losses, routing, validation)"
    state = torch.load(ddp_runs / "mid_epoch.pt", weights_only=True)
    assert state["step"] == 4 and [m["sums"]["count"] for m in state["meters"]] == [4 * 64.0, 4 * 64.0]


def test_ddp_steps_do_not_wait(ddp_runs):
    """Outside log and checkpoint steps (every 2nd): no host read, and one collective a step (the preemption
    flag), issued asynchronously and waited on at a later step."""
    for rank in (0, 1):
        table = json.loads((ddp_runs / f"waits_rank{rank}.json").read_text())
        assert waits_outside(table, 1, 10, every=2) == [], rank
        assert [len(table[str(s)]["collectives"]) for s in (1, 3, 5, 7, 9)] == [1] * 5


def test_ddp_a_nan_loss_on_one_rank_skips_the_step_on_both(ddp_runs):
    ranks = [json.loads((ddp_runs / f"nan_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["counters"]["nonfinite_skipped"] for r in ranks] == [2, 2]
    assert [r["counters"]["nonfinite_in_a_row"] for r in ranks] == [0, 0], "the 6th step went on"
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_ddp_skipped_files_are_named_once(ddp_runs):
    summary = json.loads((ddp_runs / "images_run" / "summary.json").read_text())
    assert summary["train/skipped_images"] == 4 and summary["val/skipped_images"] == 1
    named = [line for line in (ddp_runs / "train.log").read_text().splitlines() if "skipped unreadable" in line]
    files = sorted(line.split(" image ")[1].split(" (")[0].rsplit("/", 1)[1] for line in named)
    assert files == ["broken0.jpg", "broken1.jpg", "broken2.jpg", "broken9.jpg", "zbroken.jpg"]


def test_world_size_change_mid_epoch_is_refused(ddp_runs, tmp_path):
    """A checkpoint saved mid-epoch by 2 processes does not resume in 1: the epoch's order depends on them."""
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(ddp_runs / "mid_epoch.pt", tmp_path / "checkpoints" / "last.pt")
    from moh_vision.data.digits import DigitsData
    with pytest.raises(ConfigError, match="saved mid-epoch .* by 2 processes and this run has 1"):
        _fit(tmp_path, DistInfo(), vit_task(MOH), DigitsData(img_size=16))


# ----------------------------------------------------------------------------------------------
# Writes that fail: full disk, read-only, a file in the way
# ----------------------------------------------------------------------------------------------
class _FullDisk(io.RawIOBase):
    """A file on a disk with ``budget[0]`` bytes left (shared by every file opened on it)."""

    def __init__(self, file, budget):
        self.file, self.budget = file, budget

    def writable(self):
        return True

    def write(self, data):
        if self.budget[0] < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget[0] -= len(data)
        return self.file.write(data)

    def fileno(self):
        return self.file.fileno()

    def close(self):
        self.file.close()
        super().close()


def test_full_disk_names_the_cause_and_keeps_the_previous_checkpoint(tmp_path, train_in_process, monkeypatch):
    assert train_in_process(*RUN, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'sized'}")[0] == 0
    size = (tmp_path / "sized" / "checkpoints" / "last.pt").stat().st_size
    budget, real_fdopen = [size + (256 << 10)], os.fdopen  # room for the step-2 checkpoint, not for step 4's
    monkeypatch.setattr(ckpt_io.os, "fdopen", lambda fd, mode="r", *a, **k: io.BufferedWriter(
        _FullDisk(real_fdopen(fd, "wb", buffering=0), budget)) if mode == "wb" else real_fdopen(fd, mode, *a, **k))
    run_dir = tmp_path / "full"
    code, stderr = train_in_process(*RUN, "trainer.max_steps=4", f"hydra.run.dir={run_dir}")
    monkeypatch.undo()
    last_line = stderr.strip().splitlines()[-1]
    assert code == 1 and last_line.startswith("error: could not write checkpoint"), stderr[-2000:]
    assert "No space left on device" in last_line and "previous checkpoint is intact" in last_line
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    assert not list((run_dir / "checkpoints").glob(".*.tmp")), "nothing half-written"
    assert not (run_dir / LOCK_NAME).exists(), "the lock goes with the run"


def test_full_disk_while_logging_leaves_no_half_row(tmp_path, monkeypatch):
    from moh_vision.engine import loggers
    metrics = loggers.CSVMetrics(tmp_path / "metrics.csv")
    metrics.log({"step": 1, "train/loss": 2.5})
    before = (tmp_path / "metrics.csv").read_bytes()

    def full_disk_open(path, mode="r", *args, **kwargs):  # the disk fills after the row's first bytes
        f = open(path, mode, *args, **kwargs)
        write = f.write
        f.write = lambda data: (write(data[:3]), f.flush(), _raise(OSError(errno.ENOSPC, "No space left on device")))
        return f
    monkeypatch.setattr(loggers, "open", full_disk_open, raising=False)
    with pytest.raises(RunError, match=r"could not write metrics file .* \(No space left on device\)"):
        metrics.log({"step": 2, "train/loss": 2.25})
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_bytes() == before


def _raise(err):
    raise err


def test_read_only_run_directory_is_one_error_line(tmp_path, train_in_process, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):  # what a read-only mount answers (chmod does not stop root)
        if str(path).startswith(str(run_dir) + os.sep):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", read_only)
    code, stderr = train_in_process(*RUN, f"hydra.run.dir={run_dir}")
    monkeypatch.undo()
    lines = stderr.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: ") and "Read-only file system" in lines[-1], stderr[-2000:]
    assert "Traceback" not in stderr


def test_run_directory_that_is_a_file_is_one_error_line(tmp_path, train_in_process):
    path = tmp_path / "run"
    path.write_text("a file")
    code, stderr = train_in_process(*RUN, f"hydra.run.dir={path}")
    assert code == 2 and stderr.strip().splitlines()[-1] == f"error: {path} is a file, not a directory", stderr[-2000:]
    from moh_vision.checkpoints import RunLock
    with pytest.raises(ConfigError, match=r"cannot use the run directory .*: .* is a file, not a directory"):
        RunLock(path / "inner").acquire()


# ----------------------------------------------------------------------------------------------
# One run per directory
# ----------------------------------------------------------------------------------------------
def _lock_of(pid: int, host: str = None) -> str:
    return json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "2026-01-01 00:00:00 UTC"})


def test_second_run_on_a_live_runs_directory_stops_naming_it(tmp_path, train_in_process):
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a live run's process
    try:
        (tmp_path / LOCK_NAME).write_text(_lock_of(first.pid))
        code, stderr = train_in_process(*RUN, f"hydra.run.dir={tmp_path}")
    finally:
        first.kill()
        first.wait()
    last_line = stderr.strip().splitlines()[-1]
    assert code == 2 and last_line.startswith("error: another run is using") and f"pid {first.pid}" in last_line
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == first.pid, "the first run's lock is kept"
    (tmp_path / LOCK_NAME).write_text(_lock_of(first.pid, host="elsewhere"))  # another host's: cannot be checked
    from moh_vision.checkpoints import RunLock
    with pytest.raises(ConfigError, match="pid .* on elsewhere.*if that run is gone, delete the lock"):
        RunLock(tmp_path).acquire()


def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path, train_in_process):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # a run that crashed: its pid is gone
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(_lock_of(dead.pid))
    assert train_in_process(*RUN, "trainer.max_steps=1", f"hydra.run.dir={tmp_path}")[0] == 0
    log = (tmp_path / "train.log").read_text()
    assert "taking over the lock of a run that is gone" in log and f"pid {dead.pid}" in log
    assert not (tmp_path / LOCK_NAME).exists(), "released on exit"


# ----------------------------------------------------------------------------------------------
# A resumed run's options
# ----------------------------------------------------------------------------------------------
def test_extending_a_finished_run_is_explicit_and_keeps_every_config(tmp_path, train_in_process):
    args = (*RUN, "trainer.max_steps=3", "sched=cosine", f"hydra.run.dir={tmp_path}")
    assert train_in_process(*args)[0] == 0
    first_config = (tmp_path / "config.yaml").read_text()
    code, stderr = train_in_process(*args, "trainer.epochs=2", "trainer.max_steps=5")
    last_line = stderr.strip().splitlines()[-1]
    assert code == 2 and "trainer.extend=true" in last_line and "trainer.max_steps: 3 -> 5" in last_line
    assert "trainer.epochs: 1 -> 2" in last_line
    assert (tmp_path / "config.yaml").read_text() == first_config, "a refused resume writes nothing"
    assert train_in_process(*args, "trainer.epochs=2", "trainer.max_steps=5", "trainer.extend=true")[0] == 0
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 5
    history = sorted(p.name for p in (tmp_path / "config_history").iterdir())
    assert history == ["0_step0.yaml", "1_step3.yaml"]
    assert (tmp_path / "config_history" / "0_step0.yaml").read_text() == first_config
    extended = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert extended["trainer"]["max_steps"] == 5 and extended["trainer"]["extend"] is True
    log = (tmp_path / "train.log").read_text()
    assert "trainer.max_steps: 3 -> 5" in log and "the learning rate goes from" in log
    # options that do not change the training are free to change, and are recorded too
    assert train_in_process(*args, "trainer.epochs=2", "trainer.max_steps=5", "trainer.log_every=3")[0] == 0
    assert len(list((tmp_path / "config_history").iterdir())) == 3


# ----------------------------------------------------------------------------------------------
# Constructor arguments
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,fragment", [
    ("+model.kwargs.num_classes=1000", "model.kwargs.num_classes is set by task=classification itself"),
    ("+model.kwargs.attention=mha", "model.kwargs.attention has its own option: give attention=<name>"),
])
def test_constructor_arguments_are_checked_before_anything_is_written(tmp_path, train_in_process, override,
                                                                       fragment):
    code, stderr = train_in_process(*RUN, override, f"hydra.run.dir={tmp_path}")
    assert code == 2 and fragment in stderr.strip().splitlines()[-1], stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra"], "no train.log, lock or checkpoint"
