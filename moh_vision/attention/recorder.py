"""How routed layers hand their auxiliary loss and routing statistics to the caller.

An attention module keeps nothing of a forward pass on itself. The caller who wants what a forward decided opens a
recorder for that forward::

    with record_routing(model) as routing:
        logits = model(x)
    loss = criterion(logits, y) + routing.aux_loss(coef=0.01)   # official MoH: 0.01 x mean over layers
    stats = routing.stats()                                      # {layer name: {"load", "entropy", ...}}

Outside a recorder a routed layer computes its output and nothing else (no loss, no statistics). The recorder is found
through a context variable, so two recorders in two threads never mix, and a module holds no reference to it:
``copy.deepcopy``, ``pickle`` and EMA copies work at any point. Code that ``torch.compile`` traces reads it from a plain
slot instead (:func:`active_recorder`), which every torch release traces, so a compiled model is one graph with the
recorder open.

A layer hands over the tensors its forward made anyway (its selection, router probabilities, aux loss); the statistics
(per-head load, router entropy) are computed from them only when the caller reads ``stats()`` or ``record.stats``,
outside the forward, so they add nothing to a forward's (or a compiled graph's) work. Forwards that autograd replays
during ``backward`` (gradient checkpointing) are not recorded a second time."""
from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch
from timm.utils.model import unwrap_model
from torch import nn

Tensor = torch.Tensor

_ACTIVE: contextvars.ContextVar[Optional["RoutingRecorder"]] = contextvars.ContextVar(
    "moh_vision_routing_recorder", default=None)


@dataclass
class LayerRecord:
    """What one routed layer decided in one forward call. The statistics and the selection are computed from
    ``active`` and ``probs`` when first read (:attr:`stats`, :attr:`selection`), not in the forward."""

    module: nn.Module
    aux_loss: Optional[Tensor]           # with its graph (training forwards only)
    active: Tensor                       # 0/1 (or bool) which heads each token used, heads along ``heads_dim``
    probs: Optional[Tensor] = None       # router probabilities (detached), heads along ``heads_dim``
    heads_dim: int = -1
    extra: Dict[str, Any] = field(default_factory=dict)  # variant-specific statistics (detached)
    gates: Optional[Tensor] = None       # [B, N, h], only with keep_selection=True
    keep_selection: bool = False
    shared_prefix: int = 0               # heads 0..shared_prefix-1 always on and not in ``active``
    _stats: Optional[Dict[str, Any]] = field(default=None, repr=False)

    @property
    def selection(self) -> Optional[Tensor]:
        """``[B, N, h]`` bool, which heads each token used (only with ``keep_selection=True``)."""
        return self._active_last().bool() if self.keep_selection else None

    @property
    def stats(self) -> Dict[str, Any]:
        """``load`` (fraction of tokens that used each head), ``entropy`` (mean router entropy in nats, None if nothing
        is routed), ``num_heads``, ``shared_heads``, ``topk``, ``active_heads`` and the variant's extras."""
        if self._stats is None:
            with torch.no_grad():
                active = self._active_last().float()
                load = active.mean(dim=tuple(range(active.dim() - 1)))
                entropy = None if self.probs is None else mean_entropy(self.probs, dim=self.heads_dim)
                m = self.module
                self._stats = {"load": load, "entropy": entropy, "num_heads": active.shape[-1],
                               "shared_heads": getattr(m, "shared_heads", 0), "topk": getattr(m, "topk", 0),
                               "active_heads": m.active_heads(), **self.extra}
        return self._stats

    def _active_last(self) -> Tensor:
        active = self.active.movedim(self.heads_dim, -1)
        if self.shared_prefix:
            active = torch.cat([active.new_ones(*active.shape[:-1], self.shared_prefix), active], dim=-1)
        return active


