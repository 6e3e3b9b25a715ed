"""Checkpoints that scale (issue 57, items 6 and 10): one serialisation per save event (the further names are hard
links of the file written, copies where links fail), loads that map the file and read it once on resume, writes in a
background thread from a host copy (``trainer.ckpt_async``) with the same guarantees, and no temporary file left in
the run directory by a process killed inside any atomic write."""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, TORCHRUN, Forked, read_summary, run_entry, torchrun
from moh_vision import checkpoints as ckpt_io
from moh_vision.checkpoints import CheckpointHistory
from test_reliability import ENV, assert_same_run, wait_for_step

pytestmark = pytest.mark.usefixtures("one_thread")

# 1438 digits at 256 a step: 5 steps an epoch; a checkpoint every step; the ViT cut to 2 blocks (a third of the work)
SMALL = ("model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16", "trainer.batch_size=256",
         "trainer.epochs=2", "trainer.deterministic=true", "trainer.ckpt_every_steps=1", "trainer.log_every=1",
         "trainer.progress=false", "trainer.num_workers=0", "trainer.count_flops=false", "logger=csv")
SLOW_WRITE = str(REPO / "tests" / "slow_write.py")


def temporaries(run_dir: Path):
    return sorted(p for p in Path(run_dir).rglob(".*.tmp"))


def a_state(seed: int = 0):
    torch.manual_seed(seed)
    weight = torch.randn(8, 4)
    model = {"w": weight, "w_t": weight.t(), "b": torch.zeros(8)}  # a view: saved once, loaded as a view
    return {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.randn(8, 4)}}, "param_groups": [{"lr": 0.1}]},
            "step": 3, "config": {"model": {"name": "x"}}}


# ---- one serialisation, further names as links ---------------------------------------------------------------------
def test_one_write_several_names_linked(tmp_path, monkeypatch):
    saves = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (saves.append(1), real_save(*a, **k))[1])
    last, step, best = tmp_path / "last.pt", tmp_path / "step_0000003.pt", tmp_path / "best.pt"
    ckpt_io.atomic_save(a_state(), last, keep_previous=True, also=[step, best])
    assert len(saves) == 1
    assert os.stat(last).st_ino == os.stat(step).st_ino == os.stat(best).st_ino
    assert os.stat(last).st_nlink == 3 and temporaries(tmp_path) == []
    ckpt_io.atomic_save(a_state(1), last, keep_previous=True)  # a new last.pt: the old file keeps its other names
    assert os.stat(step).st_ino == os.stat(best).st_ino == os.stat(ckpt_io.previous_path(last)).st_ino
    assert os.stat(last).st_ino != os.stat(step).st_ino
    assert torch.equal(ckpt_io.load_file(best)["model"]["w"], a_state(0)["model"]["w"])
    assert torch.equal(ckpt_io.load_file(last)["model"]["w"], a_state(1)["model"]["w"])


def test_where_links_fail_the_names_are_copies(tmp_path, monkeypatch):
    def no_links(*args):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "link", no_links)
    last, step = tmp_path / "last.pt", tmp_path / "sub" / "step_0000003.pt"
    ckpt_io.atomic_save(a_state(), last, also=[step])
    assert os.stat(last).st_ino != os.stat(step).st_ino and last.read_bytes() == step.read_bytes()
    assert temporaries(tmp_path) == []


def test_retention_removes_a_name_not_the_file_behind_it(tmp_path):
    history = CheckpointHistory(tmp_path, every_steps=1, keep=1)
    for step in (1, 2, 3):
        ckpt_io.atomic_save(a_state(step), tmp_path / "last.pt", keep_previous=True,
                            also=[tmp_path / f"step_{step:07d}.pt"] + ([tmp_path / "best.pt"] if step == 1 else []))
        time.sleep(0.01)  # newest by modification time
        history.prune()
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["best.pt", "last.prev.pt", "last.pt", "step_0000003.pt"]
    for name, step in (("best.pt", 1), ("last.prev.pt", 2), ("last.pt", 3), ("step_0000003.pt", 3)):
        assert torch.equal(ckpt_io.load_file(tmp_path / name)["model"]["w"], a_state(step)["model"]["w"]), name


def test_a_run_serialises_each_save_event_once(tmp_path, train_in_process, monkeypatch):
    saves = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (saves.append(obj.get("step")),
                                                                real_save(obj, f, *a, **k))[1])
    code, err = train_in_process(*SMALL, "trainer.epochs=1", "trainer.ckpt_history_every_steps=1",
                                 "trainer.ckpt_keep=2", f"hydra.run.dir={tmp_path}")
    assert code == 0, err
    # a save after each step (last.pt and step_N.pt), and the epoch's end (last.pt and best.pt): one serialisation each
    assert saves == [1, 2, 3, 4, 5, 5]
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["best.pt", "last.prev.pt", "last.pt", "step_0000004.pt",
                                                           "step_0000005.pt"]
    assert os.stat(folder / "last.pt").st_ino == os.stat(folder / "best.pt").st_ino
    assert os.stat(folder / "last.prev.pt").st_ino == os.stat(folder / "step_0000005.pt").st_ino
    assert ckpt_io.load_file(folder / "step_0000004.pt")["step"] == 4 and temporaries(tmp_path) == []


