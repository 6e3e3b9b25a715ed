"""Crashes, preemption, bad numbers and bad input: the run comes back exactly or stops with one clear line."""
import csv
import os
import random
import resource
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, Forked, read_summary, run_entry
from moh_vision.analysis.routing_stats import RoutingMeter

# Deterministic, checkpoint every step, log every step.
CLS = ("trainer.deterministic=true", "trainer.ckpt_every_steps=1", "trainer.log_every=1", "trainer.progress=false",
       "trainer.num_workers=0", "trainer.epochs=2", "trainer.batch_size=256", "trainer.count_flops=false")
DIFF = ("experiment=diffusion", "data.img_size=8", "trainer.deterministic=true", "trainer.ckpt_every_steps=1",
        "trainer.log_every=1", "trainer.progress=false", "trainer.num_workers=0", "trainer.epochs=2",
        "trainer.batch_size=256", "trainer.count_flops=false", "task.sample.per_class=1",
        "task.sample.eval_per_class=0", "task.sample.steps=5", "task.sample.every_epochs=0")
# The runs that are killed, signalled and resumed: 10 steps of 128 images over 2 epochs (719 training images; the
# larger validation set costs less than the training steps it saves)
KILLED = (*(a for a in CLS if not a.startswith("trainer.batch_size=")), "trainer.batch_size=128",
          "data.val_fraction=0.6")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
       "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def start(args, out_dir, preexec=None):
    """``python train.py <args>`` in a process of its own (forked: ``helpers.Forked``), its output in one stream."""
    return Forked([REPO / "train.py", *args, f"hydra.run.dir={out_dir}"], env=ENV, preexec=preexec)


def logged_step(out_dir: Path) -> int:
    try:
        rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    except (FileNotFoundError, csv.Error):
        return -1
    steps = [int(float(r["step"])) for r in rows if r.get("step")]
    return max(steps, default=-1)


def wait_for_step(proc, out_dir: Path, step: int, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if logged_step(out_dir) >= step:
            return
        time.sleep(0.05)


def weights(out_dir: Path):
    state = torch.load(out_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return state


def assert_same_run(a: Path, b: Path) -> None:
    sa, sb = weights(a), weights(b)
    assert sa["step"] == sb["step"]
    for part in ("model", "model_ema"):
        if part in sa:
            for k in sa[part]:
                assert torch.equal(sa[part][k], sb[part][k]), f"{part}.{k} differs after kill + resume"
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["optimizer"]["state"][k][name]), f"optimizer state {k}.{name} differs"
    ra, rb = read_summary(a), read_summary(b)
    for key in ra:
        if key.startswith(("val", "best", "train/epoch", "sample")):
            assert ra[key] == rb[key], f"{key}: {ra[key]} vs {rb[key]}"


def kill_and_resume(args, out_dir: Path, kill_steps, train_in_process) -> None:
    """A run in its own process SIGKILLed at each of ``kill_steps``, each time started again; then resumed to its end
    in this process (one thread, as the killed processes: the numbers are bit for bit theirs)."""
    for step in kill_steps:
        proc = start(args, out_dir)
        wait_for_step(proc, out_dir, step)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert train_in_process(*args, f"hydra.run.dir={out_dir}")[0] == 0


@pytest.mark.parametrize("args,total", [(KILLED, 10), pytest.param(DIFF, 10, marks=pytest.mark.slow)],
                         ids=["classification", "diffusion"])  # diffusion's resume: also test_checkpoint_history's
def test_sigkill_then_resume_is_bit_identical(tmp_path, args, total, one_thread, train_in_process):
    ref = tmp_path / "uninterrupted"
    assert train_in_process(*args, f"hydra.run.dir={ref}")[0] == 0
    killed = tmp_path / "killed"
    kill_and_resume(args, killed, [random.Random(0).randint(2, total - 2)], train_in_process)
    assert read_summary(killed)["steps"] == total
    assert_same_run(ref, killed)


@pytest.mark.slow
@pytest.mark.parametrize("args,total", [(KILLED, 10), (DIFF, 10)], ids=["classification", "diffusion"])
def test_repeated_random_kills_match_uninterrupted_run(tmp_path, args, total, one_thread, train_in_process):
    ref = tmp_path / "uninterrupted"
    assert train_in_process(*args, f"hydra.run.dir={ref}")[0] == 0
    rng = random.Random(1)
    kills = sorted(rng.sample(range(1, total), 4))
    out = tmp_path / "killed"
    kill_and_resume(args, out, kills, train_in_process)
    assert_same_run(ref, out)


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGUSR1])
def test_preemption_signal_saves_and_exits_for_requeue(tmp_path, sig, train_in_process):
    proc = start(KILLED, tmp_path)
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 124, out[-3000:]
    assert "stopped by" in out and "resume with" in out
    stopped_at = weights(tmp_path)["step"]
    assert 3 <= stopped_at < 10
    assert train_in_process(*KILLED, f"hydra.run.dir={tmp_path}")[0] == 0
    assert read_summary(tmp_path)["steps"] == 10


