"""A failure on one rank ends every rank with that error, and no rank waits longer than ``trainer.dist_timeout_s``
(issue 57, item 7): real torchrun jobs of two gloo ranks whose rank 0 alone meets a fault in its first checkpoint write
(``tests/rank_faults.py``), while rank 1 has gone on into its next step's gradient all-reduce."""
import os
import signal
import time

from helpers import REPO, torchrun

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
    # torchrun's agent holds the store: rank 0 left at once, rank 1 did not wait for it to give up waiting for readers
    assert not any("had not read this failure" in line for line in rank_lines(job, 0)), rank_lines(job, 0)[-20:]
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
