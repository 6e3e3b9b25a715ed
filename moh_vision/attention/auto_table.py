"""What ``impl="auto"`` runs, as data: thresholds measured by the benchmark, per device type and machine.

``auto_<device>.json`` and ``auto_<device>_<name>.json`` (next to this module: two kinds of CPU, and
``auto_cuda.json`` from one H100, where the sparse path lost to masked everywhere in eager mode, so it keeps
every layer masked) each hold the thresholds measured on one kind of machine:

- ``machines``: the processor names it was measured on (``/proc/cpuinfo``'s model name; a GPU's name);
  a machine whose name contains one of them (case-insensitive) uses this table. The same code costs
  differently on different processors: on a 2-core Intel Xeon VM the masked path's fixed costs weigh more
  against faster GEMMs than on a 2-core AMD EPYC VM, and a table fitted on one sent shapes to the path
  that measured slower on the other. A machine that no table names uses ``auto_<device>.json``.

- ``sdpa``: the rule for MoH over plain attention. The sparse path costs about its FLOPs bound
  (``sparse_flops_ratio``: queries, attention and output projection of the active heads over dense)
  plus an ``overhead`` that shrinks as sequences grow (``[tokens per image, overhead]`` points,
  interpolated in log(tokens)); sparse is picked when ``bound + overhead <= max_predicted`` and the
  layer lies inside what was measured (``min_dim``, ``min_head_dim``, ``min_batch_tokens`` = batch x
  tokens per call). ``overhead`` is the inference one (forward only); ``training_overhead``, when
  given, is for training calls (a module in train mode with autograd on: forward and backward), where
  the sparse path's backward saves more than its forward does. Without it both use ``overhead``.
  These curves were measured at ``min_dim``; ``wider`` (optional) lists curves measured at larger widths
  (``{"min_dim", "overhead", "training_overhead"}``), and a layer uses those of the widest measured width
  it reaches (in Python: ``SdpaRule.curves``, one :class:`WidthCurves` per width, the narrowest first).
- ``kernels``: per kernel with its own sparse driver (e.g. ``transnext_aggregated``), sparse for at
  least ``min_tokens`` per image and ``min_batch_tokens`` per call where at most ``max_active`` of the
  heads are active; ``inference_max_tokens`` (optional) keeps inference calls (forward only) with more tokens
  per image masked, where the sparse forward measured slower although its backward saves enough.
- ``provenance`` (machine, torch, dtype, threads, clock, command) and ``notes``.

``python tools/bench_attention.py ... fit=<file>`` measures and writes the ``sdpa`` rule
(:func:`moh_vision.analysis.benchmark.fit_sdpa_rule`); ``fit_from=<bench .json files>`` fits from earlier runs.
``MOH_VISION_AUTO_<DEVICE>=<file>`` (e.g. ``MOH_VISION_AUTO_CUDA``) replaces the packaged files (whatever
machines that file names). A device type with no table runs masked, the reference path.
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple

from moh_vision.errors import ConfigError

PACKAGED_DIR = Path(__file__).resolve().parent
ENV_PREFIX = "MOH_VISION_AUTO_"


Points = Tuple[Tuple[int, float], ...]


def interpolate(points: Points, tokens: int) -> Optional[float]:
    """``[tokens, overhead]`` points interpolated in log(tokens), flat past the last; None before the first."""
    if tokens < points[0][0]:
        return None
    for (n0, o0), (n1, o1) in zip(points, points[1:]):
        if tokens <= n1:
            t = (math.log(tokens) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return o0 + t * (o1 - o0)
    return points[-1][1]


@dataclass(frozen=True)
class WidthCurves:
    """The overheads measured at one width, for layers at least ``min_dim`` wide: ``overhead`` for inference
    calls, ``training_overhead`` (None: ``overhead``) for training calls."""

    min_dim: int
    overhead: Points
    training_overhead: Optional[Points] = None

    def at(self, tokens: int, training: bool) -> Optional[float]:
        points = self.training_overhead if training and self.training_overhead else self.overhead
        return interpolate(points, tokens)


@dataclass(frozen=True)
class SdpaRule:
    """Sparse MoH over ``sdpa`` where ``bound + overhead(tokens) <= max_predicted`` (see the module doc).
    ``curves``: one :class:`WidthCurves` per measured width, by increasing ``min_dim``; a layer takes those
    of the widest measured width it reaches, and layers narrower than the first run masked."""

    curves: Tuple[WidthCurves, ...]
    max_predicted: float = 1.0
    min_head_dim: int = 1
    min_batch_tokens: int = 1

    def __post_init__(self):
        widths = [c.min_dim for c in self.curves]
        if not widths or any(b <= a for a, b in zip(widths, widths[1:])):
            raise ValueError(f"SdpaRule needs curves by increasing min_dim, got widths {widths}")

    @property
    def min_dim(self) -> int:
        """The narrowest width measured: narrower layers run masked."""
        return self.curves[0].min_dim

    def curves_for(self, dim: Optional[int] = None) -> WidthCurves:
        """The curves of the widest measured width at most ``dim`` (None, or narrower: the narrowest)."""
        chosen = self.curves[0]
        for curves in self.curves[1:]:
            if dim is not None and dim >= curves.min_dim:
                chosen = curves
        return chosen

    def overhead_at(self, tokens: int, training: bool = False, dim: Optional[int] = None) -> Optional[float]:
        """The measured overhead at ``tokens`` per image, of inference or of training calls, for a layer
        ``dim`` wide (default: the narrowest measured); None below the shortest measured length."""
        return self.curves_for(dim).at(tokens, training)

    def pays(self, tokens: int, batch: int, dim: int, head_dim: int, bound: float, training: bool = False) -> bool:
        """Whether the sparse path is predicted faster for a layer whose sparse FLOPs are ``bound`` of dense,
        in a training call (forward and backward) or an inference one."""
        if dim < self.min_dim or head_dim < self.min_head_dim or batch * tokens < self.min_batch_tokens:
            return False  # outside what was measured
        overhead = self.overhead_at(tokens, training, dim)
        return overhead is not None and bound + overhead <= self.max_predicted + 1e-9


@dataclass(frozen=True)
class KernelRule:
    """Sparse for at least ``min_tokens`` per image and ``min_batch_tokens`` per call, at most ``max_active`` active;
    an inference call also at most ``inference_max_tokens`` per image (None: no limit)."""

    min_tokens: int
    min_batch_tokens: int
    max_active: float
    inference_max_tokens: Optional[int] = None

    def pays(self, tokens: int, batch: int, active: float, training: bool = False) -> bool:
        if not training and self.inference_max_tokens is not None and tokens > self.inference_max_tokens:
            return False
        return tokens >= self.min_tokens and batch * tokens >= self.min_batch_tokens and active <= self.max_active + 1e-9


@dataclass(frozen=True)
class AutoTable:
    """One device type's thresholds (immutable), read from ``source``."""

    source: str
    sdpa: Optional[SdpaRule] = None
    kernels: Mapping[str, KernelRule] = field(default_factory=lambda: MappingProxyType({}))
    provenance: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    notes: Tuple[str, ...] = ()
    machines: Tuple[str, ...] = ()

    def measured_on(self, machine: str) -> bool:
        """Whether ``machine`` (a processor name) contains one of :attr:`machines` (case-insensitive)."""
        return any(name.casefold() in machine.casefold() for name in self.machines)

    def as_dict(self) -> Dict[str, Any]:
        """The JSON form (what :func:`parse_table` reads)."""
        out: Dict[str, Any] = {"machines": list(self.machines), "provenance": dict(self.provenance),
                               "notes": list(self.notes)}
        if self.sdpa is not None:  # the narrowest width's curves at the top level, the others as "wider"
            rule, (first, *wider) = self.sdpa, self.sdpa.curves
            out["sdpa"] = {**_curves_dict(first), "max_predicted": rule.max_predicted, "min_head_dim": rule.min_head_dim,
                           "min_batch_tokens": rule.min_batch_tokens}
            if wider:
                out["sdpa"]["wider"] = [_curves_dict(w) for w in wider]
        out["kernels"] = {name: {"min_tokens": r.min_tokens, "min_batch_tokens": r.min_batch_tokens,
                                 "max_active": r.max_active,
                                 **({} if r.inference_max_tokens is None else
                                    {"inference_max_tokens": r.inference_max_tokens})}
                          for name, r in self.kernels.items()}
        return out