def mean_entropy(probs: Tensor, dim: int = -1) -> Tensor:
    """Mean over tokens of the entropy (nats) of a distribution over ``dim`` (default: the last)."""
    p = probs.float()
    return -(p * p.clamp_min(1e-12).log()).sum(dim=dim).mean()


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. a checkpointed block's recomputation). Eager only: the
    graph-task query cannot be traced, and a compiled model's checkpointed recomputation runs inside its
    compiled backward, which never calls back into this Python."""
    return torch._C._current_graph_task_id() != -1


class RoutingRecorder:
    """Collects the :class:`LayerRecord` of every routed layer called while it is open.

    Args:
        model: the model whose module names label the records (``stats()`` keys); layers outside it are named by their
            class. A DDP / ``torch.compile`` wrapper is fine: names are relative to the plain model inside.
        keep_selection: also keep each token's selected heads and gates (routing analysis).
    """

    def __init__(self, model: Optional[nn.Module] = None, keep_selection: bool = False):
        self.model = unwrap_model(model) if model is not None else None
        self.keep_selection = bool(keep_selection)
        self.records: List[LayerRecord] = []
        self._token: Optional[contextvars.Token] = None
        self._names: Optional[Dict[int, str]] = None
        self._outer: Optional["RoutingRecorder"] = None

    # --- scope --------------------------------------------------------------------------------
    def __enter__(self) -> "RoutingRecorder":
        if self._token is not None:
            raise RuntimeError("this RoutingRecorder is already open")
        self._token = _ACTIVE.set(self)
        self._outer, _TRACED.recorder = _TRACED.recorder, self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)
        _TRACED.recorder, self._outer = self._outer, None
        self._token = None

    # --- what layers call ---------------------------------------------------------------------
    def add(self, record: LayerRecord) -> None:
        self.records.append(record)

    # --- what callers read --------------------------------------------------------------------
    def name_of(self, module: nn.Module) -> str:
        if self.model is None:
            return type(module).__name__
        if self._names is None:
            self._names = _module_names(self.model)
        found = self._names.get(id(module))
        if found is None or found[0]() is not module:  # a module added since the names were taken: take them again
            self._names = _module_names(self.model, fresh=True)
            found = self._names.get(id(module))
        return found[1] if found is not None and found[0]() is module else type(module).__name__

    def named_records(self) -> Iterator[tuple]:
        for record in self.records:
            yield self.name_of(record.module), record

    def aux_loss(self, coef: float = 0.01) -> Tensor:
        """``coef`` times the layers' auxiliary losses, each variant's reduced its own way (``aux_reduction``: MoH's
        official mean over layers, MoA's official sum); a zero scalar when no layer made one (eval, dense models)."""
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
            param = _first_parameter(self.model) if self.model is not None else None
            return torch.zeros((), device=param.device if param is not None else None)
        return coef * total

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per routed layer (by module name) the :attr:`LayerRecord.stats` of its last call (``load`` sums to the active
        heads per token)."""
        return {name: dict(record.stats) for name, record in self.named_records()}


# {model: {id(module): (weak reference to the module, its name), "first_parameter": weak reference}}: a memo of each
# model's module names, so that a training step's recorder does not walk the model (held weakly: it keeps no model
# alive, and no model holds it)
_NAMES: "weakref.WeakKeyDictionary[nn.Module, Dict[int, Any]]" = weakref.WeakKeyDictionary()


def _module_names(model: nn.Module, fresh: bool = False) -> Dict[int, Any]:
    names = None if fresh else _NAMES.get(model)
    if names is None:
        names = _NAMES[model] = {id(m): (weakref.ref(m), n) for n, m in model.named_modules()}
        first = next(model.parameters(), None)
        names["first_parameter"] = weakref.ref(first) if first is not None else None
    return names


def _first_parameter(model: nn.Module) -> Optional[Tensor]:
    """The model's first parameter (its device: where a zero aux loss goes), from the memo of its names."""
    ref = _module_names(model)["first_parameter"]
    return ref() if ref is not None else None


def record_routing(model: Optional[nn.Module] = None, keep_selection: bool = False) -> RoutingRecorder:
    """Open a :class:`RoutingRecorder` (use as ``with record_routing(model) as routing: ...``)."""
    return RoutingRecorder(model, keep_selection=keep_selection)


class _Slot:
    """The recorder that compiled code sees (:func:`active_recorder`): a plain attribute of one object that lives
    as long as the process, which ``torch.compile`` reads and guards on like any attribute (a ContextVar it
    cannot trace before torch 2.13, and each new recorder object would be a new guard)."""

    __slots__ = ("recorder",)

    def __init__(self):
        self.recorder: Optional[RoutingRecorder] = None


_TRACED = _Slot()


def active_recorder() -> Optional[RoutingRecorder]:
    """The innermost open recorder, or None (then a routed layer records nothing). Forwards that autograd replays
    during backward see None, so checkpointing never records a layer twice. Eager code reads the context variable (per
    thread and per asyncio task); code that ``torch.compile`` traces reads :data:`_TRACED`, the innermost recorder
    opened in the process, the same one unless two threads run compiled models with recorders open at the same time."""
    if torch.compiler.is_compiling():
        return _TRACED.recorder
    recorder = _ACTIVE.get()
    if recorder is None or _in_backward():
        return None
    return recorder


def compile_model(model: nn.Module, mode: str = "default") -> nn.Module:
    """``torch.compile(model, mode=mode)``: what ``trainer.compile``, ``tools/sample.py compile=true`` and
    ``benchmarks/bench_models.py compile=true`` call. Compiled routed layers read the open recorder from
    :data:`_TRACED`, so the model is one graph with the recorder open on every supported torch (2.11, the pinned one;
    ``tests/test_compile_routing.py``)."""
    return torch.compile(model, mode=mode)
