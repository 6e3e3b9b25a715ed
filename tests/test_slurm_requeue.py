"""A SLURM job that is requeued continues where it stopped (issue 57, item 5): ``train.py`` run as the documented sbatch
line runs it (no ``hydra.run.dir``; the job's variables set, a fake ``scontrol`` on PATH that records its call), stopped
by SIGUSR1, then started again as the requeued job, same job id, on another node."""
import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO, Forked, read_summary
from test_reliability import CLS, wait_for_step
from moh_vision.checkpoints import run_name, slurm_job
from moh_vision.checkpoints import LOCK_NAME, RunLock
from moh_vision.errors import ConfigError

# What `exec torchrun ... train.py` of one task in an sbatch job sees (srun sets the same for each task it starts).
JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "moh", "SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_PROCID": "0",
       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node-a", "SLURMD_NODENAME": "node-a"}
# test_reliability's deterministic run (a checkpoint every step), smaller: one epoch of 5 steps
TINY = (*CLS, "trainer.epochs=1", "model=plain_vit_nano", "data.img_size=16")
STEPS = 5
FAKE_SCONTROL = """#!/bin/sh
# what the run's call finds: its arguments, the run's lock and checkpoint
{ echo "args: $*"
  if [ -e "$RUN_DIR/.run.lock" ]; then echo "lock: held"; else echo "lock: released"; fi
  if [ -e "$RUN_DIR/checkpoints/last.pt" ]; then echo "checkpoint: saved"; fi; } >> "$SCONTROL_LOG"
"""


def job_env(tmp_path, job="4242", **more):
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        (bin_dir / "scontrol").chmod(0o755)
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", **JOB,
            "SLURM_JOB_ID": job, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "RUN_DIR": str(tmp_path / "outputs" / "train" / f"slurm-{job}"), "SCONTROL_LOG": str(tmp_path / "scontrol"),
            **more}


def start(tmp_path, env):
    """train.py in the job's working directory, as the documented line runs it: no hydra.run.dir."""
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc):
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def plant_lock(run_dir, job, host="node-that-died"):
    """The lock a run leaves when it is killed outright with its node (the pid means nothing on this host)."""
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "host": host, "started": "earlier",
                                                 "slurm_job": job}))


def test_a_requeued_job_continues_in_its_directory(tmp_path):  # 2 short runs: ~20 s on 2 quiet cores
    """The documented line's run, stopped by SIGUSR1, asks for its requeue after releasing its lock; the requeued job
    (same id, another node, a lock of this job left behind) takes the lock over and resumes in the same directory at
    the step it stopped. (Another job's lock refuses the run: test_the_lock_of_the_same_job_is_taken_over.)"""
    run_dir = tmp_path / "outputs" / "train" / "slurm-4242"
    proc = start(tmp_path, job_env(tmp_path))
    wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGUSR1)  # what sbatch --signal=B:USR1@180 sends before the time limit
    code, out = finish(proc)
    assert code == 124, out[-3000:]
    stopped_at = [line for line in out.splitlines() if "stopped by SIGUSR1 at step" in line]
    step = int(stopped_at[0].split("at step ")[1].split(";")[0])
    assert 2 <= step < STEPS
    assert (tmp_path / "scontrol").read_text().splitlines() == ["args: requeue 4242", "lock: released",
                                                                "checkpoint: saved"], "requeued after the release"

    plant_lock(run_dir, "4242")  # this job's earlier run, killed with its node before the requeue
    # the requeued job: a process forked from this one (helpers.Forked; the first run was the fresh interpreter)
    requeued = Forked([REPO / "train.py", *TINY], env=job_env(tmp_path, SLURM_RESTART_COUNT="1",
                                                               SLURMD_NODENAME="node-b"), cwd=tmp_path)
    code, out = finish(requeued)
    assert code == 0, out[-3000:]
    assert "taking over the lock of an earlier run of SLURM job 4242" in out
    assert f"at step {step} " in next(line for line in out.splitlines() if "resumed from" in line)
    assert [p.name for p in (tmp_path / "outputs" / "train").iterdir()] == ["slurm-4242"], "one directory"
    assert read_summary(run_dir)["steps"] == STEPS and not (run_dir / LOCK_NAME).exists()
    # (that a resume gives the uninterrupted run's weights and metrics: test_reliability's SIGKILL resume)
    assert len((tmp_path / "scontrol").read_text().splitlines()) == 3, "the finished run asked for no requeue"


def test_the_run_directory_is_the_jobs_in_slurm_only(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert slurm_job() is None and run_name("train", "2026-12-02/09-00-00") == "2026-12-02/09-00-00"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_name("train", "2026-12-02/09-00-00") == "slurm-4242"
    assert run_name("eval", "2026-12-02/09-00-00") == "2026-12-02/09-00-00", "an evaluation keeps its own directory"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4200")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")  # each task has a job id of its own; sbatch names it %A_%a
    assert run_name("train", "x") == "slurm-4200_7"


@pytest.mark.parametrize("owner,taken", [
    ({"host": "node-that-died", "slurm_job": "4242"}, True),  # this job's earlier run, on another node
    ({"host": "node-that-died", "slurm_job": "4177"}, False),  # another job's, on another node
    ({"host": "node-that-died"}, False),  # a run outside SLURM, on another host
    ({"slurm_job": "4242", "pid": os.getppid()}, False),  # a run of this job that is alive here
], ids=["same-job-elsewhere", "other-job", "no-job", "same-job-alive-here"])
def test_the_lock_of_the_same_job_is_taken_over(tmp_path, monkeypatch, owner, taken):
    import socket
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = {"pid": 999999999, "host": socket.gethostname(), "started": "earlier", **owner}
    (tmp_path / LOCK_NAME).write_text(json.dumps(lock))
    if taken:
        with RunLock(tmp_path):
            assert json.loads((tmp_path / LOCK_NAME).read_text())["slurm_job"] == "4242"
        assert not (tmp_path / LOCK_NAME).exists()
    else:
        with pytest.raises(ConfigError, match="another run is using") as err:
            RunLock(tmp_path).acquire()
        assert "\n" not in str(err.value) and all(str(owner[key]) in str(err.value) for key in ("host", "slurm_job")
                                                  if key in owner), "the error names who holds the lock"
        assert json.loads((tmp_path / LOCK_NAME).read_text()) == lock, "a live run's lock is left alone"
