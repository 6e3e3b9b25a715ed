"""FLOP counting: dense-equivalent and active GFLOPs of a model, built on fvcore.

Convention (one for the whole project: ``summary.json``, ``tools/flops.py``, the README):

* **fvcore's**: one fused multiply-add is one flop (so "GFLOPs" are GMACs, as in the TransNeXt, DiT and MoH papers);
  forward pass only; one input (batch 1); the model in eval mode.
* ``gflops`` (dense-equivalent, what papers publish): every head of every layer computed, as the official MoH code does:
  ``linear``, convolutions, ``matmul`` / ``bmm`` / ``einsum``, attention cores (``scaled_dot_product_attention``'s
  ``QK^T`` and ``AV``, which fvcore skips), the routers, and fvcore's per-element estimates for normalisation and
  pooling.
* ``pointwise_gflops``: element-wise and reduction arithmetic (adds, gates, softmax, GELU, L2-normalisation, top-k), one
  flop per output element (reductions: per input element; softmax: three), reported beside ``gflops``, not in it.
* Ops that cost no arithmetic (:data:`FREE_OPS`, each group with its reason) count zero. Any other op is listed in
  ``uncounted_ops``, logged as a warning, and fails the tests of every registered model family.

Active GFLOPs (what the activated heads need). A trace sees one input, so the data-dependent routing is counted from
each routed layer's configuration: a layer with ``a`` of ``h`` heads active per token (MoH: ``shared_heads + topk``;
MoA: ``topk`` experts; the variant's ``active_heads()``) has active fraction ``f = a / h``, and
``active = dense - (1 - f) * per_head_query_work``, the work an exact sparse execution would do only for the selected
(token, head) pairs: the query projection (``q``, ``q_proj``, a fused ``qkv``'s query rows; ``q_norm``), the layer's own
attention-core ops (``QK^T``, ``AV``; TransNeXt's window, pooled-key and learnable-token terms) and the output
projection ``proj``. Keys and values (any query may attend to any key), aggregated attention's pooled features and
position-bias MLP, the routers and everything outside the attention do not scale. Which child of a layer is which is
declared by the layer's kernel and variant (``flops_roles``: ``per_head``, ``query_rows`` or ``fixed``): nothing here
knows a variant or a parameter name. A dense model's active GFLOPs equal its GFLOPs.

Extending: a custom op (a ``torch.library`` op, or an ``autograd.Function`` traced as ``prim::PythonOp.<ClassName>``)
gets a handle with :func:`register_op_handle`."""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moh_vision.attention import (active_head_fraction, flops_roles_of, record_routing,
                                  routed_layer_names, routed_modules)
from moh_vision.ops import Kernels

log = logging.getLogger(__name__)

Handle = Callable[[List[Any], List[Any]], Any]

POINTWISE_PREFIX = "pointwise."  # op-count keys under this prefix go to ``pointwise_gflops``


# -- Shapes of traced values -------------------------------------------------------------------------------------------
def _shape(value) -> Optional[List[int]]:
    """Sizes of a traced tensor value, or None (not a tensor, or sizes unknown)."""
    try:
        return list(value.type().sizes()) if value.isCompleteTensor() else None
    except RuntimeError:
        return None


def _numel(value) -> int:
    shape = _shape(value)
    return math.prod(shape) if shape is not None else 0


# -- Multiply-add handles (counted in ``gflops``) ----------------------------------------------------------------------
def matmul_flops(inputs, outputs) -> Counter:
    """``matmul`` / ``mm`` / ``bmm``: output elements x contraction length (any broadcasting)."""
    a, out = _shape(inputs[0]), _shape(outputs[0])
    return Counter({"matmul": math.prod(out) * a[-1]})


def baddbmm_flops(inputs, outputs) -> Counter:
    """``baddbmm(input, a, b)``: the batched product plus one add per output element."""
    a, out = _shape(inputs[1]), _shape(outputs[0])
    return Counter({"matmul": math.prod(out) * a[-1], POINTWISE_PREFIX + "add": math.prod(out)})


