"""Which tracer, exporter or function transform runs a layer: the one question every path choice asks.

A routed layer may pick a data-dependent execution path (MoH's sparse path: per-head token lists whose
sizes depend on the router's choices). Eagerly that is exact; a tracer that records one call and replays it
(``torch.jit.trace``, the ONNX exporters, ``torch.fx``, ``torch.export``) would freeze one input's dispatch
into its graph and give another input a wrong result, and ``torch.func.vmap`` cannot batch it. So, under
any of them:

* ``impl="auto"`` runs the reference (masked) path, as it does under ``torch.compile``;
* an explicit ``impl="sparse"`` refuses with one line (:func:`refuse_data_dependent`), except
  under ``torch.compile`` (which graph-breaks around the dispatch instead of freezing it) and
  ``torch.func.grad`` / ``vjp`` / ``jacrev`` (autograd transforms evaluate the real input: the custom
  autograd Functions support them);
* fast paths written as custom autograd Functions or with ``out=`` writes run their plain-op twins where
  the tracer cannot see into a Function (:func:`~moh_vision.attention.kernels.custom_functions_opaque`).

:func:`active_tracer` is cheap and ``torch.compile`` folds it to a constant (it asks ``is_compiling``
first, so compiled code never reaches the functorch query, which the compiler cannot trace).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, Optional

import torch

from moh_vision.errors import ConfigError

Tensor = torch.Tensor

JIT_TRACE = "torch.jit.trace"
ONNX_EXPORT = "torch.onnx.export"
FX_TRACE = "torch.fx symbolic tracing"
EXPORT = "torch.export"
COMPILE = "torch.compile"
FUNC_PREFIX = "torch.func."


@functools.lru_cache(maxsize=None)
def _fx_symbolic_query() -> Callable[[], bool]:
    # is_fx_tracing() is also true under torch.export (and warns about it); the newer query is not. Resolved
    # once: active_tracer runs in every routed forward, where a getattr chain per call is measurable host time
    fx = torch.fx._symbolic_trace
    return getattr(fx, "is_fx_symbolic_tracing", None) or getattr(fx, "is_fx_tracing_symbolic_tracing", None) \
        or fx.is_fx_tracing


def _fx_symbolic_tracing() -> bool:
    # only reached outside torch.compile / torch.export (active_tracer asks is_compiling first)
    return _fx_symbolic_query()()


@functools.lru_cache(maxsize=None)
def _onnx_export_flags() -> Optional[tuple]:
    """The two flags ``torch.onnx.is_in_onnx_export`` reads, found once: that function imports its two modules
    on every call, and a routed layer asks in every eager forward (torch 2.11-2.14 keep them here). None where
    this torch keeps them elsewhere: then the public query runs."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
        bool(GLOBALS.in_onnx_export or _flags._is_onnx_exporting)
        return _flags, GLOBALS
    except (ImportError, AttributeError):
        return None


def _in_onnx_export() -> bool:
    flags = _onnx_export_flags()
    if flags is None:
        return torch.onnx.is_in_onnx_export()
    return bool(flags[1].in_onnx_export or flags[0]._is_onnx_exporting)


def _functorch_transforms() -> tuple:
    """Names of the active ``torch.func`` transforms, outermost first (``("grad",)``, ``("vmap", "grad")``)."""
    stack = torch._C._functorch.get_interpreter_stack()
    return tuple(interpreter.key().name.lower() for interpreter in stack) if stack else ()


