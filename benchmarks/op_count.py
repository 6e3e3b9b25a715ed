"""What a routed layer costs the host: operators dispatched, host time per call, and graphs under compile.

On a GPU a small layer's time is set by how many kernels the host launches, not by the arithmetic; each ATen operator
dispatched is (at most) one launch. :func:`steady_count` counts every operator dispatched below autograd (forward and
backward) with a ``TorchDispatchMode``, the same way for dense and MoH, so the counts measured on a CPU are the launches
a GPU would see before any fusion; the "kernels" rows leave out the views (operators that alias their input, and
``_unsafe_view``), which launch nothing. With ``dtype=bfloat16`` (or ``float16``) every call runs under CPU autocast, as
GPU training does. :func:`ops_report` puts dense and MoH side by side (``benchmarks/bench_models.py ops=true``), every
layer and model with the default kernels (all ``auto``):

* one attention layer (dims 384 / 6 heads and 768 / 12, batch 8, 196 tokens), inference, and a training forward+backward
  with the routing recorder open and the aux loss added, as the trainer runs it;
* each model pair, one inference call and one training forward+backward (recorder open, aux loss);
* host time per layer call on a negligible input (``[1, 4, 192]``, 12 heads): the fixed cost of a call;
* with ``graphs``, ``torch._dynamo.explain``: graphs and graph breaks of each model in eval and in training with the
  recorder open, and the frames compiled over three training steps with fresh recorders (1: no recompile)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Tensor = torch.Tensor

LAYER_SHAPES = ((384, 6), (768, 12))  # (dim, heads): DiT-S and DiT-B / TransNeXt-B widths
LAYER_TOKENS = (8, 196)  # batch, tokens
HOST_SHAPE = (1, 4, 192, 12)  # batch, tokens, dim, heads: an input whose arithmetic is negligible


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.views += func.is_view or func is torch.ops.aten._unsafe_view.default  # a reshape autograd sees as new
        return func(*args, **(kwargs or {}))


def count_ops(call: Callable[[], object]) -> int:
    """ATen operators that ``call()`` dispatches (forward and backward, below autograd)."""
    with _Counter() as counter:
        call()
    return counter.count


def under_autocast(call: Callable[[], None], dtype: Optional[torch.dtype]) -> Callable[[], None]:
    """``call`` run under CPU autocast to ``dtype`` (None or float32: as it is)."""
    if dtype in (None, torch.float32):
        return call

    def autocast_call() -> None:
        with torch.autocast("cpu", dtype=dtype):
            call()

    return autocast_call


def _loss(out) -> Tensor:
    return out.float().square().mean()


def training_call(model: torch.nn.Module, inputs: Tuple) -> Callable[[], None]:
    """One forward with a routing recorder open, the loss plus the aux loss, backward (as the trainer does)."""
    from moh_vision.attention import record_routing

    def call() -> None:
        with record_routing(model) as routing:
            out = model(*inputs)
        (_loss(out) + routing.aux_loss()).backward()
        model.zero_grad(set_to_none=True)

    return call


def inference_call(model: torch.nn.Module, inputs: Tuple) -> Callable[[], None]:
    def call() -> None:
        with torch.no_grad():
            model(*inputs)

    return call


def steady_count(model: torch.nn.Module, inputs: Tuple, train: bool,
                 dtype: Optional[torch.dtype] = None) -> Tuple[int, int]:
    """Operators, and operators less views, of one call (under autocast to ``dtype``) after a first, uncounted one."""
    model.train(train)
    inputs = tuple(t.clone().requires_grad_() if train and t.is_floating_point() else t for t in inputs)
    call = under_autocast(training_call(model, inputs) if train else inference_call(model, inputs), dtype)
    call()
    with _Counter() as counter:
        call()
    return counter.count, counter.count - counter.views


def count_rows(label: str, models: Dict[str, torch.nn.Module], inputs: Tuple,
               dtype: Optional[torch.dtype]) -> List[Dict]:
    """``{label}, {mode} ops`` and ``... kernels`` (less views), inference and training, for each of ``models``."""
    rows = []
    for mode in ("infer", "train"):
        counts = {name: steady_count(m, inputs, mode == "train", dtype) for name, m in models.items()}
        rows.append({"figure": f"{label}, {mode} ops", **{name: c[0] for name, c in counts.items()}})
        rows.append({"figure": f"{label}, {mode} kernels", **{name: c[1] for name, c in counts.items()}})
    return rows


def host_us(layers: Dict[str, torch.nn.Module], x: Tensor, train: bool, calls: int = 100,
            rounds: int = 15, dtype: Optional[torch.dtype] = None) -> Dict[str, float]:
    """Mean wall time (microseconds) of one call on ``x`` per layer, measured in ``rounds`` that alternate the layers
    (load on the machine hits both alike): each layer's median over rounds, and ``ratio``, the median over rounds of the
    second layer's time over the first's."""
    xi = x.clone().requires_grad_() if train else x
    calls_of = {}
    for name, model in layers.items():
        model.train(train)
        calls_of[name] = under_autocast(training_call(model, (xi,)) if train else inference_call(model, (xi,)), dtype)
        for _ in range(10):
            calls_of[name]()
    times: Dict[str, List[float]] = {name: [] for name in layers}
    for _ in range(rounds):
        for name, call in calls_of.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    first, second = list(layers)
    out = {name: round(statistics.median(t), 1) for name, t in times.items()}
    out["ratio"] = round(statistics.median(b / a for a, b in zip(times[first], times[second])), 3)
    return out


def graph_counts(model: torch.nn.Module, inputs: Tuple) -> Dict[str, int]:
    """``torch._dynamo.explain`` in eval (no grad) and in training (recorder open): graphs and breaks; and the graphs
    compiled over three training steps with a fresh recorder each (1 when nothing recompiles)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from moh_vision.attention import record_routing
    out: Dict[str, int] = {}
    for mode in ("eval", "train"):
        model.train(mode == "train")
        dynamo.reset()
        with torch.no_grad() if mode == "eval" else record_routing(model):
            explained = dynamo.explain(model)(*inputs)
        out[f"{mode}_graphs"], out[f"{mode}_breaks"] = explained.graph_count, explained.graph_break_count
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    step = training_call(compiled, inputs)
    model.train()
    for _ in range(3):
        step()
    out["train_graphs_3_steps"] = int(counters["stats"]["unique_graphs"])
    dynamo.reset()
    return out