def sdpa_flops(inputs, outputs) -> Counter:
    """``scaled_dot_product_attention(q, k, v, attn_mask, ...)``: ``QK^T`` and ``AV`` multiply-adds
    (``batch * L * S * (E + Ev)``); scaling, mask and softmax are point-wise."""
    q, k, v = _shape(inputs[0]), _shape(inputs[1]), _shape(inputs[2])
    batch, L, E = math.prod(q[:-2]), q[-2], q[-1]
    S, Ev = k[-2], v[-1]
    scores = batch * L * S
    has_mask = len(inputs) > 3 and _shape(inputs[3]) is not None
    pointwise = scores * (1 + 3 + int(has_mask))  # scale, softmax (3), mask add
    return Counter({"scaled_dot_product_attention": scores * (E + Ev), POINTWISE_PREFIX + "attention_softmax": pointwise})


def aggregated_attention_flops(inputs, outputs) -> Counter:
    """TransNeXt's ``moh_vision::aggregated_attention(q [B, h, N, d], k, v, k_pool [B, h, P, d], ..., local_weight [B,
    h, N, L], ...)``: ``QK^T`` and ``AV`` over each query's ``L`` window keys and ``P`` pooled keys (what the window
    copies' matmuls counted); biases, mask, softmax and the local weight's add point-wise."""
    q, k_pool, local_weight = _shape(inputs[0]), _shape(inputs[3]), _shape(inputs[7])
    scores = math.prod(q[:-1]) * (local_weight[-1] + k_pool[-2])
    return Counter({"aggregated_attention": 2 * scores * q[-1],
                    POINTWISE_PREFIX + "attention_softmax": scores * (2 + 3) + math.prod(local_weight)})


def einsum_flops(inputs, outputs) -> Counter:
    """``einsum``: one operand is a permutation (free) or a reduction (point-wise); two or more operands are counted by
    fvcore (optimal contraction path, multiply-adds)."""
    from fvcore.nn.jit_handles import einsum_flop_jit
    operands = list(inputs[1].node().inputs())
    if len(operands) > 1:
        return Counter({"einsum": einsum_flop_jit(inputs, outputs)})
    equation = inputs[0].toIValue().replace(" ", "")
    source, _, target = equation.partition("->")
    if sorted(source) == sorted(target):
        return Counter()
    return Counter({POINTWISE_PREFIX + "einsum_sum": _numel(operands[0])})