def test_corrupt_last_checkpoint_falls_back_to_previous(tmp_path, train_in_process):
    assert train_in_process(*CLS, "trainer.max_steps=4", f"hydra.run.dir={tmp_path}")[0] == 0
    last = tmp_path / "checkpoints" / "last.pt"
    previous = weights(tmp_path)["step"]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 3])  # truncated mid-write by a crash
    first_run = len((tmp_path / "train.log").read_text())
    assert train_in_process(*CLS, "trainer.extend=true", f"hydra.run.dir={tmp_path}")[0] == 0  # past max_steps
    log = (tmp_path / "train.log").read_text()[first_run:]
    assert "last.pt is unreadable" in log and "last.prev.pt" in log
    assert f"at step {previous - 1}" in log or f"at step {previous}" in log
    assert read_summary(tmp_path)["steps"] == 10


def _limit_file_size(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.slow  # by default: test_run_dir's in-process full disk, and test_dist_timeout's file size limit on rank 0
def test_full_disk_during_save_keeps_previous_checkpoint(tmp_path):
    run_entry("train.py", *CLS, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")
    before = weights(tmp_path)
    size = (tmp_path / "checkpoints" / "last.pt").stat().st_size
    proc = start((*CLS, "trainer.extend=true"), tmp_path,  # past max_steps; the next save cannot fit
                 preexec=_limit_file_size(size // 2))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    last_line = out.strip().splitlines()[-1]
    assert last_line.startswith("error: could not write checkpoint") and "previous checkpoint is intact" in last_line
    assert "File too large" in last_line, "the operating system's reason (here: the file size limit)"
    after = weights(tmp_path)
    assert after["step"] == before["step"]
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])


def test_nonfinite_steps_are_skipped_then_stop_with_last_good_checkpoint(tmp_path, train_in_process):
    assert train_in_process(*CLS, "trainer.max_steps=3", f"hydra.run.dir={tmp_path}")[0] == 0
    good = weights(tmp_path)
    code, stderr = train_in_process(*CLS, "data=custom", "data.name=nan_data:NaNDigits", "+data.kwargs.nan_from=0",
                                    "trainer.max_nonfinite_in_a_row=3", "trainer.extend=true",  # other data
                                    f"hydra.run.dir={tmp_path}")
    assert code == 1
    last_line = stderr.strip().splitlines()[-1]
    assert "3 non-finite steps in a row" in last_line and "at step" in last_line and "last.pt" in last_line
    assert "nan" in last_line
    after = weights(tmp_path)
    assert all(torch.equal(after["model"][k], good["model"][k]) for k in good["model"]), "weights stay good"
    assert after["counters"]["nonfinite_skipped"] == 2  # saved after the 2nd skipped step; the 3rd stops the run
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert any(r.get("train/nonfinite_skipped") for r in rows), "skips are logged"


def test_a_few_nonfinite_steps_are_skipped_and_training_goes_on(tmp_path, train_in_process):
    # a handful of NaN images (8 of 1438): the batches that hold one are skipped, the run finishes
    assert train_in_process(*CLS, "data=custom", "data.name=nan_data:NaNDigits", "+data.kwargs.nan_from=1430",
                            "trainer.batch_size=64", "trainer.epochs=1", f"hydra.run.dir={tmp_path}")[0] == 0
    summary = read_summary(tmp_path)
    assert 1 <= summary["nonfinite_skipped"] < summary["steps"]
    assert summary["val/acc1"] > 0


BAD = [
    ("attention=moa attention.activation_ratio=null attention.topk=3", "MoA topk=3 is outside 1..num_experts=1"),
    ("attention.activation_ratio=null attention.shared_heads=1 attention.topk=7", "exceeds the routed pool"),
    ("data=imagefolder data.root=/nonexistent/images", "/nonexistent/images"),
    ("trainer.resume=/nonexistent/last.pt", "no such checkpoint"),
]


@pytest.mark.parametrize("override,fragment", BAD)
def test_bad_input_one_line_nonzero_and_nothing_destroyed(tmp_path, override, fragment, train_in_process):
    code, stderr = train_in_process(*override.split(), *CLS, f"hydra.run.dir={tmp_path}")
    assert code == 2
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and fragment in last_line, stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


def test_data_root_without_images_and_empty_class(tmp_path, train_in_process):
    root = tmp_path / "data"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
    code, stderr = train_in_process("data=imagefolder", f"data.root={root}", *CLS, f"hydra.run.dir={tmp_path / 'r'}")
    assert code == 2 and "error: " in stderr.strip().splitlines()[-1]


def test_resume_or_eval_with_a_checkpoint_of_another_model(tmp_path, train_in_process):
    assert train_in_process(*CLS, "trainer.max_steps=1", f"hydra.run.dir={tmp_path}")[0] == 0
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    config_before = (tmp_path / "config.yaml").read_text()
    code, stderr = train_in_process(*CLS, "model=plain_vit_nano", f"hydra.run.dir={tmp_path}")
    assert code == 2
    last_line = stderr.strip().splitlines()[-1]
    assert "cannot resume" in last_line and "transnext_nano" in last_line and "plain_vit_nano" in last_line
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before, "the good checkpoint is untouched"
    assert (tmp_path / "config.yaml").read_text() == config_before, "and so is its config"


def test_routing_health_flags_collapse_and_starvation():
    meter = RoutingMeter()

    def layer_stats(load):  # one layer's entry of RoutingRecorder.stats()
        return {"load": torch.tensor(load), "entropy": torch.tensor(0.5), "num_heads": len(load),
                "shared_heads": 2, "topk": 1, "active_heads": 3}

    meter.update({"healthy": layer_stats([1.0, 1.0, 0.3, 0.4, 0.3]),
                  "collapsed": layer_stats([1.0, 1.0, 0.995, 0.005, 0.0])})
    warnings = meter.health_warnings()
    assert any("collapsed: routed head 2" in w and "collapse" in w for w in warnings)
    assert any("collapsed: routed head 4 was never chosen" in w for w in warnings)
    assert not any(w.startswith("healthy") for w in warnings)


LAUNCHER_HANDLER = r"""
import os, runpy, signal, sys
def requeue(signum, frame):  # stands in for submitit's checkpoint-and-requeue handler
    open(os.environ["MARKER"], "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGUSR2, requeue)
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_preemption_hands_the_signal_to_the_launchers_handler_after_saving(tmp_path):
    """Under submitit, USR2 reaches our handler first: we save, then submitit's handler requeues."""
    wrapper = tmp_path / "launcher.py"
    wrapper.write_text(LAUNCHER_HANDLER)
    marker = tmp_path / "requeued"
    run_dir = tmp_path / "run"
    proc = Forked([wrapper, REPO / "train.py", *CLS, f"hydra.run.dir={run_dir}"], env={**ENV, "MARKER": str(marker)})
    wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and marker.read_text() == "SIGUSR2", out[-3000:]
    assert "handing SIGUSR2 to the launcher's handler" in out
    assert 2 <= weights(run_dir)["step"] < 10