def active_tracer(x: Optional[Tensor] = None) -> Optional[str]:
    """The tracer, exporter or transform running this call (a name for messages), or None in eager mode.

    ``x``: the layer's input; an ``fx.Proxy`` says fx is tracing even where the global flag is not set.
    ``torch.func`` transforms are named ``"torch.func.<transform>"`` (``grad``, ``vmap``, ``jvp``,
    ``functionalize``; ``jacrev`` and ``vjp`` run as ``grad``), nested ones joined by ``+``.
    """
    if torch.compiler.is_compiling():  # first: folded to a constant by the compiler
        is_exporting = getattr(torch.compiler, "is_exporting", None)
        if is_exporting is not None and is_exporting():
            return ONNX_EXPORT if torch.onnx.is_in_onnx_export() else EXPORT
        return COMPILE
    if _in_onnx_export():
        return ONNX_EXPORT
    if torch.jit.is_tracing():
        return JIT_TRACE
    if isinstance(x, torch.fx.Proxy) or _fx_symbolic_tracing():
        return FX_TRACE
    transforms = _functorch_transforms()
    if transforms:
        return FUNC_PREFIX + "+".join(transforms)
    return None


def plain_module(module: torch.nn.Module, cls: type) -> bool:
    """Whether ``module`` is exactly a ``cls`` without forward hooks, so that a fused form may compute what its
    ``forward`` would (a subclass or a hook computes or observes something else: then the module runs)."""
    return type(module) is cls and not module._forward_hooks and not module._forward_pre_hooks


def eager_autograd(x: Optional[Tensor] = None) -> bool:
    """Whether this call is recorded by eager autograd: gradients on and no tracer, exporter or ``torch.func``
    transform (:func:`active_tracer`). Hand-written Functions that keep less for backward run only then;
    ``torch.compile``'s partitioner chooses what to recompute by itself, and tracers count the plain operators."""
    return torch.is_grad_enabled() and active_tracer(x) is None


def freezes_dispatch(tracer: Optional[str], func_grad: bool = True) -> bool:
    """Whether a data-dependent path cannot run exactly under ``tracer``: every tracer and exporter records
    one call's dispatch, and ``vmap`` / ``jvp`` / ``functionalize`` cannot batch or differentiate it forward.
    ``torch.compile`` (graph breaks) and the reverse-mode ``torch.func`` transforms run it on the real input, and
    so does a trace that serves only its own input (:func:`one_input_trace`)."""
    if tracer is None or tracer == COMPILE or _ONE_INPUT_TRACE.get():
        return False
    if tracer.startswith(FUNC_PREFIX):  # func_grad: the path's Functions support torch.func (setup_context)
        return not func_grad or any(t != "grad" for t in tracer[len(FUNC_PREFIX):].split("+"))
    return True


def refuse_data_dependent(layer: str, impl: str, tracer: str) -> None:
    """The one-line error for an explicit data-dependent ``impl`` under a tracer that cannot run it."""
    raise ConfigError(f"{layer} impl='{impl}' dispatches tokens to heads by the router's choices (data-dependent "
                      f"sizes), which {tracer} cannot run exactly (a trace would freeze one input's dispatch); "
                      f"build the model with impl='auto' (masked under tracers) or impl='masked'")


def traces_by_module(x: Optional[Tensor] = None) -> bool:
    """Whether the tracer records the call module by module and Python data structures over its proxies are
    out of reach: ``torch.jit.trace`` (the FLOP counter attributes work by child module), the ONNX exporter
    built on it, and ``torch.fx`` (a ``zip`` over a split proxy cannot be traced). Code that fuses child
    modules' work (one GEMM for several routers) calls the modules themselves then."""
    return active_tracer(x) in (JIT_TRACE, ONNX_EXPORT, FX_TRACE)


_ONE_INPUT_TRACE: contextvars.ContextVar[bool] = contextvars.ContextVar("moh_vision_one_input_trace", default=False)


@contextlib.contextmanager
def one_input_trace() -> Iterator[None]:
    """Traces opened inside serve only the input they trace (the FLOP counter counts one input's sparse work):
    an explicit data-dependent ``impl`` runs under them instead of refusing."""
    token = _ONE_INPUT_TRACE.set(True)
    try:
        yield
    finally:
        _ONE_INPUT_TRACE.reset(token)
