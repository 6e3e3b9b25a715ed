"""Preemption: a signal asks the trainer to finish its step, save, and stop.

Under DDP every rank must stop at the same step, though a signal may reach only some of them. Each step all-reduces this
rank's flag asynchronously, on a gloo group of host tensors (never the device), and reads the previous step's result: a
stop is agreed one step after the signal, and no step waits for the other ranks.

Under torchrun, the agent forwards the signals it handles (``--signals-to-handle``, default SIGTERM, SIGINT, SIGHUP,
SIGQUIT) to the workers and any other one kills the agent, leaving its workers to train on without a checkpoint. So
``sbatch --signal=B:USR1`` needs ``torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``; the first rank
warns at the start when a SLURM job runs torchrun without it (:func:`slurm_torchrun_warning`). The agent signals each
worker's process group: the loader workers a trainer forked get it too, and ignore it."""
from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta
from typing import Any, Dict, Mapping, Optional

import torch

from .distributed import DistInfo

log = logging.getLogger(__name__)

# SLURM sends SIGTERM on preemption and, with --signal, SIGUSR1/SIGUSR2 before a time limit
# (the submitit launcher uses SIGUSR2 and requeues the job from its own handler).
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
TORCHRUN_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun's agent forwards unless told otherwise


class Preempted(Exception):
    """Raised after a preemption signal once the step finished and the checkpoint is saved."""


def torchrun_drops(signal_name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process runs under a torchrun agent that does not forward ``signal_name`` (the signal then kills the
    agent and never reaches this process). torchrun exports what its agent handles as
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``; one that does not export it handles the default set."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return False
    handled = environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCHRUN_DEFAULT_SIGNALS)
    return signal_name not in {name.strip() for name in handled.split(",")}


def slurm_torchrun_warning(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A line for train.log when a SLURM job runs torchrun whose agent would not forward SIGUSR1 (what
    ``sbatch --signal=B:USR1`` sends it) to this run; None otherwise."""
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ or not torchrun_drops("SIGUSR1", environ):
        return None
    return (f"torchrun does not forward SIGUSR1 to this run: sbatch --signal=B:USR1 would kill torchrun and leave "
            f"no checkpoint; launch torchrun --signals-to-handle={TORCHRUN_DEFAULT_SIGNALS},SIGUSR1 (or send B:TERM)")


class StopSignals:
    """While entered (``with``), the preemption signals only note that a stop was asked for (``received``); on exit the
    handlers that were there before are back. ``dist``: the ranks that must agree (:meth:`agreed`)."""

    def __init__(self, dist: DistInfo = DistInfo()):
        self.dist = dist
        self.received: Optional[str] = None  # the name of the signal, once one arrived
        self.previous: Dict[int, Any] = {}
        self.pid = os.getpid()  # loader workers forked from this process inherit the handler: it ignores them
        self.group: Any = None  # under DDP: the gloo group the flags are all-reduced on
        self.flag: Optional[torch.Tensor] = None  # this rank's flag, then the all-reduced one: a CPU tensor
        self.flag_memory: Any = None  # the same memory as a NumPy array, which the loop reads and writes
        self.reduction: Any = None  # the all-reduce of the flag issued at the previous step

    def __enter__(self) -> "StopSignals":
        def handler(signum, _frame):
            if os.getpid() != self.pid:  # a loader worker: its trainer process stops it
                return
            self.received = signal.Signals(signum).name
            log.warning("received %s: finishing this step, saving, then exiting", self.received)

        for name in PREEMPT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    self.previous[sig] = signal.signal(sig, handler)
                except ValueError:  # not in the main thread
                    pass
        if self.dist.enabled and self.group is None:  # every rank enters at the same point: a group is made here
            import torch.distributed as tdist
            self.group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=self.dist.timeout_s))
            self.flag = torch.zeros(1)
            self.flag_memory = self.flag.numpy()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.reduction is not None:  # done long ago; a process group must not go with work pending
            try:
                self.reduction.wait()
            except RuntimeError:  # the ranks broke apart: the error that brought us here says why
                if exc[0] is None:
                    raise
            self.reduction = None
        self._restore()

    def agreed(self) -> bool:
        """Whether every rank stops now (every rank calls this once a step): in one process as soon as a signal arrived;
        under DDP when one had arrived on any rank by the previous step. Never waits: it reads the all-reduce issued a
        step ago (finished: the ranks met since, in this step's gradient all-reduce) and issues this step's."""
        if not self.dist.enabled:
            return self.received is not None
        import torch.distributed as tdist
        stop = False
        if self.reduction is not None:
            self.reduction.wait()
            stop = bool(self.flag_memory[0] > 0)  # host memory: nothing to wait for, no device to ask
        self.flag_memory[0] = 1.0 if self.received else 0.0
        self.reduction = tdist.all_reduce(self.flag, group=self.group, async_op=True)
        return stop

    def hand_over(self) -> None:
        """After saving, let a handler that was there before us (submitit's checkpoint-and-requeue)
        deal with the signal as it would have without us."""
        sig = getattr(signal, self.received or "", None)
        previous = self.previous.get(sig)
        if sig is None or not callable(previous) or previous in (signal.SIG_DFL, signal.SIG_IGN):
            return
        self._restore()
        log.warning("checkpoint saved; handing %s to the launcher's handler", self.received)
        previous(sig, None)

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
