"""Numbered checkpoints (issue 53): ``step_<step>.pt`` every N steps and every N epochs beside last/prev/best, the
newest ``trainer.ckpt_keep`` kept and never the newest readable one deleted; ``trainer.resume=``, ``eval.py`` and
``tools/sample.py`` take any of them; what a killed write leaves is removed by the next run in the directory."""
import json
import os
from pathlib import Path

import pytest
import torch

from helpers import Forked, load_tool, read_summary, save_untrained_classifier
from moh_vision import checkpoints as ckpt_io
from moh_vision.checkpoints import CheckpointHistory, numbered_checkpoints, to_prune

pytestmark = pytest.mark.usefixtures("one_thread")

# The digits with 128 images a step: 11 steps an epoch; the ViT cut to 2 blocks.
SMALL = ("model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16", "trainer.batch_size=128",
         "trainer.deterministic=true", "trainer.count_flops=false", "trainer.progress=false", "trainer.num_workers=0",
         "logger=csv")
HISTORY = ("trainer.epochs=2", "trainer.ckpt_history_every_steps=4", "trainer.ckpt_history_every_epochs=1",
           "trainer.ckpt_keep=3")


def _steps(run_dir: Path):
    return sorted(step for step, _ in numbered_checkpoints(run_dir / "checkpoints"))


def test_numbered_checkpoints_resume_and_evaluate_like_last(tmp_path, train_in_process, eval_in_process):
    first = tmp_path / "first"
    code, err = train_in_process(*SMALL, *HISTORY, f"hydra.run.dir={first}")
    assert code == 0, err
    # written at steps 4 and 8, the first epoch's end (11), 12, 16, 20 and the second's end (22); the newest 3 kept
    assert _steps(first) == [16, 20, 22]
    assert {p.name for p in (first / "checkpoints").glob("*.pt")} == {
        "last.pt", "last.prev.pt", "best.pt", "step_0000016.pt", "step_0000020.pt", "step_0000022.pt"}
    numbered = torch.load(first / "checkpoints" / "step_0000016.pt", map_location="cpu", weights_only=True)
    last = torch.load(first / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert numbered.keys() == last.keys() and (numbered["step"], numbered["epoch"]) == (16, 1)
    end = torch.load(first / "checkpoints" / "step_0000022.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(end["model"][k], v) for k, v in last["model"].items())  # the run's end is both

    # eval.py takes a numbered checkpoint and says which
    code, err = eval_in_process(f"ckpt={first}/checkpoints/step_0000016.pt", f"hydra.run.dir={tmp_path / 'eval'}")
    assert code == 0, err
    evaluated = read_summary(tmp_path / "eval")
    assert evaluated["step"] == 16 and evaluated["checkpoint"].endswith("step_0000016.pt")
    assert 0 <= evaluated["val/acc1"] <= 100

    # resuming from it in another directory ends where the uninterrupted run ended, bit for bit
    again = tmp_path / "again"
    code, err = train_in_process(*SMALL, *HISTORY, f"trainer.resume={first}/checkpoints/step_0000016.pt",
                                 f"hydra.run.dir={again}")
    assert code == 0, err
    resumed = torch.load(again / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert resumed["step"] == 22 and all(torch.equal(resumed["model"][k], v) for k, v in last["model"].items())
    assert _steps(again) == [20, 22]  # only what it wrote itself


def test_sampling_takes_a_numbered_checkpoint(tmp_path, train_in_process):
    run = tmp_path / "run"
    code, err = train_in_process("experiment=diffusion", "data.img_size=8", "trainer.epochs=1",
                                 "trainer.max_steps=2", "trainer.batch_size=16", "trainer.ckpt_history_every_steps=1",
                                 "trainer.progress=false", "trainer.count_flops=false", "task.sample.per_class=0",
                                 "task.sample.eval_per_class=0", "logger=csv", f"hydra.run.dir={run}")
    assert code == 0, err
    assert _steps(run) == [1, 2]
    out, classifier = tmp_path / "samples", save_untrained_classifier(tmp_path / "digits_classifier.pt", 8)
    load_tool("sample").main([f"ckpt={run}/checkpoints/step_0000001.pt", "num_samples=2", "steps=2", "batch_size=2",
                              f"out={out}", "progress=false", f"digits_classifier={classifier}"])
    info = json.loads((out / "sample.json").read_text())
    assert info["step"] == 1 and info["checkpoint"].endswith("step_0000001.pt")


def _save(path: Path, step: int, mtime: int) -> None:
    ckpt_io.atomic_save({"model": {"w": torch.zeros(4)}, "step": step}, path)
    os.utime(path, ns=(mtime, mtime))


def test_retention_keeps_the_newest_and_never_the_newest_readable_one(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (100, 200, 300):
        _save(folder / f"step_{step:07d}.pt", step, mtime=step * 10**9)
    for step in (400, 500):  # newer, but cut off half-way (a disk that filled, a copy interrupted)
        whole = (folder / "step_0000300.pt").read_bytes()
        (folder / f"step_{step:07d}.pt").write_bytes(whole[: len(whole) // 2])
        os.utime(folder / f"step_{step:07d}.pt", ns=(step * 10**9, step * 10**9))
    assert not ckpt_io.is_whole_checkpoint(folder / "step_0000500.pt")
    assert ckpt_io.is_whole_checkpoint(folder / "step_0000300.pt")
    newest_first = numbered_checkpoints(folder)
    assert [step for step, _ in newest_first] == [500, 400, 300, 200, 100]
    # keep 2: both kept are unreadable, so the newest readable one (300) stays too
    assert [p.name for p in to_prune(newest_first, 2)] == ["step_0000200.pt", "step_0000100.pt"]
    assert to_prune(newest_first, 0) == [] and to_prune(newest_first, 5) == []
    assert [p.name for p in to_prune(newest_first, 3)] == ["step_0000200.pt", "step_0000100.pt"]

    # newest is the last written: a run resumed from step 100 writes step 150 after the abandoned 200-500
    history = CheckpointHistory(folder, every_steps=50, keep=2)
    history.write({"model": {"w": torch.ones(4)}, "step": 150}, 150)
    assert [step for step, _ in numbered_checkpoints(folder)] == [150, 500]
    history = CheckpointHistory(folder, every_steps=50, keep=1)
    history.write({"model": {"w": torch.ones(4)}, "step": 160}, 160)
    assert [step for step, _ in numbered_checkpoints(folder)] == [160]
    assert history.due_after_step(200) and not history.due_after_step(210) and not history.due_after_epoch(3)


KILLED_WRITE = """
import os, signal, sys
from moh_vision.checkpoints import atomic_write

def write(f):
    f.write(b"PK" + b"x" * 4096)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # as a preemption without grace, or a lost node, ends a save

atomic_write(sys.argv[1], write)
"""


def test_a_write_killed_half_way_leaves_a_file_the_next_run_removes(tmp_path, train_in_process):
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.pt"
    killed = Forked([last], code=KILLED_WRITE)
    assert killed.wait(timeout=120) == -9
    leftovers = list(last.parent.glob(".last.pt.*.tmp"))
    assert len(leftovers) == 1 and not last.exists()
    (last.parent / "notes.tmp").write_text("not ours")  # only atomic_write's own names are removed
    code, err = train_in_process(*SMALL, "trainer.epochs=1", "trainer.max_steps=1", f"hydra.run.dir={run}")
    assert code == 0, err
    assert not any(p.exists() for p in leftovers) and (last.parent / "notes.tmp").exists() and last.is_file()
    assert "left by a checkpoint write that was killed" in (run / "train.log").read_text()
