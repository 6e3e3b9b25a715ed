"""A failure on one rank ends every rank with that error, and no rank waits longer than ``trainer.dist_timeout_s``
(issue 57, item 7): real torchrun jobs of two gloo ranks whose rank 0 alone meets a fault in its first checkpoint write
(``tests/rank_faults.py``), while rank 1 has gone on into its next step's gradient all-reduce; and the same failure
on two ranks with no agent to serve their store, as srun and the submitit launcher start them."""
import os
import signal
import socket
import time
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError

from helpers import REPO, Forked, free_port, read_summary, run_ranks, torchrun
from moh_vision.engine.distributed import _fork_store_server, is_timeout
from moh_vision.errors import RunError

TINY = ("model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16", "trainer.epochs=1", "trainer.batch_size=32",
        "trainer.max_steps=6", "trainer.ckpt_every_steps=2", "trainer.progress=false", "trainer.count_flops=false",
        "trainer.num_workers=0")


def start_job(tmp_path, fault, *args):
    """torchrun of two ranks (its agent forked: ``helpers.torchrun``; each line of output tagged with its rank:
    ``--tee``)."""
    return torchrun("--standalone", "--nproc_per_node=2", "--tee=3", REPO / "tests" / "rank_faults.py", fault,
                    REPO / "train.py", *TINY, *args, f"hydra.run.dir={tmp_path / 'run'}",
                    env={"EXIT_FILE": str(tmp_path / "exit"), "STALL_DONE": str(tmp_path / "stall_done")})


def end_unfinished_ranks(tmp_path):
    """SIGKILL to each rank that has not written its exit status: the agent's end does not reach them (torchrun starts
    its workers in sessions of their own), and a stalled rank 0 would sleep on for minutes after the test."""
    for pid_file in tmp_path.glob("exit*.pid"):
        if not pid_file.with_suffix("").exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def rank_lines(job, rank):
    tag = f"[default{rank}]:"
    return [line[len(tag):] for line in job.output().splitlines() if line.startswith(tag)]


def wait_for_error_line(job, rank, seconds=30.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not any(line.startswith("error:") for line in rank_lines(job, rank)):
        time.sleep(0.2)


def test_a_rank_that_fails_ends_the_others_with_its_error(tmp_path):  # 7 s on 2 quiet cores
    job = start_job(tmp_path, "disk_full=200000")  # rank 0 cannot write its checkpoint (~5 MB)
    try:
        assert job.wait(timeout=300) != 0
    finally:
        job.kill()
        end_unfinished_ranks(tmp_path)
    mine = [line for line in rank_lines(job, 0) if line.startswith("error:")]
    assert len(mine) == 1 and "could not write checkpoint" in mine[0] and "File too large" in mine[0], mine
    told = [line for line in rank_lines(job, 1) if line.startswith("error:")]
    assert told == [f"error: rank 0 failed: {mine[0][len('error: '):]}"], rank_lines(job, 1)[-20:]
    assert "Connection closed by peer" not in "\n".join(rank_lines(job, 1)), "not gloo's broken connection"
    assert (tmp_path / "exit0").read_text() == "1"
    if (tmp_path / "exit1").exists():  # (torchrun may end rank 1 after it printed its line, before it wrote this)
        assert (tmp_path / "exit1").read_text() == "1"


def test_a_rank_left_waiting_stops_at_the_timeout_with_an_error(tmp_path):  # 20 s on 2 quiet cores
    """Rank 0 works alone for longer than trainer.dist_timeout_s (a hung write): rank 1 does not wait it out (the
    default limit is 30 minutes) but stops with one line that says why, long before rank 0 is done."""
    job = start_job(tmp_path, "stall=200", "trainer.dist_timeout_s=5")
    try:
        end = time.monotonic() + 190
        while not (tmp_path / "exit1").exists() and job.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        stalled = not (tmp_path / "stall_done").exists()
        wait_for_error_line(job, 1)  # torchrun's --tee copies a rank's output to the agent's a moment later
    finally:
        job.kill()  # the agent's process group: rank 0 is still in its write, torchrun would give it 30 s more
        job.wait()
        end_unfinished_ranks(tmp_path)
    lines = rank_lines(job, 1)
    assert (tmp_path / "exit1").exists() and stalled, lines[-20:]
    assert (tmp_path / "exit1").read_text() == "1"
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "waited trainer.dist_timeout_s=5 s in a collective" in errors[0], lines[-20:]


def test_without_torchrun_the_store_outlives_rank_0(tmp_path):
    """With no agent to serve the store (srun, the submitit launcher: rank 0 forks its server), rank 0's failure still
    reaches rank 1, which can read it only once rank 0 left the group (with the store in rank 0: gloo's broken
    connection, 10 s later)."""
    procs = run_ranks(2, str(REPO / "tests" / "rank_faults.py"), "disk_full=200000", str(REPO / "train.py"), *TINY,
                      f"hydra.run.dir={tmp_path / 'run'}", env={"EXIT_FILE": str(tmp_path / "exit")}, check=False)
    mine = [line for line in procs[0].output().splitlines() if line.startswith("error:")]
    assert len(mine) == 1 and "could not write checkpoint" in mine[0], procs[0].output()[-3000:]
    told = [line for line in procs[1].output().splitlines() if line.startswith("error:")]
    assert told == [f"error: rank 0 failed: {mine[0][len('error: '):]}"], procs[1].output()[-3000:]
    assert [p.returncode for p in procs] == [1, 1]


def test_without_torchrun_each_job_of_a_multirun_serves_the_store_anew(tmp_path):
    """The store's server rank 0 forks ends with its job (``cleanup``), before the next job of a sweep binds the port."""
    run_ranks(2, str(REPO / "train.py"), "-m", "seed=0,1", *TINY, f"hydra.sweep.dir={tmp_path}")
    assert [read_summary(job)["steps"] for job in sorted(tmp_path.glob("[01]_*"))] == [6, 6]


def test_a_rank_whose_peers_never_join_stops_at_the_timeout_with_an_error(tmp_path):
    """Rank 1 of two, alone (rank 0 never started: no store to join): one line after trainer.dist_timeout_s."""
    port = free_port()
    rank_1 = Forked([REPO / "train.py", *TINY, "trainer.dist_timeout_s=2", f"hydra.run.dir={tmp_path}"],
                    env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1",
                         "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    out, _ = rank_1.communicate(timeout=120)
    assert rank_1.returncode == 1 and out.strip().splitlines()[-1] == (
        "error: rank 1 waited trainer.dist_timeout_s=2 s for the 2 ranks to join at MASTER_ADDR:MASTER_PORT="
        f"127.0.0.1:{port}: a rank did not start, failed before it joined, or started later than that")


@pytest.mark.parametrize("err,timed_out", [
    (DistStoreError("wait timeout after 5000ms, keys: /0//1//cpu//0/0"), True),  # a group's creation, a rank late
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"),
     True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:64704"), False),
    (ValueError("timeout=3 is not allowed"), False),  # not a collective's
])
def test_what_counts_as_a_timeout(err, timed_out):
    assert is_timeout(err) is timed_out


def test_a_port_in_use_is_one_error_line():
    """Rank 0 forks the store's server; a MASTER_PORT another job holds is said in one line, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RunError, match=rf"could not serve the job's store at MASTER_ADDR:MASTER_PORT=127.0.0.1:"
                                           rf"{port} \(.*\): is another job using that port\?"):
            _fork_store_server("127.0.0.1", port, 2, timedelta(seconds=5))
