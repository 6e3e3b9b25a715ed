"""Which implementation of an op runs: one decision, written once, for every op that has more than one.

An :class:`Op` is a reference formula in plain PyTorch operators (the test oracle, and what tracers and exporters
record) plus implementations registered beside it, each saying where it can run. The ``kernels`` config
(:class:`Kernels`, one key per op family) names one; ``auto`` is the recorded winner on the call's device (the op's
``auto`` table, each entry kept by a record in ``docs/performance.md``). Per call, from its first tensor: ``reference``
runs the formula everywhere; under ``torch.jit.trace``, ``torch.fx``, the ONNX exporters, ``torch.export`` and
``torch.func`` the formula runs unless the implementation says it runs there (the ``torch.library`` operators under
``torch.jit.trace``, where the FLOP counter counts them as one node); ``auto`` runs the device's winner where it can run
the call, else the formula; an explicit choice runs where it can, and is a one-line error on a device it does not
support. An implementation that raises on its first eager call on a device where the formula does not falls back to
the formula for the rest of the run (:class:`KernelRuns`)."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.utils.checkpoint

from moh_vision.errors import ConfigError, RunError
from .tracing import COMPILE, active_tracer

log = logging.getLogger(__name__)

AUTO, REFERENCE = "auto", "reference"
EAGER = (None,)
EAGER_OR_COMPILED = (None, COMPILE)

OPS: Dict[str, "Op"] = {}  # filled once, at import, by the op modules (like timm's model registry)


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Impl:
    """One implementation of an op and where it can run."""

    name: str
    fn: Callable
    devices: Tuple[str, ...] = ("cpu", "cuda")
    tracers: Tuple[Optional[str], ...] = EAGER_OR_COMPILED  # None: eager
    training_only: bool = False  # kept-activation savers: only where eager autograd records the call
    available: Callable[[], bool] = _always  # e.g. Triton installed

    def runs(self, x: torch.Tensor, tracer: Optional[str]) -> bool:
        """Whether this implementation can run a call on ``x`` under ``tracer`` (``auto``'s question)."""
        if tracer not in self.tracers or x.device.type not in self.devices:
            return False
        if self.training_only and not torch.is_grad_enabled():
            return False
        return self.available()


class Op:
    """An op with several implementations, selected by the ``kernels.<key>`` config entry."""

    def __init__(self, name: str, key: str, reference: Callable, auto: Optional[Mapping[str, str]] = None):
        self.name, self.key = name, key
        self.reference = Impl(REFERENCE, reference, devices=("cpu", "cuda", "meta", "mps"), tracers=())
        self.impls: Dict[str, Impl] = {}
        self.auto = dict(auto or {})  # device type -> implementation name (the recorded winner)
        OPS[name] = self

    def implement(self, name: str, **where: Any) -> Callable[[Callable], Callable]:
        """Register ``fn`` as implementation ``name`` (``where``: :class:`Impl`'s fields)."""
        def register(fn: Callable) -> Callable:
            self.impls[name] = Impl(name, fn, **where)
            return fn
        return register

    def choose(self, choice: str, x: torch.Tensor) -> Impl:
        """The implementation that runs a call on ``x`` when the config says ``choice`` (see the module docstring)."""
        return self._choose(choice, x, active_tracer(x))

    def _choose(self, choice: str, x: torch.Tensor, tracer: Optional[str]) -> Impl:
        if choice == REFERENCE:
            return self.reference
        if choice == AUTO:
            if tracer not in EAGER_OR_COMPILED:
                return self.reference
            impl = self.impls.get(self.auto.get(x.device.type, REFERENCE))
            return impl if impl is not None and impl.runs(x, tracer) else self.reference
        impl = self.impls[choice]
        if tracer not in impl.tracers or (impl.training_only and not torch.is_grad_enabled()):
            return self.reference  # what tracers and exporters record; nothing to save without autograd
        if x.device.type not in impl.devices:
            raise ConfigError(f"kernels.{self.key}={choice} runs on {' or '.join(impl.devices)}, not on "
                              f"{x.device.type} ({self.name}); use kernels.{self.key}=auto or reference")
        if not impl.available():
            raise ConfigError(f"kernels.{self.key}={choice} is not available here ({self.name} needs Triton); "
                              f"use kernels.{self.key}=auto or reference")
        return impl

    def __call__(self, choice: str, *args: Any, **kwargs: Any) -> Any:
        x = args[0]
        tracer = active_tracer(x)
        impl = self._choose(choice, x, tracer)
        if tracer is not None:  # traced or compiled: what runs is the graph's (a kernel fails when the graph runs)
            return impl.fn(*args, **kwargs)
        if impl is self.reference:
            return RUNS.ran(self.name, REFERENCE, x.device.type, impl.fn, args, kwargs)
        return RUNS.guarded(self.name, impl.name, x.device.type, impl.fn, self.reference.fn, args, kwargs)


@dataclass(frozen=True)
class Kernels:
    """The ``kernels`` config: the implementation each family of ops runs (``auto``: the recorded winner per device;
    ``reference``: the plain formula); models hold one (plain configuration). ``aggregated``: TransNeXt's aggregated
    attention; ``routing``: MoH's routing and gated merge; ``depthwise``: TransNeXt's depthwise convolution;
    ``recompute``: TransNeXt's pieces that keep only their inputs in eager training (:mod:`moh_vision.ops`)."""

    aggregated: str = AUTO
    routing: str = AUTO
    depthwise: str = AUTO
    recompute: str = AUTO

    def __post_init__(self) -> None:
        for entry in fields(self):
            value, allowed = getattr(self, entry.name), choices(entry.name)
            if value not in allowed:
                raise ConfigError(f"kernels.{entry.name}={value} is unknown; allowed: {', '.join(allowed)}")

    @classmethod
    def of(cls, value: Union[None, "Kernels", Mapping[str, Any]]) -> "Kernels":
        """A :class:`Kernels` from ``None`` (all ``auto``), a mapping (the config group) or a :class:`Kernels`."""
        if value is None or isinstance(value, Kernels):
            return value or cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"kernels.{unknown[0]} is unknown; the kernels config has {', '.join(sorted(known))}")
        return cls(**{key: str(v) for key, v in value.items()})

    def as_dict(self) -> Dict[str, str]:
        return asdict(self)