def _import_fvcore() -> None:
    """Import ``fvcore.nn`` without the FutureWarning of its ``focal_loss`` (``torch.jit.script`` at import time, which
    recent torch deprecates; a loss we do not use): only that message, only during this import."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        import fvcore.nn  # noqa: F401


def _fvcore_handles() -> Dict[str, Handle]:
    _import_fvcore()
    from fvcore.nn.jit_handles import (addmm_flop_jit, batchnorm_flop_jit, conv_flop_jit, elementwise_flop_counter,
                                       linear_flop_jit, norm_flop_counter)
    return {
        "aten::addmm": addmm_flop_jit,
        "aten::linear": linear_flop_jit,
        "aten::_convolution": conv_flop_jit,
        "aten::batch_norm": batchnorm_flop_jit,
        "aten::group_norm": norm_flop_counter(2),
        "aten::layer_norm": norm_flop_counter(2),
        "aten::instance_norm": norm_flop_counter(1),
        "aten::upsample_nearest2d": elementwise_flop_counter(0, 1),
        "aten::upsample_bilinear2d": elementwise_flop_counter(0, 4),
        "aten::adaptive_avg_pool1d": elementwise_flop_counter(1, 0),
        "aten::adaptive_avg_pool2d": elementwise_flop_counter(1, 0),
        "aten::avg_pool2d": elementwise_flop_counter(1, 0),
        "aten::grid_sampler": elementwise_flop_counter(0, 4),
    }


# -- Point-wise handles (counted in ``pointwise_gflops``) --------------------------------------------------------------
def _per_output(name: str, scale: float = 1) -> Handle:
    def handle(inputs, outputs) -> Counter:
        return Counter({POINTWISE_PREFIX + name: scale * _numel(outputs[0])})
    return handle


def _per_input(name: str, scale: float = 1) -> Handle:
    def handle(inputs, outputs) -> Counter:
        return Counter({POINTWISE_PREFIX + name: scale * _numel(inputs[0])})
    return handle


ELEMENTWISE_OPS = (
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "reciprocal", "abs", "sign",
    "exp", "log", "log2", "log1p", "sqrt", "rsqrt", "pow", "square", "sin", "cos", "erf",
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "tanh", "softplus", "hardtanh", "leaky_relu",
    "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "maximum", "minimum", "lerp", "addcmul",
    "masked_fill", "masked_fill_", "where", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "__and__", "__or__", "floor", "ceil", "round", "remainder", "fmod",
    "floor_divide", "index_add", "index_add_",
)
REDUCTION_OPS = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "linalg_vector_norm", "norm",
                 "frobenius_norm", "logsumexp", "var", "std", "cumsum", "prod", "topk", "sort", "any", "all")
SOFTMAX_OPS = ("softmax", "_softmax", "log_softmax", "_log_softmax")


def _pointwise_handles() -> Dict[str, Handle]:
    handles: Dict[str, Handle] = {f"aten::{op}": _per_output(op.strip("_")) for op in ELEMENTWISE_OPS}
    handles.update({f"aten::{op}": _per_input(op) for op in REDUCTION_OPS})
    handles.update({f"aten::{op}": _per_input("softmax", 3) for op in SOFTMAX_OPS})  # exp, sum, divide per element
    return handles


# -- Ops that cost no arithmetic, by reason ----------------------------------------------------------------------------
_FREE_GROUPS = {
    "metadata only (a view of the same memory, or a shape query)": (
        "view", "view_as", "reshape", "_reshape_alias", "flatten", "unflatten", "permute", "transpose", "t",
        "squeeze", "unsqueeze", "unsqueeze_", "expand", "expand_as", "split", "split_with_sizes", "chunk",
        "unbind", "select", "slice", "narrow", "movedim", "unfold", "alias", "detach", "size", "numel", "dim",
        "Int", "Float", "ScalarImplicit", "IntImplicit", "FloatImplicit", "Bool", "lift_fresh", "resolve_conj",
        "resolve_neg"),
    "data movement without arithmetic (copies, concatenation, gathers, scatters, padding, im2col)": (
        "contiguous", "clone", "copy_", "to", "type_as", "cat", "stack", "index", "index_select", "gather",
        "scatter", "scatter_", "index_put", "index_put_", "repeat", "repeat_interleave", "constant_pad_nd", "pad",
        "im2col", "roll", "flip", "one_hot", "embedding", "masked_select", "nonzero"),
    "allocation or constants (no input data read)": (
        "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "empty", "empty_like", "new_zeros",
        "new_ones", "new_empty", "new_full", "arange", "linspace", "tensor", "scalar_tensor"),
    "identity at inference (eval mode)": ("dropout", "dropout_", "feature_dropout", "alpha_dropout"),
}

#: ``aten`` op -> why it counts zero flops.
FREE_OPS: Dict[str, str] = {f"aten::{op}": reason for reason, ops in _FREE_GROUPS.items() for op in ops}


# -- The handle table and its extension point --------------------------------------------------------------------------
_EXTRA_HANDLES: Dict[str, Handle] = {}


def register_op_handle(op: str, handle: Handle) -> None:
    """Count ``op`` (a traced op name: ``aten::...``, ``ns::custom_op``, ``prim::PythonOp.<Function>``) with
    ``handle(inputs, outputs)``, which returns a number of multiply-adds or a ``Counter``; keys starting with
    ``"pointwise."`` go to ``pointwise_gflops``."""
    _EXTRA_HANDLES[op] = handle


def op_handles() -> Dict[str, Handle]:
    """Every handle :func:`flop_report` uses."""
    handles = {**_pointwise_handles(), **_fvcore_handles()}
    handles.update({
        "aten::matmul": matmul_flops,
        "aten::mm": matmul_flops,
        "aten::bmm": matmul_flops,
        "aten::baddbmm": baddbmm_flops,
        "aten::einsum": einsum_flops,
        "aten::scaled_dot_product_attention": sdpa_flops,
        "moh_vision::aggregated_attention": aggregated_attention_flops,
    })
    handles.update(_EXTRA_HANDLES)
    return handles


def _analysis_class():
    _import_fvcore()
    from fvcore.nn.jit_analysis import JitModelAnalysis

    class FlopAnalysis(JitModelAnalysis):
        """fvcore's analysis with this module's handles and free-op list (instead of fvcore's defaults, which skip sdpa
        and silently ignore some ops that do cost, e.g. ``relu``)."""

        def __init__(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...]):
            super().__init__(model, inputs)
            self._ignored_ops = set(FREE_OPS)
            self.set_op_handle(**op_handles())
            self.unsupported_ops_warnings(False).uncalled_modules_warnings(False)

    return FlopAnalysis


# -- Which parts of a routed attention layer scale with its active fraction --------------------------------------------
# the layer's own attention core
QUERY_WISE_OPS = ("scaled_dot_product_attention", "aggregated_attention", "matmul", "bmm", "einsum", "mm")


def active_heads(module: nn.Module) -> Tuple[int, int]:
    """``(active heads per token, heads)`` of an attention module, as its variant declares them."""
    return int(module.active_heads()), int(module.num_heads)


@dataclass
class LayerFlops:
    """One routed attention layer: dense multiply-adds, the part that scales, and the active count."""
    name: str
    num_heads: int
    active_heads: int
    dense: float
    scaled: float

    @property
    def fraction(self) -> float:
        return self.active_heads / self.num_heads

    @property
    def active(self) -> float:
        return self.dense - (1.0 - self.fraction) * self.scaled


@dataclass
class FlopReport:
    params: int
    flops: float  # multiply-adds, dense-equivalent
    pointwise: float
    layers: List[LayerFlops] = field(default_factory=list)
    by_operator: Dict[str, float] = field(default_factory=dict)
    uncounted_ops: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    active_head_fraction: Optional[float] = None  # active heads per token / heads, over all attention layers
    routed_layers: int = 0  # layers where a token uses fewer heads than there are (registry.routed_layer_names)

    @property
    def active_flops(self) -> float:
        return self.flops - sum(layer.dense - layer.active for layer in self.layers)

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"params": self.params, "gflops": self.flops / 1e9,
                               "active_gflops": self.active_flops / 1e9, "pointwise_gflops": self.pointwise / 1e9,
                               "routed_layers": self.routed_layers}
        if self.active_head_fraction is not None:
            out["active_head_fraction"] = self.active_head_fraction
        if self.uncounted_ops:
            out["uncounted_ops"] = ", ".join(f"{op} x{n}" for op, n in sorted(self.uncounted_ops.items()))
        return out


def _macs(counter: Counter) -> float:
    return float(sum(v for k, v in counter.items() if not k.startswith(POINTWISE_PREFIX)))


def _layer_flops(name: str, module: nn.Module, counts: Dict[str, Counter], notes: List[str]) -> LayerFlops:
    total = counts.get(name, Counter())
    own = Counter(total)
    scaled = 0.0
    roles = flops_roles_of(module)  # declared by the layer's kernel and variant
    for child_name, child in module.named_children():
        child_counts = counts.get(f"{name}.{child_name}" if name else child_name, Counter())
        own.subtract(child_counts)
        macs = _macs(child_counts)
        role = roles.get(child_name)
        if role == "per_head":
            scaled += macs
        elif role == "query_rows":
            scaled += macs * (module.num_heads * module.head_dim) / child.out_features
        elif role != "fixed" and macs:
            notes.append(f"{name}.{child_name}: no flops role declared by {type(module).__name__}, counted as not "
                         f"scaling")
    scaled += float(sum(v for k, v in own.items() if k in QUERY_WISE_OPS))
    heads_active, heads = active_heads(module)
    return LayerFlops(name, heads, heads_active, _macs(total), scaled)


# -- Tracing -----------------------------------------------------------------------------------------------------------
# What the trace runs: the aggregated attention as one operator (its window products would otherwise be point-wise ops),
# everything else as its reference formula (what a kernel computes, in operators fvcore counts).
TRACED_KERNELS = Kernels(aggregated="fused", routing="reference", depthwise="reference", recompute="reference")


@contextlib.contextmanager
def traced_kernels(model: nn.Module) -> Iterator[None]:
    """Every module's ``kernels`` set to :data:`TRACED_KERNELS` while tracing, restored after."""
    held = [(m, m.kernels) for m in model.modules() if isinstance(getattr(m, "kernels", None), Kernels)]
    try:
        for module, _ in held:
            module.kernels = TRACED_KERNELS
        yield
    finally:
        for module, kernels in held:
            module.kernels = kernels


