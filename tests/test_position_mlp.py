"""TransNeXt's position bias MLP as one operator each way (moh_vision/models/position_mlp.py): values and gradients
against ``fc2(relu(fc1(table)))`` and autograd, the plain fallback, the operator's registration (opcheck), one graph
under ``torch.compile``, and the model's position biases against the gather-and-MLP formula they replace."""
import pytest
import torch

from moh_vision.models import position_mlp as pm
from moh_vision.models import transnext as T
from moh_vision.models.build import build_model

needs_kernel = pytest.mark.skipif(not pm.cpu_kernels_available(), reason="no C++ compiler for torch extensions")


def weights(rows=300, width=64, heads=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, 2, generator=g, dtype=dtype)
    w1, b1 = torch.randn(width, 2, generator=g, dtype=dtype), torch.randn(width, generator=g, dtype=dtype)
    w2, b2 = torch.randn(heads, width, generator=g, dtype=dtype) / 8, torch.randn(heads, generator=g, dtype=dtype)
    return table, w1, b1, w2, b2


def values_and_grads(fn, table, *params):
    params = [p.detach().clone().requires_grad_() for p in params]
    out = fn(table, *params)
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out.detach(), *torch.autograd.grad((out * grad).sum(), params))


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 5e-5)])
@pytest.mark.parametrize("rows, width, heads", [(300, 64, 3), (67, 512, 12), (1, 8, 1), (10816, 512, 3)])
def test_operator_equals_the_mlp_and_its_autograd(dtype, tol, rows, width, heads):
    """Against the plain operators' float64 values and gradients; float32 within ``tol`` of each one's largest
    entry (sums over the table's rows: ATen's float32 GEMMs were up to 2.7e-4 off at 10,816 rows, the operator
    3e-5; a float64 sum over blocks of 64 rows)."""
    exact = weights(rows, width, heads)
    got = values_and_grads(pm.position_mlp, *(t.to(dtype) for t in exact))
    want = values_and_grads(pm.position_mlp_reference, *exact)
    for g, w, name in zip(got, want, ("out", "w1", "b1", "w2", "b2")):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=0, atol=tol * float(w.abs().max()), msg=name)


@needs_kernel
def test_operator_registration_and_gradcheck():
    table, *params = weights(40, 16, 2)
    torch.library.opcheck(torch.ops.moh_vision.position_mlp.default, (table, *params))
    params = [p.requires_grad_() for p in params]
    assert torch.autograd.gradcheck(lambda *p: pm.position_mlp(table, *p), params)


def test_the_plain_operators_when_the_kernel_is_off(monkeypatch):
    monkeypatch.setattr(pm, "cpu_kernels_available", lambda: False)
    args = weights(50, 32, 4)
    for g, w in zip(values_and_grads(pm.position_mlp, *args), values_and_grads(pm.position_mlp_reference, *args)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def gather_reference(attn):
    """The position bias as it was written: the MLP's modules, then one gather over both axes."""
    table = attn.cpb_fc2(attn.cpb_act(attn.cpb_fc1(attn.relative_coords_table)))
    table = table.transpose(0, 1).reshape(attn.num_heads, *attn.bias_grid)
    index_h, index_w = attn.relative_index_h, attn.relative_index_w
    return table[:, index_h[:, None, :, None], index_w[None, :, None, :]].reshape(attn.num_heads, attn.num_tokens, -1)


@needs_kernel
def test_model_position_biases_equal_the_gather_formula():
    """Every layer of a TransNeXt-Micro in float64: bias and the MLP's gradients; the CPU takes the operator."""
    model = build_model("transnext_micro").double()
    for attn in (m for m in model.modules() if isinstance(m, T._TransNeXtAttention)):
        assert attn.fused_position_mlp(attn.relative_coords_table)
        params = list(attn.cpb_fc1.parameters()) + list(attn.cpb_fc2.parameters())
        bias = attn.position_bias()
        grad = torch.randn_like(bias)
        got = (bias.detach(), *torch.autograd.grad((bias * grad).sum(), params))
        ref = gather_reference(attn)
        want = (ref.detach(), *torch.autograd.grad((ref * grad).sum(), params))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_the_modules_run_where_the_operator_must_not():
    attn = next(m for m in build_model("transnext_micro").modules() if isinstance(m, T._TransNeXtAttention))
    table = attn.relative_coords_table
    assert attn.fused_position_mlp(table)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not attn.fused_position_mlp(table)  # autocast's bf16 GEMMs, as before
    hook = attn.cpb_fc1.register_forward_hook(lambda *_: None)
    assert not attn.fused_position_mlp(table)
    hook.remove()
    seen = []
    attn.fused_position_mlp = (lambda f: lambda t: seen.append(f(t)) or seen[-1])(attn.fused_position_mlp)

    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn.position_bias() + x

    torch.jit.trace(Bias(), (torch.zeros(()),), check_trace=False)
    assert seen == [False]  # the FLOP counter's tracer sees the modules


@needs_kernel
def test_one_graph_under_compile():
    import torch._dynamo as dynamo

    args = weights(30, 16, 2, torch.float32)
    dynamo.reset()
    explained = dynamo.explain(pm.position_mlp)(*args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(pm.position_mlp)
    for g, w in zip(values_and_grads(compiled, *args), values_and_grads(pm.position_mlp_reference, *args)):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
    dynamo.reset()
