"""Preemption: a signal asks the trainer to finish its step, save, and stop.

Under DDP every rank must stop at the same step, though a signal may reach only some of them. Each step
all-reduces this rank's flag asynchronously, on a gloo group of host tensors (never the device, whatever the
backend), and reads the result of the previous step's: a stop is agreed one step after the signal, and no
step waits for the other ranks.
"""
from __future__ import annotations

import logging
import signal
from typing import Any, Dict, Optional

import torch

from .distributed import DistInfo

log = logging.getLogger(__name__)

# SLURM sends SIGTERM on preemption and, with --signal, SIGUSR1/SIGUSR2 before a time limit
# (the submitit launcher uses SIGUSR2 and requeues the job from its own handler).
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


class Preempted(Exception):
    """Raised after a preemption signal once the step finished and the checkpoint is saved."""


class StopSignals:
    """While entered (``with``), the preemption signals only note that a stop was asked for
    (``received``); on exit the handlers that were there before are back. ``dist``: the ranks that must agree
    (:meth:`agreed`)."""

    def __init__(self, dist: DistInfo = DistInfo()):
        self.dist = dist
        self.received: Optional[str] = None  # the name of the signal, once one arrived
        self.previous: Dict[int, Any] = {}
        self.group: Any = None  # under DDP: the gloo group the flags are all-reduced on
        self.flag: Optional[torch.Tensor] = None  # this rank's flag, then the all-reduced one: a CPU tensor
        self.flag_memory: Any = None  # the same memory as a NumPy array, which the loop reads and writes
        self.reduction: Any = None  # the all-reduce of the flag issued at the previous step

    def __enter__(self) -> "StopSignals":
        def handler(signum, _frame):
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
            self.group = tdist.new_group(backend="gloo")
            self.flag = torch.zeros(1)
            self.flag_memory = self.flag.numpy()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.reduction is not None:  # done long ago; a process group must not go with work pending
            self.reduction.wait()
            self.reduction = None
        self._restore()

    def agreed(self) -> bool:
        """Whether every rank stops now (every rank calls this once a step): in one process as soon as a signal
        arrived; under DDP when one had arrived on any rank by the previous step. Never waits for another
        rank: it reads the all-reduce issued a step ago (finished: the ranks met since, in this step's
        gradient all-reduce) and issues this step's."""
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