class _CallWithKeywords(nn.Module):
    """Lets the trace pass keyword inputs that cannot be given by position."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        super().__init__()
        self.model, self.names = model, tuple(names)

    def forward(self, x, *values):
        return self.model(x, **dict(zip(self.names, values)))


def _trace_inputs(model: nn.Module, x: torch.Tensor, model_kwargs: Dict[str, Any]) -> Tuple[nn.Module, tuple, str]:
    """(module to trace, positional inputs, prefix of the model's module names in the trace)."""
    if not model_kwargs:
        return model, (x,), ""
    try:
        bound = inspect.signature(model.forward).bind(x, **model_kwargs)
        if not bound.kwargs:
            return model, tuple(bound.args), ""
    except TypeError:
        pass
    return _CallWithKeywords(model, list(model_kwargs)), (x, *model_kwargs.values()), "model."


def flop_report(model: nn.Module, input_shape: Sequence[int],
                model_kwargs: Optional[Dict[str, Any]] = None) -> FlopReport:
    """Count one traced forward of ``model`` (every head: dense-equivalent) on a batch-1 ``input_shape`` (C, H, W)
    input; ``model_kwargs``: the other forward inputs (DiT: ``{"t": ..., "y": ...}``), batch 1, moved to its device."""
    param = next(model.parameters())
    dtype = param.dtype if param.is_floating_point() else torch.float32
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, *input_shape, generator=generator).to(param.device, dtype)
    kwargs = {k: (v.to(param.device) if torch.is_tensor(v) else v) for k, v in (model_kwargs or {}).items()
              if v is not None}  # a trace takes tensors only; None means "the default" anyway
    target, inputs, prefix = _trace_inputs(model, x, kwargs)

    was_training = model.training
    model.eval()
    try:
        # a recorder of its own: an outer one (a training step's) must not collect the traced forwards
        with traced_kernels(model), torch.no_grad(), record_routing(model):
            analysis = _analysis_class()(target, inputs)
            counts = {name[len(prefix):] if name.startswith(prefix) else name: c
                      for name, c in analysis.by_module_and_operator().items()}
            total = analysis.by_operator()
            unsupported = dict(analysis.unsupported_ops())
    finally:
        model.train(was_training)

    notes: List[str] = []
    layers = [_layer_flops(name, module, counts, notes) for name, module in routed_modules(model)]
    report = FlopReport(params=sum(p.numel() for p in model.parameters()), flops=_macs(total),
                        pointwise=float(sum(v for k, v in total.items() if k.startswith(POINTWISE_PREFIX))),
                        layers=layers, by_operator={k: float(v) for k, v in total.items()},
                        uncounted_ops=unsupported, notes=notes, active_head_fraction=active_head_fraction(model),
                        routed_layers=len(routed_layer_names(model)))
    for note in notes:
        log.warning("FLOPs: %s", note)
    if unsupported:
        log.warning("FLOPs: ops with no flop handle were not counted: %s", report.as_dict()["uncounted_ops"])
    return report


def count_flops(model: nn.Module, input_shape: Sequence[int],
                model_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``params``, ``gflops`` (dense-equivalent), ``active_gflops``, ``pointwise_gflops``, ``routed_layers`` (defined in
    the module docstring) of one forward on an ``input_shape`` (C, H, W) input; ``uncounted_ops`` if any."""
    return flop_report(model, input_shape, model_kwargs).as_dict()
