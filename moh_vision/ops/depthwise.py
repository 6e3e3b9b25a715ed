"""TransNeXt's 3x3 depthwise convolution of tokens ``[B, N, C]`` laid out as an ``H x W`` image (zero padding).

Op ``depthwise_conv`` (config key ``kernels.depthwise``):

* ``reference``: the official layout, a contiguous NCHW image (``transpose``, copy, ``F.conv2d``, a group per channel):
  cuDNN's and oneDNN's NCHW depthwise kernels, not the channels-last grouped ones with slow shapes (pytorch#34977);
* ``channels_last``: the tokens read in place as a channels-last image (no copy; its output is tokens again): the
  CPU's default, where oneDNN's channels-last kernels and the element-wise work after them on contiguous tokens ran
  the default run's step 1.35x faster;
* ``triton``: the CUDA candidate, reading the tokens in place (:mod:`~moh_vision.ops.depthwise_triton`);
* ``written_grad``: the reference forward with its backward written out (the input's gradient as the convolution
  with the flipped kernel, the weight's as nine shifted sums that ``torch.compile`` fuses), a candidate under
  ``torch.compile`` where cuDNN's or oneDNN's own depthwise backward is slow."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import EAGER_OR_COMPILED, Op
from .triton import triton_available

Tensor = torch.Tensor


def depthwise_conv_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int) -> Tensor:
    """``F.conv2d`` (3x3, zero padding, one group per channel) of tokens ``[B, N, C]`` as a contiguous
    ``[B, C, H, W]`` image (the official TransNeXt layout) -> ``[B, N, C]``."""
    return _conv_image(_image(x, height, width).contiguous(), weight, bias)


def _image(x: Tensor, height: int, width: int) -> Tensor:
    B, N, C = x.shape
    return x.transpose(1, 2).reshape(B, C, height, width)


def _conv_image(image: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return F.conv2d(image, weight, bias, padding=1, groups=image.shape[1]).flatten(2).transpose(1, 2)


def param_grads_reference(x: Tensor, grad: Tensor, height: int, width: int):
    """The 3x3 depthwise convolution's weight ``[C, 1, 3, 3]`` and bias ``[C]`` gradients from its input and output
    gradient (tokens of a ``height x width`` image): per channel, the nine sums of the gradient times the input
    shifted by each tap, and the gradient's sum."""
    B, N, C = x.shape
    padded = F.pad(x.reshape(B, height, width, C), (0, 0, 1, 1, 1, 1))
    g = grad.reshape(B, height, width, C)
    # each row first, then the rows: inductor's loops for this order ran the whole sum 1.3x faster at TransNeXt-T's
    # stage 1 ([4, 56, 56, 384], one thread) than for one sum over the three axes
    taps = [(padded[:, i:i + height, j:j + width] * g).sum(2).sum((0, 1)) for i in range(3) for j in range(3)]
    return torch.stack(taps, dim=1).view(C, 1, 3, 3), grad.sum((0, 1))


class _WrittenGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.size, ctx.has_bias = (height, width), bias is not None
        return depthwise_conv_reference(x, weight, bias, height, width)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = depthwise_conv_reference(grad, weight.flip(-1, -2), None, *ctx.size) if needs[0] else None
        grad_weight, grad_bias = param_grads_reference(x, grad, *ctx.size) if needs[1] or needs[2] else (None, None)
        return grad_x, grad_weight if needs[1] else None, grad_bias if ctx.has_bias and needs[2] else None, None, None


DEPTHWISE = Op("depthwise_conv", key="depthwise", reference=depthwise_conv_reference, auto={"cpu": "channels_last"})


@DEPTHWISE.implement("channels_last")
def depthwise_conv_channels_last(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int) -> Tensor:
    return _conv_image(_image(x, height, width), weight, bias)


@DEPTHWISE.implement("written_grad", tracers=EAGER_OR_COMPILED)
def depthwise_conv_written_grad(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int) -> Tensor:
    return _WrittenGrad.apply(x, weight, bias, height, width)


@DEPTHWISE.implement("triton", devices=("cuda",), available=triton_available)
def depthwise_conv_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int) -> Tensor:
    from .depthwise_triton import depthwise_conv_triton as conv
    return conv(x, weight, bias, height, width)


def depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int,
                   kernel: str = "auto") -> Tensor:
    """The 3x3 depthwise convolution of tokens ``[B, N, C]`` as an ``height x width`` image, by the implementation
    ``kernel`` (``kernels.depthwise``) chooses."""
    return DEPTHWISE(kernel, x, weight, bias, height, width)
