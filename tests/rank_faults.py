"""Run ``train.py`` as a torchrun worker whose rank 0 alone meets a fault in its first checkpoint write, a phase that
rank 0 works alone while the others go on to their next collective.

``python tests/rank_faults.py <fault> <script> <args...>``, where ``<fault>`` is

- ``disk_full=<bytes>``: rank 0 may write no file larger than that (``RLIMIT_FSIZE``, as a full disk or a quota would
  stop it): its checkpoint write fails with the operating system's error;
- ``stall=<seconds>``: rank 0's first checkpoint write takes that long (a hung network file system); when it is over,
  the file ``$STALL_DONE`` is written.

Each rank writes its process id to ``$EXIT_FILE<rank>.pid`` when it starts (torchrun starts its workers in sessions of
their own: a test ends a stalled one by this) and its exit status to ``$EXIT_FILE<rank>`` (torchrun reports only the
first failure's). What the other ranks do is what ``tests/test_dist_timeout.py`` checks."""
from __future__ import annotations

import os
import resource
import runpy
import signal
import sys
import time
from pathlib import Path


def stall_first_save(seconds: float) -> None:
    import moh_vision.checkpoints as ckpt_io
    save = ckpt_io.atomic_save

    def slow_save(*args, **kwargs):
        if not getattr(slow_save, "stalled", False):
            slow_save.stalled = True
            time.sleep(seconds)
            Path(os.environ["STALL_DONE"]).write_text("rank 0's stall is over")
        return save(*args, **kwargs)

    ckpt_io.atomic_save = slow_save


def main(fault: str, script: str, *args: str) -> None:
    kind, _, value = fault.partition("=")
    rank = os.environ.get("RANK", "0")
    Path(f"{os.environ['EXIT_FILE']}{rank}.pid").write_text(str(os.getpid()))
    if rank == "0":
        if kind == "disk_full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), int(value)))
        elif kind == "stall":
            stall_first_save(float(value))
        else:
            raise SystemExit(f"unknown fault {fault!r}")
    sys.argv = [script, *args]
    code = 1  # an exception other than SystemExit: Python's traceback, status 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code
        raise
    finally:
        Path(os.environ["EXIT_FILE"] + rank).write_text(str(code))


if __name__ == "__main__":
    main(*sys.argv[1:])
