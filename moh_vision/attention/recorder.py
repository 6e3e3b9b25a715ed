"""How routed layers hand their auxiliary loss and routing statistics to the caller.

An attention module keeps nothing of a forward pass on itself. The caller who wants what a forward
decided opens a recorder for that forward::

    with record_routing(model) as routing:
        logits = model(x)
    loss = criterion(logits, y) + routing.aux_loss(coef=0.01)   # official MoH: 0.01 x mean over layers
    stats = routing.stats()                                      # {layer name: {"load", "entropy", ...}}

Outside a recorder a routed layer computes its output and nothing else (no loss, no statistics).
The recorder is found through a context variable, so two recorders in two threads never mix, and a
module holds no reference to it: ``copy.deepcopy``, ``pickle`` and EMA copies work at any point.

Forwards that autograd replays during ``backward`` (gradient checkpointing recomputes a block's
forward) are not recorded a second time: their loss and statistics were recorded by the first pass.
"""
from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

Tensor = torch.Tensor
log = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar[Optional["RoutingRecorder"]] = contextvars.ContextVar(
    "moh_vision_routing_recorder", default=None)


@dataclass
class LayerRecord:
    """What one routed layer decided in one forward call."""

    module: nn.Module
    aux_loss: Optional[Tensor]           # with its graph (training forwards only)
    stats: Dict[str, Any]                # detached: load per head, router entropy, head counts, ...
    selection: Optional[Tensor] = None   # [B, N, h] bool, only with keep_selection=True
    gates: Optional[Tensor] = None       # [B, N, h], only with keep_selection=True


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. a checkpointed block's recomputation). False while
    ``torch.compile`` traces a forward: the graph-task query cannot be traced (it split the graph at every
    routed layer of a compiled training step), and a compiled model's checkpointed recomputation runs inside
    its compiled backward, which never calls back into this Python."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class RoutingRecorder:
    """Collects the :class:`LayerRecord` of every routed layer called while it is open.

    Args:
        model: the model whose module names label the records (``stats()`` keys); layers outside it
            are named by their class. A DDP / ``torch.compile`` wrapper is fine: names are taken
            relative to the plain model inside.
        keep_selection: also keep each token's selected heads and gates (routing analysis).
    """

    def __init__(self, model: Optional[nn.Module] = None, keep_selection: bool = False):
        self.model = _unwrap(model) if model is not None else None
        self.keep_selection = bool(keep_selection)
        self.records: List[LayerRecord] = []
        self._token: Optional[contextvars.Token] = None
        self._names: Optional[Dict[int, str]] = None

    # --- scope --------------------------------------------------------------------------------
    def __enter__(self) -> "RoutingRecorder":
        if self._token is not None:
            raise RuntimeError("this RoutingRecorder is already open")
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)
        self._token = None

    # --- what layers call ---------------------------------------------------------------------
    def add(self, record: LayerRecord) -> None:
        self.records.append(record)

    # --- what callers read --------------------------------------------------------------------
    def name_of(self, module: nn.Module) -> str:
        if self._names is None:
            self._names = {id(m): n for n, m in self.model.named_modules()} if self.model is not None else {}
        return self._names.get(id(module), type(module).__name__)

    def named_records(self) -> Iterator[tuple]:
        for record in self.records:
            yield self.name_of(record.module), record

    def aux_loss(self, coef: float = 0.01) -> Tensor:
        """``coef`` times the layers' auxiliary losses, each variant's reduced its own way (its
        ``aux_reduction``: MoH's official mean over layers, MoA's official sum); a zero scalar when
        no layer produced one (eval mode, dense models, nothing recorded)."""
        groups: Dict[str, List[Tensor]] = {}
        for record in self.records:
            if record.aux_loss is not None:
                groups.setdefault(getattr(record.module, "aux_reduction", "mean"), []).append(record.aux_loss.float())
        total = None
        for reduction, losses in groups.items():
            stacked = torch.stack(losses)
            part = stacked.sum() if reduction == "sum" else stacked.mean()
            total = part if total is None else total + part
        if total is None:
            param = next(self.model.parameters(), None) if self.model is not None else None
            return torch.zeros((), device=param.device if param is not None else None)
        return coef * total

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per routed layer (by module name) the statistics of its last call: ``load`` (fraction of
        tokens that used each head; sums to the active heads per token), ``entropy`` (mean router
        entropy in nats, None when nothing is routed), ``num_heads``, ``shared_heads``, ``topk``."""
        return {name: dict(record.stats) for name, record in self.named_records()}


def record_routing(model: Optional[nn.Module] = None, keep_selection: bool = False) -> RoutingRecorder:
    """Open a :class:`RoutingRecorder` (use as ``with record_routing(model) as routing: ...``)."""
    return RoutingRecorder(model, keep_selection=keep_selection)


def active_recorder() -> Optional[RoutingRecorder]:
    """The innermost open recorder, or None (then a routed layer records nothing). Forwards that
    autograd replays during backward see None, so checkpointing never records a layer twice."""
    recorder = _ACTIVE.get()
    if recorder is None or _in_backward():
        return None
    return recorder


# The first release whose ``torch.compile`` traces ``ContextVar.get`` (2.11 breaks the graph there; 2.13 and
# 2.14 trace it, and recompile once, not per recorder: docs/performance.md, "Second lease").
COMPILE_TRACES_RECORDER = (2, 13)


def compile_caveat(model: nn.Module, version: Optional[str] = None) -> Optional[str]:
    """Why ``torch.compile`` (torch ``version``, default the installed one) cannot capture ``model``'s routed
    layers in one graph, or None: every routed layer looks up the open recorder through a context variable,
    which older releases' graph capture cannot trace, so each one splits the graph."""
    from torch.torch_version import TorchVersion

    from .registry import routed_modules

    version = TorchVersion(torch.__version__ if version is None else version)
    if version >= COMPILE_TRACES_RECORDER or next(routed_modules(model), None) is None:
        return None
    return (f"torch {version} cannot trace the routing recorder's ContextVar.get: torch.compile splits the graph "
            f"at every routed layer and may run slower than eager; torch >= "
            f"{'.'.join(map(str, COMPILE_TRACES_RECORDER))} compiles each model whole (requirements.txt pins 2.14.1)")


def compile_model(model: nn.Module, mode: str = "default") -> nn.Module:
    """``torch.compile(model, mode=mode)``, with a warning first where this torch would split the graph at
    every routed layer (:func:`compile_caveat`). What ``trainer.compile``, ``tools/sample.py compile=true``
    and ``tools/bench_models.py compile=true`` call."""
    caveat = compile_caveat(model)
    if caveat:
        log.warning(caveat)
    return torch.compile(model, mode=mode)


def _unwrap(model: nn.Module) -> nn.Module:
    model = getattr(model, "module", model)  # DistributedDataParallel
    return getattr(model, "_orig_mod", model)  # torch.compile