def _curves_dict(curves: WidthCurves) -> Dict[str, Any]:
    out = {"min_dim": curves.min_dim, "overhead": [list(p) for p in curves.overhead]}
    if curves.training_overhead is not None:
        out["training_overhead"] = [list(p) for p in curves.training_overhead]
    return out


def _fields(data: Any, where: str, required: Tuple[str, ...], optional: Tuple[str, ...] = ()) -> Dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(required) - set(optional))
    missing = [k for k in required if k not in data]
    if unknown or missing:
        raise ConfigError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    return data


def _number(value: Any, where: str, integer: bool = False, low: float = 0.0) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value >= low or not math.isfinite(value):
        raise ConfigError(f"{where}: expected {'an integer' if integer else 'a number'} >= {low}, got {value!r}")
    return value


def _overhead_points(points: Any, where: str) -> Points:
    if not isinstance(points, list) or not points:
        raise ConfigError(f"{where}: expected a non-empty list of [tokens, overhead]")
    parsed = []
    for i, p in enumerate(points):
        if not isinstance(p, list) or len(p) != 2:
            raise ConfigError(f"{where}[{i}]: expected [tokens, overhead], got {p!r}")
        parsed.append((_number(p[0], f"{where}[{i}] tokens", True, 1),
                       float(_number(p[1], f"{where}[{i}] overhead", low=-1.0))))
    if any(b[0] <= a[0] for a, b in zip(parsed, parsed[1:])):
        raise ConfigError(f"{where}: token counts must increase")
    return tuple(parsed)


