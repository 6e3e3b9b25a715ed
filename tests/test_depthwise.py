"""The ConvGLU's depthwise convolution (moh_vision.ops.depthwise) equals ``F.conv2d`` in its output and every gradient
under each implementation: the reference (the official NCHW layout), ``channels_last`` (the tokens read in place),
``written_grad`` (its backward written out; eager and compiled), and the Triton candidate (under Triton's
interpreter on the CPU, compiled for Hopper without register spills, and (``gpu``) on CUDA)."""
import pytest
import torch
import torch.nn.functional as F

from moh_vision.ops.depthwise import depthwise_conv_channels_last, depthwise_conv_reference, depthwise_conv_written_grad

# (B, H, W, C, k, bias): TransNeXt's 3x3 over channel blocks and a remainder, a 5x5 kernel, one token, no bias
SHAPES = [(2, 5, 7, 20, 3, True), (1, 4, 4, 3, 5, True), (3, 9, 6, 70, 3, False), (2, 1, 1, 8, 3, True)]


def conv2d(x, weight, bias, height, width):
    """The oracle, written independently of F.conv2d: per tap, the zero-padded image shifted by it times its weight."""
    B, N, C = x.shape
    k = weight.shape[-1]
    padded = F.pad(x.reshape(B, height, width, C), (0, 0, k // 2, k // 2, k // 2, k // 2))
    out = sum(padded[:, i:i + height, j:j + width] * weight[:, 0, i, j] for i in range(k) for j in range(k))
    return (out if bias is None else out + bias).reshape(B, N, C)


def values_and_grads(fn, B, H, W, C, k, bias, dtype=torch.float32, device="cpu"):
    """``fn`` on tokens as the ConvGLU passes them (one half of a ``[B, N, 2C]`` tensor), its output and the
    gradients of the tokens, the kernel and the bias, in float64 on the CPU."""
    g = torch.Generator().manual_seed(0)
    fc1 = torch.randn(B, H * W, 2 * C, generator=g).to(device, dtype)
    x = fc1[..., :C].detach().requires_grad_()
    weight = torch.randn(C, 1, k, k, generator=g).to(device, dtype).requires_grad_()
    b = torch.randn(C, generator=g).to(device, dtype).requires_grad_() if bias else None
    grad = torch.randn(B, H * W, C, generator=g).to(device, dtype)
    leaves = [t for t in (x, weight, b) if t is not None]
    out = fn(x, weight, b, H, W)
    return [t.detach().cpu().double() for t in [out, *torch.autograd.grad(out, leaves, grad)]]


def worst_error(got, want):
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, want))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[4] == 3])
@pytest.mark.parametrize("fn", [depthwise_conv_reference, depthwise_conv_channels_last, depthwise_conv_written_grad],
                         ids=["reference", "channels_last", "written"])
def test_implementations_equal_conv2d_in_float64(fn, shape):
    want = values_and_grads(conv2d, *shape, dtype=torch.float64)
    assert worst_error(values_and_grads(fn, *shape, dtype=torch.float64), want) < 1e-12


def test_written_backward_under_compile_equals_conv2d_and_has_no_convolution_backward():
    """Compiled, the written-out backward is what inductor gets: no ``convolution_backward`` in the graph."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    shape = SHAPES[0]
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(depthwise_conv_written_grad, backend=backend, fullgraph=True)
    got = values_and_grads(compiled, *shape, dtype=torch.float64)
    assert worst_error(got, values_and_grads(conv2d, *shape, dtype=torch.float64)) < 1e-12
    backward = "".join(str(g.graph) for g in backend.bw_graphs)
    assert backward and "convolution_backward" not in backward


# Under Triton's interpreter: tests/test_triton_interpreter.py runs it in a process with TRITON_INTERPRET=1.
SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_depthwise import SHAPES, conv2d, values_and_grads, worst_error
from moh_vision.ops.depthwise_triton import depthwise_conv_triton
worst = max(worst_error(values_and_grads(depthwise_conv_triton, *s), values_and_grads(conv2d, *s, dtype=torch.float64))
            for s in SHAPES)
print(worst)
assert worst < 1e-5, worst
"""


def test_kernels_compile_for_hopper_without_register_spills(tmp_path):
    """Both kernels compiled for sm_90 in bf16 at TransNeXt's 3x3 (Triton's compiler and its bundled ptxas; no GPU)."""
    pytest.importorskip("triton")
    from helpers import assert_compiles_for_hopper_without_spills
    from moh_vision.ops import depthwise_triton as kernels

    for fn, block in ((kernels._correlate, kernels.BLOCK_N), (kernels._weight_grads, kernels.WEIGHT_BLOCK_N)):
        meta = dict(K=3, HAS_BIAS=True, ROWS=16, BLOCK_N=block, BLOCK_C=kernels.BLOCK_C)
        assert_compiles_for_hopper_without_spills(fn, meta, {"Partial": "*fp32"}, 4, tmp_path,
                                                  ints=("HEIGHT", "WIDTH", "C", "TOKENS", "PER_CHUNK"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernels_on_cuda_equal_conv2d(dtype, tol):
    from moh_vision.ops.depthwise_triton import depthwise_conv_triton

    for shape in [(4, 56, 56, 384, 3, True)] + SHAPES:  # TransNeXt-T's stage 1 first
        want = values_and_grads(conv2d, *shape, dtype=torch.float64)
        got = values_and_grads(depthwise_conv_triton, *shape, dtype=dtype, device="cuda")
        assert worst_error(got, want) < tol, shape