def layer_pair(attention: Dict, dim: int, heads: int) -> Dict[str, torch.nn.Module]:
    """``{"dense": mha, "moh": attention}`` layers of width ``dim`` with ``heads`` heads."""
    from moh_vision.attention import build_attention
    from moh_vision.models.build import NON_MODULE_KEYS
    options = {k: v for k, v in attention.items() if k not in NON_MODULE_KEYS}
    return {"dense": build_attention("mha", dim, heads),
            "moh": build_attention(attention["name"], dim, heads, **options)}


def layer_rows(attention: Dict, dtype: Optional[torch.dtype] = None) -> List[Dict]:
    """Per-layer figures, dense ``mha`` against ``attention``, at :data:`LAYER_SHAPES` and on :data:`HOST_SHAPE`."""
    rows = []
    batch, tokens = LAYER_TOKENS
    for dim, heads in LAYER_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(batch, tokens, dim)
        rows += count_rows(f"one attention layer, dim {dim} / {heads} heads", layer_pair(attention, dim, heads), (x,),
                           dtype)
    batch, tokens, dim, heads = HOST_SHAPE
    x = torch.randn(batch, tokens, dim)
    layers = layer_pair(attention, dim, heads)
    for mode in ("infer", "train"):
        rows.append({"figure": f"host time per layer call [{batch}, {tokens}, {dim}], {heads} heads, {mode} (us)",
                     **host_us(layers, x, mode == "train", dtype=dtype)})
    return rows


def model_rows(moh: torch.nn.Module, dense: torch.nn.Module, label: str, batch: int = 2,
               graphs: bool = True, dtype: Optional[torch.dtype] = None) -> List[Dict]:
    """Whole-model operator counts (inference, training) and, with ``graphs``, :func:`graph_counts`."""
    from harness import model_inputs
    inputs = model_inputs(dense, batch)
    rows = count_rows(label, {"dense": dense, "moh": moh}, inputs, dtype)
    if graphs:
        counts = {k: graph_counts(m, inputs) for k, m in (("dense", dense), ("moh", moh))}
        for key in counts["dense"]:
            rows.append({"figure": f"{label}, torch.compile {key.replace('_', ' ')}",
                         "dense": counts["dense"][key], "moh": counts["moh"][key]})
    return rows


def ops_table(rows: Sequence[Dict], header: str) -> str:
    lines = [header, "", "| figure | dense | MoH | MoH / dense |", "|---|---|---|---|"]
    for r in rows:
        ratio = r.get("ratio", r["moh"] / r["dense"] if r["dense"] else None)  # timings: median of round ratios
        ratio = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"| {r['figure']} | {r['dense']} | {r['moh']} | {ratio} |")
    return "\n".join(lines) + "\n"


def ops_report(pairs: Sequence[Tuple[torch.nn.Module, torch.nn.Module, str]], attention: Optional[Dict] = None,
               graphs: bool = True, dtype: Optional[torch.dtype] = None) -> Tuple[List[Dict], str]:
    """Every figure of the module docstring, per layer (``attention``, default MoH 0.75) and per model pair."""
    attention = attention or {"name": "moh", "activation_ratio": 0.75}
    rows = layer_rows(attention, dtype)
    for moh, dense, label in pairs:
        rows += model_rows(moh, dense, label, graphs=graphs, dtype=dtype)
    precision = "float32" if dtype in (None, torch.float32) else f"{str(dtype).split('.')[-1]} autocast"
    header = (f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads, {precision}; ATen operators "
              f"dispatched per call (forward and backward, below autograd; kernels: less views); layer: {attention}")
    return rows, ops_table(rows, header)


def bench_ops(pairs: Sequence[str], img_size: int = 64, attention: Optional[Dict] = None, graphs: bool = True,
              out: Optional[str] = None, dtype: str = "float32") -> List[Dict]:
    """``bench_models.py ops=true``: :func:`ops_report` for ``moh:dense`` model pairs built at ``img_size``
    (operator counts do not depend on it), every call under CPU autocast to ``dtype`` (``bfloat16``: as GPU runs train);
    prints the table, and with ``out`` writes it and ``<out>.json``."""
    from harness import DTYPES, build_for_bench, write_record
    built = []
    for pair in pairs:
        moh, _, dense = pair.partition(":")
        built.append((build_for_bench(moh, img_size, torch.device("cpu"), attention),
                      build_for_bench(dense, img_size, torch.device("cpu")), f"{moh} vs {dense}"))
    layer_attention = {"name": "moh", "activation_ratio": 0.75, **(attention or {})}
    rows, table = ops_report(built, layer_attention, graphs=graphs, dtype=DTYPES[dtype])
    print(table)
    write_record(out, table, {"torch": torch.__version__, "img_size": img_size, "dtype": dtype, "rows": rows})
    return rows
