"""Numbered checkpoints beside ``last.pt`` / ``last.prev.pt`` / ``best.pt``: ``checkpoints/step_0400000.pt`` every
``trainer.ckpt_history_every_steps`` optimizer steps and/or every ``trainer.ckpt_history_every_epochs`` epochs, the
newest ``trainer.ckpt_keep`` kept (0: all). Each is a whole training checkpoint, written atomically (the trainer's
numbered file is a hard link of the ``last.pt`` written with it: one serialisation), that
``trainer.resume=``, ``eval.py ckpt=`` and ``tools/sample.py ckpt=`` take like any other. Newest means last written
(after a resume from an earlier one, the abandoned trajectory's later-numbered files stay until they are the oldest);
retention never deletes the newest whole one (:func:`moh_vision.checkpoints.is_whole_checkpoint`)."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

from moh_vision import checkpoints as ckpt_io

log = logging.getLogger(__name__)

NUMBERED = re.compile(r"^step_(\d+)\.pt$")


def numbered_name(step: int) -> str:
    """``step_0400000.pt``: seven digits (DiT's numbering) sort by name up to 10M steps."""
    return f"step_{step:07d}.pt"


def numbered_checkpoints(folder: Path) -> List[Tuple[int, Path]]:
    """(step, path) of the numbered checkpoints in ``folder``, newest written first (ties: the later step)."""
    found = []
    for entry in os.scandir(folder) if Path(folder).is_dir() else ():
        match = NUMBERED.match(entry.name)
        if match and entry.is_file():
            found.append((entry.stat().st_mtime_ns, int(match.group(1)), Path(entry.path)))
    return [(step, path) for _, step, path in sorted(found, reverse=True)]


def to_prune(newest_first: List[Tuple[int, Path]], keep: int) -> List[Path]:
    """The files beyond the newest ``keep`` (0: none), less the newest whole one when none of the kept is whole."""
    if keep <= 0 or len(newest_first) <= keep:
        return []
    kept, rest = [path for _, path in newest_first[:keep]], [path for _, path in newest_first[keep:]]
    if not any(ckpt_io.is_whole_checkpoint(path) for path in kept):
        newest_whole = next((path for path in rest if ckpt_io.is_whole_checkpoint(path)), None)
        rest = [path for path in rest if path != newest_whole]
    return rest


class CheckpointHistory:
    """When numbered checkpoints are due, and writing and pruning them (the main rank's job)."""

    def __init__(self, folder: Path, every_steps: int = 0, every_epochs: int = 0, keep: int = 0):
        self.folder, self.every_steps, self.every_epochs, self.keep = Path(folder), every_steps, every_epochs, keep

    def due_after_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_after_epoch(self, epochs_done: int) -> bool:
        return bool(self.every_epochs) and epochs_done % self.every_epochs == 0

    def write(self, state: Dict[str, Any], step: int) -> Path:
        """``state`` as ``step_<step>.pt`` (atomically), then the oldest beyond ``keep`` removed."""
        path = ckpt_io.atomic_save(state, self.folder / numbered_name(step))
        self.prune()
        return path

    def prune(self) -> None:
        """Remove the numbered checkpoints beyond the newest ``keep``. A numbered file may be a hard link of
        ``last.pt`` or ``best.pt`` (one write, several names: ``Trainer.save``); removing the name leaves those."""
        for old in to_prune(numbered_checkpoints(self.folder), self.keep):
            try:
                old.unlink()
            except FileNotFoundError:
                continue
            log.info("removed %s (trainer.ckpt_keep=%d)", old, self.keep)
