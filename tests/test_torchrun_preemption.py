"""Preemption under torchrun on SLURM (issue 53): a signal sent to torchrun's agent, as ``sbatch --signal=B:USR1``
sends it, reaches every worker; they stop at the same step, save one checkpoint and exit for requeue. The loader
workers the trainers forked get the signal too (torchrun signals each worker's process group) and ignore it."""
import os
import signal

import torch

from helpers import REPO, torchrun
from test_reliability import wait_for_step
from moh_vision.engine.distributed import StopSignals, slurm_torchrun_warning, torchrun_drops

UNDER_TORCHRUN = {"TORCHELASTIC_RUN_ID": "none"}
# train.py as a torchrun worker that writes its exit status to $EXIT_FILE<rank> (torchrun does not report it
# after it forwarded a signal)
RECORD_EXIT = r"""
import os, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    code = 0
except SystemExit as stop:
    code = stop.code
open(os.environ["EXIT_FILE"] + os.environ["RANK"], "w").write(str(code))
sys.exit(code)
"""


def test_what_torchrun_forwards():
    assert not torchrun_drops("SIGUSR1", {}), "not under torchrun: nothing to forward"
    assert torchrun_drops("SIGUSR1", UNDER_TORCHRUN), "torch < 2.9: the default set, without SIGUSR1"
    assert not torchrun_drops("SIGTERM", UNDER_TORCHRUN)
    assert torchrun_drops("SIGUSR1", {**UNDER_TORCHRUN, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT"})
    assert not torchrun_drops("SIGUSR1", {**UNDER_TORCHRUN, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM, SIGUSR1"})


def test_a_slurm_job_is_told_when_torchrun_would_drop_usr1():
    job = {**UNDER_TORCHRUN, "SLURM_JOB_ID": "7"}
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in slurm_torchrun_warning(job)
    assert slurm_torchrun_warning({**job, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1"}) is None
    assert slurm_torchrun_warning(UNDER_TORCHRUN) is None, "not a SLURM job"


def test_a_forked_loader_worker_ignores_the_stop_signals():
    """A process forked while the handlers are installed (a DataLoader worker) neither dies of the signal nor
    takes it for its own stop."""
    with StopSignals() as signals:
        child = os.fork()
        if child == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(0 if signals.received is None else 3)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and signals.received is None


def test_usr1_to_torchrun_stops_every_worker_at_one_step(tmp_path):  # a real torchrun: 12 s on 2 quiet cores
    run_dir, worker = tmp_path / "run", tmp_path / "worker.py"
    worker.write_text(RECORD_EXIT)
    agent = torchrun(
        "--standalone", "--nproc_per_node=2", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", worker,
        REPO / "train.py", "model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16", "trainer.epochs=1",
        "trainer.batch_size=32", "trainer.log_every=1", "trainer.num_workers=1", "trainer.progress=false",
        "trainer.count_flops=false", f"hydra.run.dir={run_dir}", env={"EXIT_FILE": str(tmp_path / "exit")})
    wait_for_step(agent, run_dir, 3)
    agent.send_signal(signal.SIGUSR1)
    out, _ = agent.communicate(timeout=300)
    assert [(tmp_path / f"exit{rank}").read_text() for rank in (0, 1)] == ["124", "124"], out[-4000:]  # requeue
    stops = [line for line in out.splitlines() if "stopped by SIGUSR1 at step" in line]
    steps = {line.split("at step ")[1].split(";")[0] for line in stops}
    assert len(stops) == 2 and len(steps) == 1, stops  # every worker, after the same step
    state = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["step"] == int(steps.pop()) and 3 <= state["step"] < 44 and state["world_size"] == 2
    assert list((run_dir / "checkpoints").iterdir()) == [run_dir / "checkpoints" / "last.pt"], "one checkpoint"
    assert "DataLoader worker" not in out and out.count("received SIGUSR1") == 2, "loader workers ignore it"
