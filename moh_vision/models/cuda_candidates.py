"""CUDA forms of TransNeXt's pieces that a GPU run can switch on, to time the whole model with them.

Each is exact against the model's own form and waits for a GPU measurement to replace it (docs/performance.md):

* ``flex``: the aggregated attention through FlexAttention (:mod:`~moh_vision.models.flex_aggregated`) instead of
  the Triton operator;
* ``triton_dwconv``: the ConvGLU's depthwise convolution in Triton (:mod:`~moh_vision.models.triton_depthwise`)
  instead of cuDNN's;
* ``compiled_dwgrad``: under ``torch.compile``, that convolution's backward written out (the flipped kernel's
  convolution and nine shifted sums that inductor fuses, ``transnext._DepthwiseTokens``), as the CPU runs it,
  instead of cuDNN's backward.

``MOH_VISION_TRANSNEXT_CUDA=flex,triton_dwconv`` (any of them, comma-separated) turns them on for CUDA tensors; the
CPU and every other device keep the model's forms. ``bash tools/gpu_checks.sh <out> candidates`` times each against
the default in one call.
"""
from __future__ import annotations

import os

import torch

from moh_vision.errors import ConfigError

SWITCH = "MOH_VISION_TRANSNEXT_CUDA"
CANDIDATES = ("flex", "triton_dwconv", "compiled_dwgrad")


@torch.compiler.assume_constant_result  # a compiled graph reads it once, as the environment it was compiled in
def use_candidate(name: str) -> bool:
    """Whether ``MOH_VISION_TRANSNEXT_CUDA`` turns on the candidate ``name``; an unknown entry is a one-line error."""
    value = os.environ.get(SWITCH, "")
    chosen = {entry.strip() for entry in value.split(",") if entry.strip()}
    unknown = sorted(chosen - set(CANDIDATES))
    if unknown:
        raise ConfigError(f"{SWITCH}={value}: unknown {', '.join(unknown)}; choose from {', '.join(CANDIDATES)}")
    return name in chosen


def candidate_on(name: str, x: torch.Tensor) -> bool:
    """Whether the candidate ``name`` runs on ``x``: a CUDA tensor (not an ``fx`` proxy, whose device cannot steer
    control flow) with the candidate switched on (:func:`use_candidate`)."""
    return isinstance(x, torch.Tensor) and x.is_cuda and use_candidate(name)
