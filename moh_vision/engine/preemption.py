"""Preemption: a signal asks the trainer to finish its step, save, and stop."""
from __future__ import annotations

import logging
import signal
from typing import Any, Dict, Optional

import torch

from .distributed import DistInfo, all_reduce_sum

log = logging.getLogger(__name__)

# SLURM sends SIGTERM on preemption and, with --signal, SIGUSR1/SIGUSR2 before a time limit
# (the submitit launcher uses SIGUSR2 and requeues the job from its own handler).
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


class Preempted(Exception):
    """Raised after a preemption signal once the step finished and the checkpoint is saved."""


class StopSignals:
    """While entered (``with``), the preemption signals only note that a stop was asked for
    (``received``); on exit the handlers that were there before are back."""

    def __init__(self):
        self.received: Optional[str] = None  # the name of the signal, once one arrived
        self.previous: Dict[int, Any] = {}

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
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def requested(self, dist: DistInfo) -> bool:
        """Any rank received a signal (every rank must call this at the same step)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=dist.device)
        return bool(all_reduce_sum(flag, dist).item() > 0)

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