def _width_curves(d: Dict[str, Any], where: str, min_dim: int) -> WidthCurves:
    training = _overhead_points(d["training_overhead"], f"{where}.training_overhead") if "training_overhead" in d else None
    return WidthCurves(min_dim, _overhead_points(d["overhead"], f"{where}.overhead"), training)


def _sdpa_rule(data: Any, where: str) -> SdpaRule:
    d = _fields(data, where, ("overhead",),
                ("max_predicted", "min_dim", "min_head_dim", "min_batch_tokens", "training_overhead", "wider"))
    ints = {k: _number(d[k], f"{where}.{k}", True, 1) for k in ("min_dim", "min_head_dim", "min_batch_tokens") if k in d}
    curves = [_width_curves(d, where, ints.pop("min_dim", 1))]
    for i, w in enumerate(d.get("wider", [])):
        at = f"{where}.wider[{i}]"
        w = _fields(w, at, ("min_dim", "overhead"), ("training_overhead",))
        curves.append(_width_curves(w, at, _number(w["min_dim"], f"{at}.min_dim", True, 1)))
    max_predicted = float(_number(d.get("max_predicted", 1.0), f"{where}.max_predicted"))
    try:  # SdpaRule checks the widths' order
        return SdpaRule(tuple(curves), max_predicted, **ints)
    except ValueError:
        raise ConfigError(f"{where}.wider: min_dim must increase, starting above the rule's min_dim") from None


def _kernel_rule(data: Any, where: str) -> KernelRule:
    d = _fields(data, where, ("min_tokens", "min_batch_tokens", "max_active"), ("inference_max_tokens",))
    limit = d.get("inference_max_tokens")
    return KernelRule(_number(d["min_tokens"], f"{where}.min_tokens", True, 1),
                      _number(d["min_batch_tokens"], f"{where}.min_batch_tokens", True, 1),
                      float(_number(d["max_active"], f"{where}.max_active")),
                      None if limit is None else _number(limit, f"{where}.inference_max_tokens", True, 1))


