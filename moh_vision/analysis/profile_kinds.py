"""Kinds of work in a ``torch.profiler`` profile: an operator's (CUDA: a kernel's) kind by its name, and the time of a
profile's events summed by kind. ``benchmarks/bench_backbones.py`` (profile=true) and the trainer's
``trainer.profile=<first>:<last>`` (:mod:`moh_vision.engine.profiling`) both sort by these."""
from __future__ import annotations

import re
from typing import Dict, Iterable, List

import torch

# Kinds of work an operator (CUDA: a kernel) does, by its name: the first pattern that matches names it. The compiler's
# generated kernels come first (their names list the operators they fused, convolutions' epilogues included),
# collectives next (NCCL's kernels, gloo's and c10d's operators), convolutions before GEMMs (cuDNN's convolutions are
# "implicit GEMM" kernels). "copies": copies, fills, concatenations and gathers; "elementwise": point-wise arithmetic
# and activations, eager and the optimizers' multi-tensor kernels. Names are single words, as the docs' figure markers
# quote keys.
OP_CATEGORIES = (
    ("compiled_pointwise", r"^triton_(poi|red|per)_|cpp_fused|compiledfxgraph"),
    ("communication", r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"),
    ("convolution", r"conv|cudnn|fprop|dgrad|wgrad|winograd|depthwise"),
    ("attention", r"aggregated|attention|flash|fmha|scaled_dot|sdpa|_attn"),
    ("gemm", r"gemm|xmma|cutlass|cublas|^triton_tem_|^aten::(mm|addmm|bmm|baddbmm|addbmm|_addmm_activation)$"),
    ("normalisation", r"layer_norm|batch_norm|group_norm|rms_norm"),
    ("copies", r"copy|clone|contiguous|memcpy|memset|fill|^aten::(cat|stack|index|index_put_?)$"),
    ("elementwise", r"elementwise|multi_tensor_apply|_foreach_|fused_adam|^aten::(add|sub|rsub|mul|div|neg|abs|sign|"
                    r"exp|log|log1p|sqrt|rsqrt|reciprocal|pow|erf|sin|cos|tanh|sigmoid|relu|gelu|silu|mish|softplus|"
                    r"hardswish|leaky_relu|threshold|clamp|clamp_min|clamp_max|maximum|minimum|where|lerp|addcmul|"
                    r"addcdiv|masked_fill|dropout|native_dropout|eq|ne|lt|le|gt|ge)(_backward)?_?$"),
)
_PATTERNS = tuple((kind, re.compile(pattern)) for kind, pattern in OP_CATEGORIES)

DEVICE_KINDS = (torch.autograd.DeviceType.CUDA,)  # where a profile on a GPU counts its time: the kernels


def op_category(name: str) -> str:
    """The kind of work an operator or kernel named ``name`` does (:data:`OP_CATEGORIES`), else ``"other"`` (reductions,
    softmax, indexing arithmetic, autograd's bookkeeping)."""
    lowered = name.lower()
    return next((kind for kind, pattern in _PATTERNS if pattern.search(lowered)), "other")


def counted_events(events: Iterable, device: torch.device) -> List:
    """The events whose own time a profile on ``device`` sums, each once: on CUDA the device's events (a CPU operator's
    device time is its kernels', already there), on the CPU the operators; ``record_function`` ranges
    (``ProfilerStep#``, ``Optimizer.step``, ...) left out. Works on ``prof.events()`` and on ``prof.key_averages()``."""
    kinds = DEVICE_KINDS if device.type == "cuda" else (torch.autograd.DeviceType.CPU,)
    return [e for e in events if e.device_type in kinds and not e.is_user_annotation]


def own_time_us(event, device: torch.device) -> float:
    """An event's own time (µs) on the clock a profile on ``device`` counts."""
    return event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total


def time_by_kind(events: Iterable, device: torch.device) -> Dict[str, float]:
    """Milliseconds of own time of :func:`counted_events` per kind (:func:`op_category`), largest first."""
    by_kind: Dict[str, float] = {}
    for event in counted_events(events, device):
        micros = own_time_us(event, device)
        if micros > 0:
            kind = op_category(event.key)
            by_kind[kind] = by_kind.get(kind, 0.0) + micros / 1e3
    return dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