def choices(key: str) -> Tuple[str, ...]:
    """The values ``kernels.<key>`` takes: auto, reference and every implementation registered under it."""
    names = {name for op in OPS.values() if op.key == key for name in op.impls}
    return (AUTO, REFERENCE, *sorted(names))


def resolved(kernels: Kernels, device: Union[str, torch.device]) -> Dict[str, str]:
    """What each op runs in an eager call on ``device`` under ``kernels``, ``{op: implementation}`` (for
    ``summary.json`` and logs); an implementation that needs more than the device (Triton) is named if present."""
    device_type = torch.device(device).type
    picked = {}
    for op in OPS.values():
        choice = getattr(kernels, op.key)
        name = op.auto.get(device_type, REFERENCE) if choice == AUTO else choice
        impl = op.impls.get(name)
        if choice == AUTO and (impl is None or device_type not in impl.devices or not impl.available()):
            name = REFERENCE
        picked[op.name] = name
    return picked


# ---- Kernels that fail on their first call ---------------------------------------------------------
def _not_a_failure() -> Tuple[type, ...]:
    """Errors a first call raises that are not a kernel failing to compile or launch: out of memory (the formula needs
    more), this package's one-line errors, and the early stop of ``torch.utils.checkpoint``'s recomputation (raised
    through the call on purpose, once backward has the tensors it needs)."""
    stop = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    return (torch.OutOfMemoryError, MemoryError, ConfigError, RunError) + ((stop,) if stop is not None else ())


NOT_A_FAILURE = _not_a_failure()


