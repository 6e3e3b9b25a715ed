"""The 3x3 depthwise convolution's weight and bias gradients as one operator on the CPU.

TransNeXt's ConvGLU runs a 3x3 depthwise convolution on tokens ``[B, N, C]`` laid out as an ``H x W`` image. Under
``torch.compile`` its backward is written out (:class:`~moh_vision.models.transnext._DepthwiseTokens`); the
weight's gradient, per channel the nine sums of the output gradient times the input shifted by each tap, and the
bias's, the gradient's sum per channel, are :func:`depthwise_param_grads_reference` in ATen operators, which
inductor fused into kernels that took 27 ms a call at TransNeXt-T's first stage (batch 4, one thread; the bias's
sum inside the GELU's backward). ``torch.ops.moh_vision.depthwise_param_grads`` (a ``torch.library`` custom op, so
``torch.compile`` keeps one graph around it) computes both in one pass over the gradient, channels innermost
(``csrc/depthwise_grad.cpp``, built on first use like the package's other C++ kernels); other devices, a CPU without
a compiler and ``MOH_VISION_DEPTHWISE_KERNEL=0`` run the reference.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

import torch
import torch.nn.functional as F

from moh_vision.extensions import load_cpu_kernels

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("csrc") / "depthwise_grad.cpp"
KERNEL_SWITCH = "MOH_VISION_DEPTHWISE_KERNEL"  # 0: the CPU runs the reference's ATen operators


def cpu_kernels_available() -> bool:
    """Whether the C++ CPU kernel (``csrc/depthwise_grad.cpp``) is loaded (built on the first call)."""
    return load_cpu_kernels("moh_depthwise", "param_grads", SOURCE, KERNEL_SWITCH,
                            "the depthwise convolution's parameter gradients")


def depthwise_param_grads_reference(x: Tensor, grad: Tensor, height: int, width: int) -> Tuple[Tensor, Tensor]:
    """The 3x3 depthwise convolution's weight gradient ``[C, 1, 3, 3]`` and bias gradient ``[C]`` from its input and
    output gradient, tokens ``[B, N, C]`` of a ``height x width`` image (zero padding): per channel, the nine sums of
    the gradient times the input shifted by each tap, and the gradient's sum."""
    B, N, C = x.shape
    padded = F.pad(x.reshape(B, height, width, C), (0, 0, 1, 1, 1, 1))
    g = grad.reshape(B, height, width, C)
    # each row first, then the rows: inductor's loops for this order ran the whole sum 1.3x faster at TransNeXt-T's
    # stage 1 ([4, 56, 56, 384], one thread) than for one sum over the three axes
    taps = [(padded[:, i:i + height, j:j + width] * g).sum(2).sum((0, 1)) for i in range(3) for j in range(3)]
    return torch.stack(taps, dim=1).view(C, 1, 3, 3), grad.sum((0, 1))


@torch.library.custom_op("moh_vision::depthwise_param_grads", mutates_args=())
def _param_grads_op(x: Tensor, grad: Tensor, height: int, width: int) -> Tuple[Tensor, Tensor]:
    return depthwise_param_grads_reference(x, grad, height, width)


@_param_grads_op.register_kernel("cpu")
def _param_grads_cpu(x, grad, height, width):
    if not cpu_kernels_available() or x.dtype not in (torch.float32, torch.float64) or grad.dtype != x.dtype:
        return depthwise_param_grads_reference(x, grad, height, width)
    return torch.ops.moh_depthwise.param_grads(x, grad, height, width)


@_param_grads_op.register_fake
def _param_grads_fake(x, grad, height, width):
    return x.new_empty(x.shape[-1], 1, 3, 3), x.new_empty(x.shape[-1])


def depthwise_param_grads(x: Tensor, grad: Tensor, height: int, width: int) -> Tuple[Tensor, Tensor]:
    """:func:`depthwise_param_grads_reference`: the operator on the CPU (the C++ kernel where it is built: a
    ``torch.compile`` on the CPU needs the same compiler), the reference's ATen operators elsewhere and with
    ``MOH_VISION_DEPTHWISE_KERNEL=0`` (which ``torch.compile`` fuses)."""
    if x.is_cpu and os.environ.get(KERNEL_SWITCH, "1") != "0":
        return torch.ops.moh_vision.depthwise_param_grads(x, grad, height, width)
    return depthwise_param_grads_reference(x, grad, height, width)
