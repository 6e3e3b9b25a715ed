"""TransNeXt's continuous position bias MLP, ``fc2(relu(fc1(table)))`` over the table of log-spaced offsets, as one
operator each way that never holds the hidden layer.

The table has one row per distinct (row offset, column offset) pair: 10,816 at TransNeXt's first stage, so the
plain operators write a ``[10816, 512]`` hidden layer (22 MiB), read it back, recompute it in backward and
differentiate it, in every layer and every step whatever the batch: on the CPU, about 190 ms of a TransNeXt-T
training step's position biases. ``torch.ops.moh_vision.position_mlp`` (a ``torch.library`` custom op, so
``torch.compile`` keeps one graph around it) computes each row's hidden vector in a buffer and reduces it at once
(``csrc/position_mlp.cpp``, built on first use like the package's other C++ kernels); its backward recomputes it
row by row. Other devices (and a CPU without a compiler, or ``MOH_VISION_POSITION_KERNEL=0``) run the same
operators written out. Equal to ``fc2(relu(fc1(table)))`` and its autograd up to rounding
(``tests/test_position_mlp.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import torch
import torch.nn.functional as F

from moh_vision.extensions import load_cpu_kernels

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("csrc") / "position_mlp.cpp"
KERNEL_SWITCH = "MOH_VISION_POSITION_KERNEL"  # 0: the CPU runs the plain operators


def cpu_kernels_available() -> bool:
    """Whether the C++ CPU kernels (``csrc/position_mlp.cpp``) are loaded (built on the first call)."""
    return load_cpu_kernels("moh_position", "forward", SOURCE, KERNEL_SWITCH, "TransNeXt's position bias MLP")


def position_mlp_reference(table: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``fc2(relu(fc1(table)))``: ``[U, 2] -> [U, H]``."""
    return F.linear(F.relu(F.linear(table, w1, b1)), w2, b2)


def _backward_plain(grad: Tensor, table: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tuple[Tensor, ...]:
    hidden = F.relu(F.linear(table, w1, b1))
    grad_hidden = (grad @ w2) * (hidden > 0)
    return grad_hidden.t() @ table, grad_hidden.sum(0), grad.t() @ hidden, grad.sum(0)


@torch.library.custom_op("moh_vision::position_mlp", mutates_args=())
def _position_mlp_op(table: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    return position_mlp_reference(table, w1, b1, w2, b2)


@torch.library.custom_op("moh_vision::position_mlp_backward", mutates_args=())
def _position_mlp_backward_op(grad: Tensor, table: Tensor, w1: Tensor, b1: Tensor,
                              w2: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward_plain(grad, table, w1, b1, w2)


@_position_mlp_op.register_kernel("cpu")
def _position_mlp_cpu(table, w1, b1, w2, b2):
    if not cpu_kernels_available():
        return position_mlp_reference(table, w1, b1, w2, b2)
    return torch.ops.moh_position.forward(table, w1, b1, w2, b2)


@_position_mlp_backward_op.register_kernel("cpu")
def _position_mlp_backward_cpu(grad, table, w1, b1, w2):
    if not cpu_kernels_available():
        return _backward_plain(grad, table, w1, b1, w2)
    return torch.ops.moh_position.backward(grad, table, w1, b1, w2)


@_position_mlp_op.register_fake
def _position_mlp_fake(table, w1, b1, w2, b2):
    return table.new_empty(table.shape[0], w2.shape[0])


@_position_mlp_backward_op.register_fake
def _position_mlp_backward_fake(grad, table, w1, b1, w2):
    return w1.new_empty(w1.shape), b1.new_empty(b1.shape), w2.new_empty(w2.shape), w2.new_empty(w2.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    table, w1, b1, w2, _ = inputs
    ctx.save_for_backward(table, w1, b1, w2)


def _backward(ctx, grad):
    grads = torch.ops.moh_vision.position_mlp_backward(grad.contiguous(), *ctx.saved_tensors)
    return (None, *grads)


_position_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def position_mlp(table: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``fc2(relu(fc1(table)))`` as the operator (the table is a constant: no gradient flows to it)."""
    return torch.ops.moh_vision.position_mlp(table, w1, b1, w2, b2)
