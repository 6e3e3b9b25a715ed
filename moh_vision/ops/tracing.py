"""Which tracer, exporter or function transform runs a call: the question the kernel dispatch asks
(:mod:`moh_vision.ops.dispatch`), answered in one place.

A kernel is an opaque operator or a hand-written autograd Function. ``torch.compile`` keeps a ``torch.library`` operator
as one node of its graph; ``torch.jit.trace`` records it as one node (the FLOP counter gives it a handle); ``torch.fx``,
the ONNX exporters, ``torch.export`` and the ``torch.func`` transforms need the reference formula's plain operators.
:func:`active_tracer` names the one running, cheaply (it asks ``is_compiling`` first, which ``torch.compile`` folds to
a constant, so compiled code never reaches the functorch query)."""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

JIT_TRACE = "torch.jit.trace"
ONNX_EXPORT = "torch.onnx.export"
FX_TRACE = "torch.fx symbolic tracing"
EXPORT = "torch.export"
COMPILE = "torch.compile"
FUNC_PREFIX = "torch.func."


def _fx_symbolic_tracing() -> bool:
    # is_fx_tracing() is also true under torch.export (and warns about it); the newer query is not
    fx = torch.fx._symbolic_trace
    query = getattr(fx, "is_fx_symbolic_tracing", None) or getattr(fx, "is_fx_tracing_symbolic_tracing", None)
    return (query or fx.is_fx_tracing)()


def _functorch_transforms() -> tuple:
    """Names of the active ``torch.func`` transforms, outermost first (``("grad",)``, ``("vmap", "grad")``)."""
    stack = torch._C._functorch.get_interpreter_stack()
    return tuple(interpreter.key().name.lower() for interpreter in stack) if stack else ()


def active_tracer(x: Optional[Tensor] = None) -> Optional[str]:
    """The tracer, exporter or transform running this call (a name for messages), or None in eager mode. ``x``: the
    caller's input; an ``fx.Proxy`` says fx is tracing even where the global flag is not set. ``torch.func`` transforms
    are named ``"torch.func.<transform>"`` (``grad``, ``vmap``, ...), nested ones joined by ``+``."""
    if torch.compiler.is_compiling():  # first: folded to a constant by the compiler
        is_exporting = getattr(torch.compiler, "is_exporting", None)
        if is_exporting is not None and is_exporting():
            return ONNX_EXPORT if torch.onnx.is_in_onnx_export() else EXPORT
        return COMPILE
    if torch.onnx.is_in_onnx_export():
        return ONNX_EXPORT
    if torch.jit.is_tracing():
        return JIT_TRACE
    if isinstance(x, torch.fx.Proxy) or _fx_symbolic_tracing():
        return FX_TRACE
    transforms = _functorch_transforms()
    if transforms:
        return FUNC_PREFIX + "+".join(transforms)
    return None
