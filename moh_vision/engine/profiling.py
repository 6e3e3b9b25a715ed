"""``trainer.profile=<first>:<last>``: a ``torch.profiler`` profile of optimizer steps ``first`` to ``last`` (counted
from 1, as the logs count them) of a real run, written by every rank into ``<run dir>/profile/`` (how to read it:
``docs/training.md``): the Chrome / Perfetto trace ``trace_steps<first>-<last>_rank<r>.json`` (ranges
``optimizer step <n>`` per step, ``data wait`` per wait for the next batch) and
``time_by_kind_steps<first>-<last>_rank<r>.md`` / ``.json``, the steps' wall time by kind of work
(:mod:`moh_vision.analysis.profile_kinds`: the operators' host time on the CPU, the kernels' device time on CUDA), the
data wait (operators inside it count as data wait) and the rest (host time between operators, or device idle time)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch

from moh_vision.analysis.profile_kinds import time_by_kind
from moh_vision.config import parse_steps  # noqa: F401  (re-exported: the trainer and tests take it from here)

log = logging.getLogger(__name__)

DATA_WAIT = "data wait"  # the range around each fetch of the next batch
_END = object()


def _under(event: Any, name: str) -> bool:
    """Whether ``event`` is a range called ``name`` or runs inside one (on the host)."""
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def time_table(events: Iterable, device: torch.device, wall_ms: float) -> Dict[str, float]:
    """ms by kind of the events outside the data-wait ranges, ``data_wait`` and ``rest`` (the wall time left, >= 0)."""
    events = list(events)
    cpu = torch.autograd.DeviceType.CPU
    data_wait = sum(e.cpu_time_total for e in events if e.name == DATA_WAIT and e.device_type == cpu) / 1e3
    kinds = time_by_kind([e for e in events if not _under(e, DATA_WAIT)], device)
    return {**kinds, "data_wait": data_wait, "rest": max(0.0, wall_ms - data_wait - sum(kinds.values()))}


def table_text(record: Dict[str, Any]) -> str:
    """The markdown table of :func:`time_table`'s figures with their share of the wall time."""
    wall = record["wall_ms"]
    cuda = record["clock"] == "cuda"
    names = {"data_wait": "data wait (host)" if cuda else "data wait",
             "rest": "device idle (wall less kernel time)" if cuda else "rest (host time between operators)"}
    first, last = record["steps"]
    lines = [f"Optimizer steps {first}-{last}, rank {record['rank']}, {record['device']}: {wall:.1f} ms of wall time; "
             f"{'kernel time on the device' if cuda else 'operator time on the host'} by kind of work", "",
             "| kind | ms | share of wall time |", "|---|---|---|"]
    lines += [f"| {names.get(kind, kind)} | {ms:.1f} | {100 * ms / wall if wall else 0:.1f}% |"
              for kind, ms in record["ms"].items()]
    return "\n".join(lines) + "\n"


class StepProfiler:
    """Profiles optimizer steps ``steps = (first, last)`` (None: never). The trainer takes its batches through
    :meth:`batches`, calls :meth:`at_step` before each epoch's first step and after every optimizer step, and closes it
    when the run ends (``with profiler:``), which writes what was recorded when the run stops inside the window."""

    def __init__(self, steps: Optional[Tuple[int, int]], out_dir: Path, device: torch.device, rank: int = 0):
        self.steps, self.folder, self.device, self.rank = steps, Path(out_dir) / "profile", device, rank
        self.profile: Optional[torch.profiler.profile] = None  # while recording
        self.step_range: Optional[torch.profiler.record_function] = None  # the range of the step under way
        self.first_recorded = 0
        self.step_under_way = 0
        self.started_at = 0.0
        self.done = False

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.profile is not None:  # the run ended inside the window: the steps finished so far
            self._finish(max(self.first_recorded, self.step_under_way - 1))

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``loader``'s batches; while recording, each fetch (the first included) inside a :data:`DATA_WAIT` range."""
        iterator = None
        while True:
            with torch.profiler.record_function(DATA_WAIT) if self.profile is not None else contextlib.nullcontext():
                iterator = iter(loader) if iterator is None else iterator
                batch = next(iterator, _END)
            if batch is _END:
                return
            yield batch

    def at_step(self, step: int) -> None:
        """``step`` optimizer steps are done: start recording before step ``first``, mark each step, stop and write
        after ``last`` (a run resumed inside the window records the rest of it)."""
        if self.steps is None or self.done:
            return
        first, last = self.steps
        if self.profile is None and not first - 1 <= step < last or step + 1 == self.step_under_way:
            return  # outside the window, or called again before the step under way (a new epoch's start)
        if self.profile is None:
            kinds = torch.profiler.ProfilerActivity
            self.profile = torch.profiler.profile(activities=[kinds.CPU] + [kinds.CUDA] * (self.device.type == "cuda"))
            self.profile.start()
            self.first_recorded, self.started_at = step + 1, time.perf_counter()
        elif step >= last:
            self._finish(step)
            return
        self._close_step()
        self.step_under_way = step + 1
        self.step_range = torch.profiler.record_function(f"optimizer step {self.step_under_way}")
        self.step_range.__enter__()

    def _close_step(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _finish(self, last_recorded: int) -> None:
        """Stop recording and write the trace and the table of optimizer steps ``first_recorded``..``last_recorded``."""
        self._close_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels end inside it
        wall_ms = (time.perf_counter() - self.started_at) * 1e3
        profile, self.profile, self.done = self.profile, None, True
        profile.stop()
        try:
            self._write(profile, wall_ms, self.first_recorded, last_recorded)
        except (OSError, RuntimeError) as err:  # a profile is a report, never a reason to stop training
            log.warning("could not write the profile of steps %d-%d (%s)", self.first_recorded, last_recorded, err)

    def _write(self, profile: torch.profiler.profile, wall_ms: float, first: int, last: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = f"steps{first}-{last}_rank{self.rank}"
        trace = self.folder / f"trace_{stem}.json"
        partial = trace.with_name(f".{trace.name}.tmp")
        profile.export_chrome_trace(str(partial))
        os.replace(partial, trace)
        record = {"steps": [first, last], "rank": self.rank, "device": str(self.device), "clock": self.device.type,
                  "wall_ms": wall_ms, "ms": time_table(profile.events(), self.device, wall_ms), "trace": trace.name}
        text = table_text(record)
        (self.folder / f"time_by_kind_{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        (self.folder / f"time_by_kind_{stem}.md").write_text(text)
        log.info("profile of steps %d-%d: %s\n%s", first, last, trace, text)