# ---- loads: mapped, once ---------------------------------------------------------------------------------------------
def mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of ``path`` (this process's /proc/self/maps)."""
    address, real = tensor.data_ptr(), os.path.realpath(path)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == real:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_loads_map_the_file_and_legacy_files_still_load(tmp_path):
    path = tmp_path / "c.pt"
    ckpt_io.atomic_save(a_state(), path)
    loaded = ckpt_io.load_file(path)
    assert mapped_from(loaded["model"]["w"], path), "the tensor's memory is a mapping of the file"
    assert loaded["model"]["w_t"].untyped_storage().data_ptr() == loaded["model"]["w"].untyped_storage().data_ptr()
    legacy = tmp_path / "legacy.pt"
    torch.save(a_state(), legacy, _use_new_zipfile_serialization=False)  # mmap needs the zip format
    assert torch.equal(ckpt_io.load_file(legacy)["model"]["w"], a_state()["model"]["w"])


def test_a_resume_reads_the_checkpoint_once(tmp_path, train_in_process, monkeypatch):
    code, err = train_in_process(*SMALL, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")
    assert code == 0, err
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: (loads.append((Path(f).name, k.get("mmap")))
                                                           if str(f).startswith(str(tmp_path)) else None,
                                                           real_load(f, *a, **k))[1])
    code, err = train_in_process(*SMALL, "trainer.max_steps=3", "trainer.extend=true", f"hydra.run.dir={tmp_path}")
    assert code == 0, err
    assert loads == [("last.pt", True)], "one load for the wandb run id and the state, mapped"
    assert read_summary(tmp_path)["steps"] == 3


# ---- the background writer -------------------------------------------------------------------------------------------
def test_a_host_copy_saves_the_same_file(tmp_path):
    state = a_state()
    ckpt_io.atomic_save(state, tmp_path / "a.pt")
    copied = ckpt_io.host_copy(state)
    state["model"]["w"].add_(1.0)  # training goes on: the copy is not the live tensors
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    ckpt_io.atomic_save(copied, tmp_path / "b.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_a_writer_error_is_raised_at_the_next_save_or_wait():
    writer = ckpt_io.BackgroundWriter(threaded=True)

    def fail():
        raise ckpt_io.CheckpointWriteError("could not write checkpoint x (No space left on device)")
    writer.submit(fail)
    with pytest.raises(ckpt_io.CheckpointWriteError, match="No space left"):
        writer.submit(lambda: None)
    writer.submit(fail)
    with pytest.raises(ckpt_io.CheckpointWriteError):
        writer.wait()
    writer.wait()  # raised once


def test_async_checkpoints_equal_sync_ones(tmp_path, train_in_process):
    for mode in ("false", "true"):
        code, err = train_in_process(*SMALL, "trainer.epochs=1", "trainer.ckpt_history_every_steps=2",
                                     f"trainer.ckpt_async={mode}", f"hydra.run.dir={tmp_path / mode}")
        assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "false" / "checkpoints").glob("*.pt"))
    assert names == sorted(p.name for p in (tmp_path / "true" / "checkpoints").glob("*.pt"))
    for name in names:
        sync, done = (ckpt_io.load_file(tmp_path / mode / "checkpoints" / name) for mode in ("false", "true"))
        assert sync.keys() == done.keys()
        assert all(sync[k] == done[k] for k in ("step", "epoch", "batch_in_epoch", "best", "counters")), name
        for part in ("model", "optimizer"):
            flat_sync, flat_done = _tensors(sync[part]), _tensors(done[part])
            assert flat_sync.keys() == flat_done.keys()
            assert all(torch.equal(flat_sync[k], flat_done[k]) for k in flat_sync), (name, part)
    assert temporaries(tmp_path) == []


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def test_an_async_write_that_fails_stops_the_run_with_its_error(tmp_path, train_in_process):
    from test_reliability import _limit_file_size
    assert train_in_process(*SMALL, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")[0] == 0
    size = (tmp_path / "checkpoints" / "last.pt").stat().st_size
    proc = Forked([REPO / "train.py", *SMALL, "trainer.max_steps=4", "trainer.extend=true", "trainer.ckpt_async=true",
                   f"hydra.run.dir={tmp_path}"], env=ENV, preexec=_limit_file_size(size // 2), stderr=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: could not write checkpoint") and "File too large" in last_line
    assert ckpt_io.load_file(tmp_path / "checkpoints" / "last.pt")["step"] == 2, "the previous checkpoint is intact"
    assert temporaries(tmp_path) == []


# ---- a kill inside a write -------------------------------------------------------------------------------------------
def test_partial_writes_anywhere_in_the_run_directory_are_found(tmp_path):
    made = [tmp_path / ".routing.json.k2x_9a.tmp", tmp_path / "checkpoints" / ".step_0000004.pt.1f2e3d4c.tmp",
            tmp_path / "profile" / ".trace_steps1-2_rank0.json.tmp", tmp_path / "samples" / "e1" / ".grid.png.ab.tmp"]
    kept = [tmp_path / "notes.tmp", tmp_path / "wandb" / ".run.wandb.x1.tmp", tmp_path / "checkpoints" / "last.pt",
            tmp_path / ".git" / ".index.ab12.tmp"]
    for path in made + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    removed = ckpt_io.remove_partial_writes(tmp_path, recursive=True, skip=("wandb",))
    assert sorted(removed) == sorted(made) and all(p.exists() for p in kept)


def kill_inside(target, occurrence, args, run_dir: Path, timeout=300):
    """train.py with the ``occurrence``-th write of ``target`` stalled half-way, SIGKILLed there."""
    marker = run_dir.parent / f"{run_dir.name}.{target}.stalled"
    proc = Forked([SLOW_WRITE, target, occurrence, marker, REPO / "train.py", *args, f"hydra.run.dir={run_dir}"],
                  env=ENV)
    end = time.time() + timeout
    while not marker.exists() and proc.poll() is None and time.time() < end:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert marker.exists(), f"the write of {target} never came\n{out[-3000:]}"
    return out


@pytest.mark.parametrize("target,occurrence,extra", [("routing.json", 1, ())], ids=["routing.json"])
def test_a_kill_inside_a_write_leaves_nothing_after_the_resume(tmp_path, target, occurrence, extra, train_in_process):
    args = (*(a for a in SMALL if not a.startswith("trainer.batch_size=")), "trainer.batch_size=512", *extra)  # 4 steps
    run = tmp_path / "killed"
    kill_inside(target, occurrence, args, run)
    left = temporaries(run)
    assert len(left) == 1 and left[0].name.startswith(f".{target}."), "the scenario: the write's temporary file"
    assert train_in_process(*args, f"hydra.run.dir={run}")[0] == 0  # the resume: in this process
    assert f"removed {left[0]}, left by" in (run / "train.log").read_text()
    assert temporaries(run) == []
    assert read_summary(run)["steps"] == 4  # (its weights equal an uninterrupted run's: test_reliability)


@pytest.mark.slow
@pytest.mark.parametrize("target,occurrence,extra", [
    ("config.yaml", 1, ()), ("last.pt", 2, ("trainer.ckpt_async=false",)), ("last.pt", 3, ("trainer.ckpt_async=true",)),
    ("routing.json", 2, ("trainer.ckpt_history_every_steps=1", "trainer.ckpt_keep=2"))],
    ids=["config.yaml", "last.pt-sync", "last.pt-async", "routing.json-history"])
def test_kills_inside_other_writes_leave_nothing_after_the_resume(tmp_path, target, occurrence, extra,
                                                                  train_in_process):
    test_a_kill_inside_a_write_leaves_nothing_after_the_resume(tmp_path, target, occurrence, extra, train_in_process)


# ---- many ranks ------------------------------------------------------------------------------------------------------
TWO_RANKS = (*TORCHRUN, "--nproc_per_node=2")
RANKS = ("model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16", "trainer.batch_size=128",
         "trainer.epochs=1", "trainer.max_steps=6", "trainer.deterministic=true", "trainer.ema.enabled=true",
         "trainer.ema.decay=0.9", "trainer.log_every=1", "trainer.progress=false", "trainer.num_workers=0",
         "trainer.count_flops=false", "logger=csv")


@pytest.mark.slow  # three torchrun runs (agents forked, the 2-block ViT): 28 s on the 2-core VM
def test_two_ranks_resume_with_ema_from_an_async_checkpoint(tmp_path):
    """Two gloo ranks, the EMA on: a run preempted by SIGUSR1 (its last checkpoint written in the background, waited
    for before the exit) and resumed, asynchronous throughout, ends where an uninterrupted synchronous run ends."""
    ref = tmp_path / "uninterrupted"
    run_entry("train.py", *RANKS, "trainer.ckpt_async=false", f"hydra.run.dir={ref}", launcher=TWO_RANKS, fork=True)
    run = tmp_path / "preempted"
    args = (*RANKS, "trainer.ckpt_async=true", "trainer.ckpt_every_steps=2", f"hydra.run.dir={run}")
    agent = torchrun(*TWO_RANKS[3:], "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", REPO / "train.py",
                     *args, env=ENV)
    wait_for_step(agent, run, 2)
    agent.send_signal(signal.SIGUSR1)
    out, _ = agent.communicate(timeout=300)
    assert out.count("stopped by SIGUSR1 at step") == 2, out[-4000:]
    stopped = ckpt_io.load_file(run / "checkpoints" / "last.pt")
    assert 2 <= stopped["step"] < 6 and stopped["world_size"] == 2 and "model_ema" in stopped
    run_entry("train.py", *args, launcher=TWO_RANKS, fork=True)
    assert read_summary(run)["steps"] == 6 and temporaries(run) == []
    assert_same_run(ref, run)
