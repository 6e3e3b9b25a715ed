"""Which implementation of an op runs: one decision, written once, for every op that has more than one.

An :class:`Op` is a reference formula in plain PyTorch operators (the test oracle, and what tracers and exporters
record) plus implementations registered beside it, each saying where it can run. The ``kernels`` config
(:class:`Kernels`, one key per op family) names one; ``auto`` is the recorded winner on the call's device (the op's
``auto`` table, each entry kept by a record in ``docs/performance.md``). Per call, from its first tensor: ``reference``
runs the formula everywhere; under ``torch.jit.trace``, ``torch.fx``, the ONNX exporters, ``torch.export`` and
``torch.func`` the formula runs unless the implementation says it runs there (the ``torch.library`` operators under
``torch.jit.trace``, where the FLOP counter counts them as one node); ``auto`` runs the device's winner where it can run
the call, else the formula; an explicit choice runs where it can, and is a one-line error on a device it does not
support.

An implementation that raises where the formula, given the same arguments, does not (a kernel that fails to compile or
launch, a missing toolchain) has failed: that call returns the formula's result, one warning names the op, the
implementation and the error, and the op runs its formula for the rest of the process (:func:`run_or_fall_back`,
:func:`kernels_in_use` for ``summary.json``). An error the formula raises too is the caller's and is raised as the
implementation raised it; so is running out of memory, and this package's one-line errors."""
from __future__ import annotations

import contextvars
import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from moh_vision.errors import ConfigError, RunError
from .tracing import COMPILE, active_tracer

log = logging.getLogger(__name__)

AUTO, REFERENCE = "auto", "reference"
EAGER = (None,)
EAGER_OR_COMPILED = (None, COMPILE)

OPS: Dict[str, "Op"] = {}  # filled once, at import, by the op modules (like timm's model registry)
# The registry's record of the implementations that failed in this process: (op, implementation) -> the error's first
# line. Written once per failed implementation (run_or_fall_back), cleared by reset_failures (tests).
FAILED: Dict[Tuple[str, str], str] = {}
# The eager Op call in progress, (op, implementation, kernels value): what a failure inside its operator was asked as.
_CALL: contextvars.ContextVar[Optional[Tuple[str, str, str]]] = contextvars.ContextVar("moh_vision_op_call",
                                                                                       default=None)


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
        """The implementation that runs a call on ``x`` when the config says ``choice`` (see the module docstring);
        the reference in place of one that failed in this process."""
        impl = self._choose(choice, x)
        return self.reference if (self.name, impl.name) in FAILED else impl

    def _choose(self, choice: str, x: torch.Tensor) -> Impl:
        if choice == REFERENCE:
            return self.reference
        tracer = active_tracer(x)
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
        impl = self.choose(choice, args[0])
        if impl is self.reference or torch.compiler.is_compiling():  # traced: a failure surfaces when the graph runs
            return impl.fn(*args, **kwargs)
        token = _CALL.set((self.name, impl.name, choice))
        try:
            return run_or_fall_back(self.name, impl.name, impl.fn, self.reference.fn, args, kwargs)
        finally:
            _CALL.reset(token)


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


def _kept(error: Exception) -> bool:
    """Errors that are not an implementation's failure: out of memory (the formula needs more), this package's
    one-line errors (configuration and run problems)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError, ConfigError, RunError))


def run_or_fall_back(op: str, implementation: str, fn: Callable, formula: Callable, args: Sequence[Any],
                     kwargs: Optional[Mapping[str, Any]] = None) -> Any:
    """``fn(*args, **kwargs)``, implementation ``implementation`` of op ``op``; where it raises and ``formula`` on the
    same arguments does not, the formula's result, and ``implementation`` has failed for the rest of the process (one
    warning; the op's later calls run the formula without trying it). Where the formula raises too, the
    implementation's own error. An implementation that has failed is not called."""
    kwargs = kwargs or {}
    if (op, implementation) in FAILED:
        return formula(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - what the formula does with the same arguments decides
        if _kept(error):
            raise
        failure = error
    rejected = False
    try:
        result = formula(*args, **kwargs)
    except Exception:  # noqa: BLE001 - bad input, below
        rejected = True
    if rejected:  # bad input: the formula rejects it too (raised here, so that the formula's error is not its context)
        raise failure
    _record_failure(op, implementation, failure)
    return result


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].strip()}" if lines else type(error).__name__


def _record_failure(op: str, implementation: str, error: Exception) -> None:
    FAILED[(op, implementation)] = _first_line(error)
    key = OPS[op].key if op in OPS else op
    call = _CALL.get()
    asked = call[2] if call is not None and call[:2] == (op, implementation) else None
    how = ""  # a failure in a compiled graph or a backward: the call that chose it is over
    if asked == AUTO:
        how = f" (kernels.{key}=auto's pick)"
    elif asked is not None:
        how = f" (asked for explicitly: kernels.{key}={asked})"
    log.warning("%s: implementation %s%s failed (%s); the reference formula runs instead for the rest of this process "
                "(kernels.%s=reference skips it)", op, implementation, how, FAILED[(op, implementation)], key)


def failures() -> Dict[str, Dict[str, str]]:
    """The implementations that failed in this process, ``{op: {implementation: the error's first line}}``."""
    failed: Dict[str, Dict[str, str]] = {}
    for (op, implementation), line in FAILED.items():
        failed.setdefault(op, {})[implementation] = line
    return failed


def reset_failures() -> None:
    """Forget every failure: each implementation is tried again (tests)."""
    FAILED.clear()


def formula_backward(formula: Callable[..., Sequence[Optional[torch.Tensor]]], inputs: Sequence[Any],
                     needs_grad: Sequence[bool], grads: Sequence[Optional[torch.Tensor]]
                     ) -> Tuple[Optional[torch.Tensor], ...]:
    """An autograd Function's backward as its formula's: ``formula(*inputs)`` recomputed under autograd, the gradients
    ``grads`` of its outputs taken back to the inputs marked in ``needs_grad`` (None elsewhere). What an implementation's
    backward falls back to (:func:`run_or_fall_back`)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) if isinstance(t, torch.Tensor) else t
                  for t, need in zip(inputs, needs_grad)]
        pairs = [(out, grad) for out, grad in zip(formula(*leaves), grads)
                 if grad is not None and out is not None and out.requires_grad]
        wanted = [i for i, need in enumerate(needs_grad) if need]
        found = torch.autograd.grad([out for out, _ in pairs], [leaves[i] for i in wanted],
                                    [grad for _, grad in pairs], allow_unused=True) if pairs and wanted else ()
    result: list = [None] * len(inputs)
    for i, grad in zip(wanted, found):
        result[i] = grad
    return tuple(result)


def kernels_in_use(kernels: Kernels, device: Union[str, torch.device]) -> Dict[str, str]:
    """:func:`resolved`, with the failures of this process: ``"reference (fused failed: RuntimeError: ...)"`` where the
    implementation ``kernels`` picks has failed (``summary.json``'s ``kernels_in_use``)."""
    picked = resolved(kernels, device)
    for op, name in picked.items():
        if (op, name) in FAILED:
            picked[op] = f"{REFERENCE} ({name} failed: {FAILED[(op, name)]})"
    return picked


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