def parse_table(data: Any, source: str) -> AutoTable:
    """An :class:`AutoTable` from its JSON form; a malformed one raises a one-line :class:`ConfigError`."""
    where = f"auto thresholds {source}"
    d = _fields(data, where, (), ("machines", "sdpa", "kernels", "provenance", "notes"))
    kernels = d.get("kernels", {})
    if not isinstance(kernels, dict):
        raise ConfigError(f"{where}.kernels: expected a mapping of kernel name to rule")
    provenance = d.get("provenance", {})
    if not isinstance(provenance, dict):
        raise ConfigError(f"{where}.provenance: expected a mapping")
    notes, machines = d.get("notes", []), d.get("machines", [])
    for name, value in (("notes", notes), ("machines", machines)):
        if not isinstance(value, list) or not all(isinstance(n, str) and n.strip() for n in value):
            raise ConfigError(f"{where}.{name}: expected a list of non-empty strings")
    return AutoTable(source=source, machines=tuple(machines),
                     sdpa=_sdpa_rule(d["sdpa"], f"{where}.sdpa") if d.get("sdpa") is not None else None,
                     kernels=MappingProxyType({str(k): _kernel_rule(v, f"{where}.kernels.{k}") for k, v in kernels.items()}),
                     provenance=MappingProxyType(dict(provenance)), notes=tuple(notes))


def load_table(path) -> AutoTable:
    """Read and check one thresholds file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"auto thresholds {path}: cannot read ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"auto thresholds {path}: not JSON ({err.msg}, line {err.lineno})") from None
    return parse_table(data, str(path))


def write_table(table: AutoTable, path) -> Path:
    """Write ``table`` as JSON (atomically: a temporary file renamed over ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table.as_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def cpu_name() -> str:
    """This machine's processor model (``/proc/cpuinfo``'s model name where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=None)
def machine_name(device_type: str) -> str:
    """The name a table's ``machines`` are matched against: the CPU model for ``cpu``, the GPU's name for
    ``cuda`` (current device), empty for other device types."""
    if device_type == "cpu":
        return cpu_name()
    if device_type == "cuda":
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return ""


def default_table_path(device_type: str) -> Path:
    """``auto_<device>.json``: the table of machines that no packaged table names."""
    return PACKAGED_DIR / f"auto_{device_type}.json"


def packaged_tables(device_type: str) -> Tuple[AutoTable, ...]:
    """Every packaged table of ``device_type``: ``auto_<device>.json`` (the default) first, then
    ``auto_<device>_*.json`` by name."""
    default = default_table_path(device_type)
    others = sorted(PACKAGED_DIR.glob(f"auto_{device_type}_*.json"))
    return tuple(load_table(path) for path in ([default] if default.is_file() else []) + others)


@lru_cache(maxsize=None)
def _cached(device_type: str, override: Optional[str], machine: str) -> Optional[AutoTable]:
    if override:
        return load_table(override)
    tables = packaged_tables(device_type)
    measured_here = [t for t in tables if t.measured_on(machine)]
    if measured_here:
        return measured_here[0]
    default = default_table_path(device_type)
    return next((t for t in tables if Path(t.source) == default), None)  # none: auto runs masked


def auto_table(device_type: str) -> Optional[AutoTable]:
    """The thresholds for ``device_type`` (``cpu``, ``cuda``, ...): ``$MOH_VISION_AUTO_<DEVICE>`` if set, else
    the packaged table measured on this kind of machine (:meth:`AutoTable.measured_on`; none: the default
    ``auto_<device>.json``); None where nothing was measured (auto then runs masked)."""
    return _cached(device_type, os.environ.get(ENV_PREFIX + device_type.upper()) or None, machine_name(device_type))
