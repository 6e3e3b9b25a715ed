"""Count what makes a training step wait: host reads of tensors and Python-level collectives, per optimizer step.

A *walk* is a call of ``nn.Module.named_modules`` (``modules()``, ``named_parameters()`` go through it) from
outside a walk: host work that grows with the model's depth. A *host read* is a call that turns a tensor into a host
value: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``float()``, ``int()``, ``bool()``, ``format()`` ... of a ``torch.Tensor`` (on CUDA each one waits for the device).
They are counted by wrapping those methods of ``torch.Tensor``, which every tensor's Python-level call goes
through; the reads that input loading makes of the loader's own host tensors (``torch.utils.data``,
``moh_vision.data``) are left out, as the issue counted. A *collective* is a call of a ``torch.distributed``
collective; each returned work handle records the step at which it was waited on. DDP's gradient all-reduce is
not a Python call (its reducer issues it from C++) and is not counted.

Counts are keyed by the trainer's ``step`` at the time of the call: key ``s`` holds what happens after the
optimizer step that made the trainer's step ``s`` (logging, checkpoints) and the forward and backward of the
next one.

:class:`DeviceTraffic` counts the same waits below Python, per operator, under torch's ``FakeTensorMode`` with a fake
``cuda`` device (no GPU needed): every host-to-device copy and every read of device data that a step would make.

``python tests/step_waits.py <out.json> <script> <args...>`` runs ``<script>`` (train.py) with every Trainer it
builds counted, and writes each process's counts to ``<out.json>`` (``.rank<r>`` appended under torchrun).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
from typing import Any, Callable, Dict, Iterator, List

import torch
import torch.distributed as tdist
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__",
         "__format__", "__array__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object",
               "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "send", "recv",
               "isend", "irecv", "monitored_barrier")
INPUT_LOADING = (os.sep.join(("torch", "utils", "data", "")), os.sep.join(("moh_vision", "data", "")))


class _Work:
    """A collective's work handle that records the step at which it is waited on."""

    def __init__(self, work: Any, waits: "StepWaits", entry: Dict[str, Any]):
        self._work, self._waits, self._entry = work, waits, entry

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._entry["waited_at"] = self._waits.step()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class StepWaits:
    """Host reads and collectives per value of ``step()`` (while :meth:`counting`)."""

    def __init__(self, step: Callable[[], int]):
        self.step = step
        self.reads: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.collectives: Dict[int, List[Dict[str, Any]]] = collections.defaultdict(list)
        self.walks: Dict[int, int] = collections.Counter()  # walks of a module tree (named_modules: modules() too)

    @contextlib.contextmanager
    def counting(self) -> Iterator["StepWaits"]:
        originals = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in READS]
        originals += [(tdist, name, getattr(tdist, name)) for name in COLLECTIVES if hasattr(tdist, name)]
        originals.append((torch.nn.Module, "named_modules", torch.nn.Module.named_modules))
        wrap = {torch.Tensor: self._read, tdist: self._collective, torch.nn.Module: self._walk}
        for owner, name, original in originals:
            setattr(owner, name, wrap[owner](name, original))
        try:
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _read(self, name: str, original: Callable) -> Callable:
        def read(tensor, *args, **kwargs):
            if not _loading_input():
                self.reads[self.step()][name] += 1
            return original(tensor, *args, **kwargs)
        return read

    def _walk(self, name: str, original: Callable) -> Callable:
        def walk(module, *args, **kwargs):
            if not kwargs.get("prefix") and not args:  # a walk's own recursion passes a prefix: count the walk once
                self.walks[self.step()] += 1
            return original(module, *args, **kwargs)
        return walk

    def _collective(self, name: str, original: Callable) -> Callable:
        def collective(*args, **kwargs):
            entry = {"name": name, "async": bool(kwargs.get("async_op")), "waited_at": None}
            self.collectives[self.step()].append(entry)
            work = original(*args, **kwargs)
            return _Work(work, self, entry) if entry["async"] and work is not None else work
        return collective

    def table(self) -> Dict[str, Dict[str, Any]]:
        """``{step: {"reads": {method: count}, "collectives": [{name, async, waited_at}]}}`` (JSON keys)."""
        steps = sorted(set(self.reads) | set(self.collectives) | set(self.walks))
        return {str(s): {"reads": dict(self.reads.get(s, {})), "collectives": list(self.collectives.get(s, [])),
                         "walks": self.walks.get(s, 0)} for s in steps}


def _loading_input() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in INPUT_LOADING):
            return True
        frame = frame.f_back
    return False


