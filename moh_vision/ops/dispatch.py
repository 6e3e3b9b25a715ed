"""Which implementation of an op runs: one decision, written once, for every op that has more than one.

An :class:`Op` is a reference formula in plain PyTorch operators (the test oracle, and what tracers and exporters
record) plus implementations registered beside it, each saying where it can run. The ``kernels`` config
(:class:`Kernels`, one key per op family) names one; ``auto`` is the recorded winner on the call's device (the op's
``auto`` table, each entry kept by a record in ``docs/performance.md``). Per call, from its first tensor: ``reference``
runs the formula everywhere; under ``torch.jit.trace``, ``torch.fx``, the ONNX exporters, ``torch.export`` and
``torch.func`` the formula runs unless the implementation says it runs there (the ``torch.library`` operators under
``torch.jit.trace``, where the FLOP counter counts them as one node); ``auto`` runs the device's winner where it can run
the call, else the formula; an explicit choice runs where it can, and is a one-line error on a device it does not
support."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch

from moh_vision.errors import ConfigError
from .tracing import COMPILE, active_tracer

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
        return self.choose(choice, args[0]).fn(*args, **kwargs)


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
