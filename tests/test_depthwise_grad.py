"""The depthwise convolution's parameter gradients as one operator (moh_vision/models/depthwise_grad.py): the C++
kernel and the ATen reference equal ``F.conv2d``'s weight and bias gradients, borders included."""
import pytest
import torch
import torch.nn.functional as F

from moh_vision.models import depthwise_grad as dg


def conv2d_grads(x, grad, H, W):
    """``F.conv2d``'s own weight and bias gradients for tokens ``[B, N, C]`` read as an ``H x W`` image."""
    B, N, C = x.shape
    weight = torch.zeros(C, 1, 3, 3, dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(C, dtype=x.dtype, requires_grad=True)
    out = F.conv2d(x.transpose(1, 2).reshape(B, C, H, W), weight, bias, padding=1, groups=C)
    return torch.autograd.grad(out.flatten(2).transpose(1, 2), (weight, bias), grad)


@pytest.fixture(params=["kernel", "no compiler", "switched off"])
def impl(request, monkeypatch):
    """The CPU's three paths: the C++ kernel, the operator running the reference's ATen operators (no compiler) and
    the reference itself (``MOH_VISION_DEPTHWISE_KERNEL=0``, which ``torch.compile`` fuses)."""
    if request.param == "kernel" and not dg.cpu_kernels_available():
        pytest.skip("the C++ kernel could not be built here")
    if request.param == "no compiler":
        monkeypatch.setattr(dg, "cpu_kernels_available", lambda: False)
    if request.param == "switched off":
        monkeypatch.setenv(dg.KERNEL_SWITCH, "0")
    return request.param


# (B, H, W, C): a non-square map, one row, one column, one pixel, many channels (the kernel's vector loop and tail)
@pytest.mark.parametrize("shape", [(2, 5, 7, 6), (1, 1, 9, 3), (3, 8, 1, 2), (2, 1, 1, 4), (1, 4, 3, 37)])
def test_param_grads_equal_the_convolutions(impl, shape):
    B, H, W, C = shape
    g = torch.Generator().manual_seed(0)
    x, grad = (torch.randn(B, H * W, C, generator=g, dtype=torch.float64) for _ in range(2))
    got = dg.depthwise_param_grads(x, grad, H, W)
    want = conv2d_grads(x, grad, H, W)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    got32 = dg.depthwise_param_grads(x.float(), grad.float(), H, W)
    for a, b in zip(got32, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_param_grads_operator_registration():
    x, grad = torch.randn(2, 12, 5), torch.randn(2, 12, 5)
    torch.library.opcheck(torch.ops.moh_vision.depthwise_param_grads.default, (x, grad, 3, 4))


def test_param_grads_refuse_a_wrong_token_count():
    if not dg.cpu_kernels_available():
        pytest.skip("the C++ kernel could not be built here")
    with pytest.raises(RuntimeError, match="3 x 5 is not 12 tokens"):
        torch.ops.moh_depthwise.param_grads(torch.randn(1, 12, 2), torch.randn(1, 12, 2), 3, 5)