def waits_outside(table: Dict[str, Dict[str, Any]], first: int, last: int, every: int) -> List[str]:
    """What breaks the targets at the steps ``first``..``last`` that are not multiples of ``every`` (log
    intervals may read): any host read; any walk of the model's modules (host work that grows with depth); more than
    one collective; a collective not issued asynchronously,
    or waited on at the step that issued it."""
    problems = []
    for step in range(first, last + 1):
        if step % every == 0:
            continue
        counts = table.get(str(step), {"reads": {}, "collectives": []})
        if counts["reads"]:
            problems.append(f"step {step}: host reads {counts['reads']}")
        if counts.get("walks"):
            problems.append(f"step {step}: {counts['walks']} walks of the model's modules")
        calls = counts["collectives"]
        if len(calls) > 1:
            problems.append(f"step {step}: {len(calls)} collectives {[c['name'] for c in calls]}")
        for call in calls:
            if not call["async"]:
                problems.append(f"step {step}: {call['name']} blocks (not async_op)")
            elif call["waited_at"] == step:
                problems.append(f"step {step}: {call['name']} waited on in the step that issued it")
    return problems


class DeviceTraffic(TorchDispatchMode):
    """The host-to-device copies (``copies``) and device reads (``reads``) of the operators dispatched while it is open,
    each as ``"<operator> <from>-><to> at <file>:<line> <function>"`` (the innermost ``moh_vision`` frame). Open it
    inside a ``FakeTensorMode``: tensors then have devices and shapes but no values, so it runs on any machine.

    A copy: ``_to_copy`` or ``copy_`` of a CPU tensor into a device tensor (``tensor.to(device)``, ``torch.tensor(...,
    device=...)``), or a CPU tensor of one or more dimensions handed to an operator on device tensors (an index: the
    operator copies it first). A 0-dim CPU tensor is not counted: CUDA kernels take it as a scalar argument. Copies from
    the ``allowed`` tensors (the batch's own transfer) are left out. A read: ``_to_copy`` or ``copy_`` of a device
    tensor to the CPU, or an operator that needs the data on the host (``.item()``, ``bool()``, ``.tolist()``,
    ``nonzero``, a boolean mask, ...: those the fake mode cannot answer without values). A read of a scalar answers 0
    so that the code runs on and every read is counted; an operator whose output shape depends on the data raises."""

    def __init__(self, allowed=()):
        super().__init__()
        self.allowed = {id(t) for t in allowed}
        self.copies: List[str] = []
        self.reads: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            target = torch.device(kwargs.get("device") or source.device) if func is torch.ops.aten._to_copy.default \
                else args[0].device
            self._note(func, source.device, target, allowed=id(source) in self.allowed)
        else:
            tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
            on_device = next((t.device for t in tensors if t.device.type != "cpu"), None)
            if on_device is not None:
                for host in (t for t in tensors if t.device.type == "cpu" and t.ndim > 0):
                    self._note(func, host.device, on_device, allowed=id(host) in self.allowed)
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            self.reads.append(f"{func} {args[0].device}->host at {_caller()}")
            if func is torch.ops.aten._local_scalar_dense.default:
                return False if args[0].dtype == torch.bool else 0
            raise

    def _note(self, func, source: torch.device, target: torch.device, allowed: bool) -> None:
        if source.type == "cpu" and target.type != "cpu" and not allowed:
            self.copies.append(f"{func} {source}->{target} at {_caller()}")
        elif source.type != "cpu" and target.type == "cpu":
            self.reads.append(f"{func} {source}->{target} at {_caller()}")


def _caller() -> str:
    """``file:line function`` of the innermost frame in ``moh_vision`` (else the innermost outside torch)."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}moh_vision{os.sep}" in name:
            return f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}"
        if fallback is None and f"{os.sep}torch{os.sep}" not in name and name != __file__:
            fallback = f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "?"


def counting_trainer(trainer_class: type, tables: List[Dict[str, Any]]) -> type:
    """A subclass of ``trainer_class`` whose ``fit`` counts (:class:`StepWaits`), appending its table to ``tables``."""
    class Counting(trainer_class):
        def fit(self, task, data):
            waits = StepWaits(lambda: self.step)
            try:
                with waits.counting():
                    return super().fit(task, data)
            finally:
                tables.append(waits.table())
    return Counting


def main(out: str, script: str, *args: str) -> None:
    import runpy

    import moh_vision.apps.run as run
    tables: List[Dict[str, Any]] = []
    run.Trainer = counting_trainer(run.Trainer, tables)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        rank = os.environ.get("RANK")
        with open(out + (f".rank{rank}" if rank is not None else ""), "w") as f:
            json.dump(tables[-1] if tables else {}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