def first_line(error: BaseException) -> str:
    """``"<type>: <first line of the message>"``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].strip()}" if lines else type(error).__name__


class KernelRuns:
    """What ran in this run: the implementations of each op that completed a call, per device type, and the ones that
    failed on their first call (``summary.json``'s ``kernels_ran`` and ``kernel_fallbacks``).

    A kernel that has never run on a device (a Triton kernel compiled at its first launch) may fail to compile or launch
    there. :meth:`guarded` runs an implementation's first call on a device inside ``try``: where it raises and the
    formula, on the same arguments, does not, the formula's result is returned, one warning names the op, the
    implementation and the error's first line, and every later call of that op on that device runs the formula
    without trying the implementation again. Where the formula raises too, the error is the caller's (a wrong shape)
    and the implementation's own error is raised; so are running out of memory and this package's errors
    (:data:`NOT_A_FAILURE`). Later calls are not inside ``try``: a kernel that launched once is the op's.

    The state is this process's, kept here in the ops layer (models hold none); the trainer resets it when a run starts
    (:meth:`reset`). A failure in a forward switches the op to its formula from that call on, so that a checkpointed
    block's recomputation makes the choice its forward made; an implementation that fails after writing into
    autograd's graph would break that, and none does (the Triton and C++ kernels raise before anything is saved)."""

    def __init__(self) -> None:
        self.done: Set[Tuple[str, str, str]] = set()       # (op, implementation, device type): a call completed
        self.failed: Dict[Tuple[str, str, str], str] = {}  # the same keys: the first call's error, one line
        self.order: List[Tuple[str, str, str]] = []        # ``done`` in the order the calls completed

    def reset(self) -> None:
        """Forget what ran and what failed (a new run; tests)."""
        self.done.clear()
        self.failed.clear()
        self.order.clear()

    def ran(self, op: str, implementation: str, device: str, fn: Callable, args: Sequence[Any],
            kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        """``fn(*args, **kwargs)``, recorded as ``implementation`` of ``op`` on ``device`` (no fallback)."""
        out = fn(*args, **(kwargs or {}))
        self._note((op, implementation, device))
        return out

    def guarded(self, op: str, implementation: str, device: str, fn: Callable, formula: Callable,
                args: Sequence[Any], kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        """``fn(*args, **kwargs)``, implementation (or part of one, e.g. ``"fused backward kernel"``) ``implementation``
        of ``op`` on ``device``, with ``formula`` (same arguments, same result) in its place where its first call fails
        (see the class docstring)."""
        key, kwargs = (op, implementation, device), kwargs or {}
        if key in self.done:
            return fn(*args, **kwargs)
        if key in self.failed:
            return self.ran(op, REFERENCE, device, formula, args, kwargs) if _is_impl(op, implementation) \
                else formula(*args, **kwargs)
        try:
            out = fn(*args, **kwargs)
        except NOT_A_FAILURE:
            raise
        except Exception as error:  # noqa: BLE001 - whether the formula takes the same arguments decides, below
            failure = error
        else:
            self._note(key)
            return out
        try:
            out = formula(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the arguments are wrong: the implementation's error is the caller's
            rejected = True
        else:
            rejected = False
        if rejected:
            raise failure  # outside the handler: the formula's error is not its context
        self.failed[key] = first_line(failure)
        if _is_impl(op, implementation):  # a part's formula (a backward's) is not the op's reference
            self._note((op, REFERENCE, device))
        config = f" (kernels.{OPS[op].key}=reference runs the formulas from the start)" if op in OPS else ""
        log.warning("kernel fallback: %s's %s failed on its first call on %s (%s); the reference formula runs in its "
                    "place for the rest of this run%s", op, implementation, device, self.failed[key], config)
        return out

    def _note(self, key: Tuple[str, str, str]) -> None:
        if key not in self.done:
            self.done.add(key)
            self.order.append(key)

    def kernels_ran(self, device: Union[str, torch.device]) -> Dict[str, List[str]]:
        """``{op: [implementation, ...]}``: what completed a call on ``device``'s type in this run, in order
        (``reference`` where an implementation fell back to it)."""
        device_type = torch.device(device).type
        ran: Dict[str, List[str]] = {}
        for op, name, where in self.order:
            if where == device_type and (name == REFERENCE or _is_impl(op, name)):
                ran.setdefault(op, []).append(name)
        return ran

    def fallbacks(self, device: Union[str, torch.device]) -> Dict[str, Dict[str, str]]:
        """``{op: {implementation: its first call's error}}`` on ``device``'s type in this run."""
        device_type = torch.device(device).type
        failed: Dict[str, Dict[str, str]] = {}
        for (op, name, where), error in self.failed.items():
            if where == device_type:
                failed.setdefault(op, {})[name] = error
        return failed


def _is_impl(op: str, name: str) -> bool:
    """Whether ``name`` is one of ``op``'s registered implementations (not a part of one)."""
    return op in OPS and name in OPS[op].impls


RUNS = KernelRuns()  # this process's record (like OPS, the ops layer's; reset by the trainer at a run's start)
