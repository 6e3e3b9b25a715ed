"""MoH's fused routing kernel (moh_vision/attention/fused_routing.py, csrc/moh_routing.cpp) against the formulas
written out with ATen operators (moh.formula_route): gates, probabilities, selections, the load-balance loss
and every gradient, alone and inside the layer (masked and sparse), in training and inference."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Spy

from moh_vision.attention import build_attention, record_routing
from moh_vision.attention import fused_routing
from moh_vision.attention.fused_routing import fused_route, fused_route_merge, fused_routing_available
from moh_vision.attention.moh import formula_route

REPO = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(not fused_routing_available(), reason="no C++ compiler for torch extensions")

# (heads, shared, topk): mix + shared softmax, one shared head, no shared head, every head shared, wider pools
LAYOUTS = [(6, 2, 2), (8, 1, 3), (4, 0, 2), (6, 6, 0), (8, 4, 3), (16, 4, 7)]


def routers(heads, shared, topk):
    """(name, rows) of the routers a layer has, in the order MoH stacks them."""
    rows = [("wg", heads - shared)] if topk > 0 else []
    rows += [("wg_0", 2)] if topk > 0 and shared > 0 else []
    return rows + ([("wg_1", shared)] if shared > 1 else [])


def split(logits, heads, shared, topk):
    """The stacked logits [..., L] as formula_route takes them: one entry per router."""
    names, sizes = zip(*routers(heads, shared, topk))
    return dict(zip(names, logits.split(list(sizes), dim=-1)))


def width(heads, shared, topk):
    return sum(rows for _, rows in routers(heads, shared, topk))


def both(logits, heads, shared, topk, with_loss):
    args = (heads - shared, shared, topk, with_loss)
    x = logits.new_zeros(logits.shape[:-1] + (1,))
    return fused_route(logits, *args), formula_route(split(logits, heads, shared, topk), x, *args)


def gradients(route, logits, grad_gates, loss_weight):
    leaf = logits.detach().clone().requires_grad_()
    out = route(leaf)
    total = (out.gates * grad_gates).sum() + (loss_weight * out.loss if out.loss is not None else 0)
    total.backward()
    return leaf.grad


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_loss", [True, False])
def test_fused_route_equals_the_formulas_in_values_and_gradients(layout, with_loss):
    heads, shared, topk = layout
    torch.manual_seed(sum(layout))
    logits = torch.randn(3, 7, width(*layout), dtype=torch.float64) * 2
    fused, ref = both(logits, *layout, with_loss)
    torch.testing.assert_close(fused.gates, ref.gates, rtol=1e-13, atol=1e-14)
    if topk > 0:
        torch.testing.assert_close(fused.probs, ref.probs, rtol=1e-13, atol=1e-14)
        assert torch.equal(fused.mask, ref.mask) and torch.equal(fused.index, ref.index)
        assert fused.index.dtype == torch.long and fused.index.shape == (3, 7, topk)
    if with_loss and topk > 0:
        assert fused.loss.dtype == torch.float32
        torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-6, atol=0)
    else:
        assert fused.loss is None and ref.loss is None

    grad_gates = torch.randn_like(fused.gates)
    g_fused = gradients(lambda t: fused_route(t, heads - shared, shared, topk, with_loss), logits, grad_gates, 0.7)
    g_ref = gradients(lambda t: formula_route(split(t, *layout), t[..., :1], heads - shared, shared, topk, with_loss),
                      logits, grad_gates, 0.7)
    torch.testing.assert_close(g_fused, g_ref, rtol=1e-6, atol=1e-9)  # the loss's float32 path sets the tolerance


@needs_kernel
def test_fused_route_passes_gradcheck_and_takes_the_loss_alone():
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, width(8, 2, 3), dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fused_route(t, 6, 2, 3, False).gates, (logits,))
    loss_only = fused_route(logits, 6, 2, 3, True).loss  # the gates take no part: a gradient from the loss only
    (g,) = torch.autograd.grad(loss_only, logits)
    ref = formula_route(split(logits, 8, 2, 3), logits[..., :1], 6, 2, 3, True).loss
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-9)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_fused_route_in_single_and_half_precision(dtype, tol):
    torch.manual_seed(1)
    logits = torch.randn(4, 9, width(8, 2, 3)).to(dtype)
    fused, ref = both(logits, 8, 2, 3, True)
    assert fused.gates.dtype == dtype
    torch.testing.assert_close(fused.gates, ref.gates, rtol=tol, atol=tol)
    assert (fused.mask.sum(-1) == 3).all()
    torch.testing.assert_close(fused.loss, ref.loss, rtol=tol, atol=tol)


@needs_kernel
def test_ties_go_to_the_lower_head():
    """A zero router ties every routed head: the kernel and the formulas take the first k; partial ties rank the
    lower head first, and every (index, mask) pair agrees."""
    out = fused_route(torch.zeros(2, 3, width(8, 2, 3)), 6, 2, 3, False)
    ref = formula_route(split(torch.zeros(2, 3, width(8, 2, 3)), 8, 2, 3), torch.zeros(2, 3, 1), 6, 2, 3, False)
    assert out.index.tolist() == ref.index.tolist() == [[[0, 1, 2]] * 3] * 2
    assert torch.equal(out.mask, ref.mask) and torch.equal(out.gates, ref.gates)
    torch.testing.assert_close(out.gates[..., 2:5], torch.ones(2, 3, 3))  # mix 1, renormalised uniform x k
    from moh_vision.attention.routing import topk_mask
    probs = torch.tensor([[0.1, 0.3, 0.1, 0.3, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    index, mask = topk_mask(probs, 3)
    assert index.tolist() == [[1, 3, 4], [0, 1, 2]]
    assert mask.tolist() == [[0, 1, 0, 1, 1], [1, 1, 1, 0, 0]]
    torch.manual_seed(0)
    probs = torch.randn(4, 9, 6).softmax(-1)
    for k in range(7):
        index, mask = topk_mask(probs, k)
        assert torch.equal(index, probs.topk(k, dim=-1).indices)  # no ties: what torch.topk gives
        assert torch.equal(mask, torch.zeros_like(probs).scatter(-1, index, 1.0))


@needs_kernel
@pytest.mark.parametrize("options", [dict(activation_ratio=0.5, impl="masked"), dict(activation_ratio=0.75, impl="sparse"),
                                     dict(shared_heads=0, topk=2, impl="masked"), dict(shared_heads=1, topk=3, impl="masked"),
                                     dict(activation_ratio=1.0, impl="masked")])
@pytest.mark.parametrize("training", [True, False])
def test_layer_with_the_kernel_equals_the_layer_with_the_formulas(options, training, monkeypatch):
    """Output, every parameter's and the input's gradient, the recorded aux loss and statistics."""
    torch.manual_seed(3)
    m = build_attention("moh", 48, 6, **options).double().train(training)
    with torch.no_grad():
        for name in ("wg", "wg_0", "wg_1"):
            if hasattr(m, name):
                getattr(m, name).weight.normal_(0, 0.5)
    x = torch.randn(3, 9, 48, dtype=torch.float64)
    assert m.uses_fused_routing(x)

    def run():
        xi = x.clone().requires_grad_()
        with record_routing(m, keep_selection=True) as routing:
            y = m(xi)
        (y.square().mean() + routing.aux_loss()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return y.detach(), xi.grad, grads, routing

    y, gx, grads, routing = run()
    with monkeypatch.context() as patch:
        patch.setattr(m, "fused_router_weights", lambda *args: None)
        y_ref, gx_ref, grads_ref, routing_ref = run()
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-10)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-6, atol=1e-10, msg=name)
    assert len(routing.records) == len(routing_ref.records) == 1
    (rec,), (rec_ref,) = routing.records, routing_ref.records
    if training and m.topk > 0:
        torch.testing.assert_close(rec.aux_loss, rec_ref.aux_loss, rtol=1e-6, atol=0)
    else:
        assert rec.aux_loss is None and rec_ref.aux_loss is None
    torch.testing.assert_close(rec.stats["load"], rec_ref.stats["load"], rtol=0, atol=0)
    if m.topk == 0:
        assert rec.stats["entropy"] is None and rec_ref.stats["entropy"] is None
    else:
        torch.testing.assert_close(rec.stats["entropy"], rec_ref.stats["entropy"], rtol=1e-6, atol=1e-7)
    assert torch.equal(rec.selection, rec_ref.selection)


@needs_kernel
@pytest.mark.parametrize("layout", [(6, 2, 2), (8, 1, 3), (4, 0, 2), (6, 6, 0), (16, 4, 7)])
@pytest.mark.parametrize("heads_layout", ["sdpa", "contiguous"])
@pytest.mark.parametrize("with_loss", [True, False])
def test_route_merge_equals_route_then_merge_heads(layout, heads_layout, with_loss):
    """The kernel's gated merge is ``merge_heads(heads, gates)`` of its own routing (the same products, bit for bit),
    its routing :func:`fused_route`'s on the same (strided) logits, and its gradients (heads, logits, through the
    merge and the loss) theirs; float64 gradcheck."""
    h, shared, topk = layout
    torch.manual_seed(sum(layout))
    B, N, d = 2, 7, 5
    wide = torch.randn(B, N, 3 + width(*layout), dtype=torch.float64) * 2  # the logits: columns of a wider tensor
    heads = torch.randn(B, N, h, d, dtype=torch.float64).transpose(1, 2) if heads_layout == "sdpa" \
        else torch.randn(B, h, N, d, dtype=torch.float64)
    mha = build_attention("mha", h * d, h)
    args = (h - shared, shared, topk, with_loss)

    def kernel(o, z):
        return fused_route_merge(o, z[..., 3:], *args)

    def reference(o, z):
        routing = fused_route(z[..., 3:], *args)
        return mha.merge_heads(o, routing.gates), routing

    outs = []
    for f in (kernel, reference):
        o, z = heads.detach().clone().requires_grad_(), wide.detach().clone().requires_grad_()
        merged, routing = f(o, z)
        total = (merged * torch.linspace(-1, 1, merged.numel(), dtype=merged.dtype).view_as(merged)).sum()
        if routing.loss is not None:
            total = total + 0.7 * routing.loss
        total.backward()
        outs.append((merged, routing, o.grad, z.grad))
    (merged, routing, go, gz), (merged_ref, routing_ref, go_ref, gz_ref) = outs
    assert torch.equal(merged, merged_ref) and merged.is_contiguous()
    assert torch.equal(routing.gates, routing_ref.gates) and torch.equal(routing.mask, routing_ref.mask)
    assert (routing.loss is None) == (routing_ref.loss is None)
    if routing.loss is not None:
        assert torch.equal(routing.loss, routing_ref.loss)
    assert go.stride() == heads.stride()  # o's own layout, as attention's backward expects
    torch.testing.assert_close(go, go_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gz, gz_ref, rtol=1e-6, atol=1e-10)  # the loss's float32 path sets the tolerance
    o, z = heads.detach().clone().requires_grad_(), wide.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda o, z: fused_route_merge(o, z[..., 3:], h - shared, shared, topk, False)[0],
                                    (o, z))


@needs_kernel
def test_route_merge_takes_the_loss_alone():
    """A backward through the loss only (the merged output unused) gives the logits the loss's gradient."""
    torch.manual_seed(0)
    z = (torch.randn(2, 5, 10, dtype=torch.float64) * 2).requires_grad_()  # wg 6, wg_0 2, wg_1 2
    o = torch.randn(2, 8, 5, 3, dtype=torch.float64, requires_grad=True)
    (gz,) = torch.autograd.grad(fused_route_merge(o, z, 6, 2, 3, True)[1].loss, z)
    (gz_ref,) = torch.autograd.grad(fused_route(z, 6, 2, 3, True).loss, z)
    torch.testing.assert_close(gz, gz_ref, rtol=1e-12, atol=1e-14)


@needs_kernel
@pytest.mark.parametrize("training", [True, False])
def test_masked_layer_applies_the_gates_in_the_routing_kernel(training):
    """On the CPU's masked path the routing runs after attention and writes the gated merge: one routing operator
    each way and no gate multiply of its own (issue 43, item 3). The sparse path still routes first."""
    m = build_attention("moh", 48, 6, activation_ratio=0.75, impl="masked").train(training)
    x = torch.randn(2, 9, 48, requires_grad=training)
    with Spy() as spy, record_routing(m):
        y = m(x)
    assert spy.seen.count("moh_routing.route_merge") == 1 and "moh_routing.route" not in spy.seen
    assert "aten.mul" not in spy.seen  # the gates are multiplied inside the kernel's pass
    if training:
        loss = y.sum()
        with Spy() as spy:
            loss.backward()
        assert spy.seen.count("moh_routing.route_merge_backward") == 1 and "aten.mul" not in spy.seen
        assert spy.seen.count("aten.sum") == 2 and "aten.linalg_vecdot" not in spy.seen  # the sums: qkv's, proj's bias


@needs_kernel
def test_the_formulas_run_wherever_the_kernel_must_not(monkeypatch):
    """Under jit.trace, with a hook on a router, on learned shared heads, or switched off."""
    m = build_attention("moh", 32, 8, shared_heads=2, topk=3, impl="masked")
    x = torch.randn(2, 5, 32)
    assert m.uses_fused_routing(x)
    hook = m.wg.register_forward_hook(lambda *_: None)
    assert not m.uses_fused_routing(x)
    hook.remove()
    seen = []
    m.fused_router_weights = (lambda f: lambda t: seen.append(f(t)) or seen[-1])(m.fused_router_weights)
    torch.jit.trace(m.eval(), (x,), check_trace=False)
    assert seen == [None]
    learned = build_attention("moh", 32, 8, shared_heads="learned", activation_ratio=0.5, impl="masked")
    assert not learned.uses_fused_routing(x)
    monkeypatch.setenv(fused_routing.ENV_SWITCH, "0")
    assert fused_routing._build() is False


@needs_kernel
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout[2] > 0])
def test_fused_route_under_autocast_reads_low_precision_logits_as_the_formulas_do(layout):
    """Under autocast the router GEMM gives bf16 logits. The kernel reads them as they are and stores float32
    gates, probabilities and selection: the formulas on the logits in float32, which is what CUDA's autocast
    computes (its softmax runs in float32; the Triton kernels give the same); the logits' gradient is bf16."""
    heads, shared, topk = layout
    torch.manual_seed(sum(layout))
    logits = (torch.randn(3, 7, width(*layout)) * 2).bfloat16()
    grad_gates = torch.randn(3, 7, heads)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_route(logits, heads - shared, shared, topk, True)
        g_fused = gradients(lambda t: fused_route(t, heads - shared, shared, topk, True), logits, grad_gates, 0.7)
    ref = formula_route(split(logits.float(), *layout), logits[..., :1], heads - shared, shared, topk, True)
    g_ref = gradients(lambda t: formula_route(split(t.float(), *layout), t[..., :1], heads - shared, shared, topk,
                                              True), logits, grad_gates, 0.7)
    assert fused.gates.dtype == fused.probs.dtype == torch.float32
    torch.testing.assert_close(fused.gates, ref.gates, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.probs, ref.probs, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused.mask, ref.mask.to(fused.mask.dtype)) and torch.equal(fused.index, ref.index)
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-6, atol=0)
    assert g_fused.dtype == g_ref.dtype == torch.bfloat16
    torch.testing.assert_close(g_fused, g_ref, rtol=1e-2, atol=1e-3)  # float32 inside, rounded to bf16 once


@needs_kernel
@pytest.mark.parametrize("options", [dict(activation_ratio=0.75, impl="masked"), dict(activation_ratio=0.75, impl="sparse"),
                                     dict(shared_heads=1, topk=3, impl="masked")])
def test_layer_under_cpu_autocast_takes_the_kernel_and_gives_the_formulas_values(options, monkeypatch):
    """bf16 autocast, a training step with the recorder open: the kernel is taken (one operator forward, one
    backward, no softmax), and output, gradients, aux loss and statistics are the formulas' within bf16's
    rounding (CPU autocast runs the formulas' softmax in bf16, the kernel keeps float32 as CUDA's autocast does);
    the selection is the same (no near-tie in these inputs)."""
    torch.manual_seed(3)
    m = build_attention("moh", 48, 6, **options).train()
    with torch.no_grad():
        for name in ("wg", "wg_0", "wg_1"):
            if hasattr(m, name):
                getattr(m, name).weight.normal_(0, 0.5)
    x = torch.randn(3, 9, 48)

    def run():
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), record_routing(m, keep_selection=True) as routing:
            y = m(xi)
            (y.float().square().mean() + routing.aux_loss()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return y.detach().float(), xi.grad, grads, routing

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m.uses_fused_routing(x)
    with Spy() as spy:
        y, gx, grads, routing = run()
    kernel = "moh_routing.route_merge" if options["impl"] == "masked" else "moh_routing.route"  # masked: gates in the merge
    assert kernel in spy.seen and f"{kernel}_backward" in spy.seen and "aten._softmax" not in spy.seen
    with monkeypatch.context() as patch:
        patch.setattr(m, "fused_router_weights", lambda *args: None)
        y_ref, gx_ref, grads_ref, routing_ref = run()
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **tol, msg=name)
    (rec,), (rec_ref,) = routing.records, routing_ref.records
    # CPU autocast's softmax rounds the formulas' probabilities to bf16; the kernel's stay float32 (as on CUDA)
    torch.testing.assert_close(rec.aux_loss, rec_ref.aux_loss, rtol=4e-3, atol=0)
    torch.testing.assert_close(rec.stats["load"], rec_ref.stats["load"], rtol=0, atol=0)
    torch.testing.assert_close(rec.stats["entropy"], rec_ref.stats["entropy"], rtol=4e-3, atol=1e-4)
    assert torch.equal(rec.selection, rec_ref.selection)


def test_cuda_routes_with_triton_unless_switched_off(monkeypatch):
    """On CUDA the Triton kernels are the default (timed on an H100: docs/performance.md); ``=0`` turns them off,
    and so does a layer that routes nothing or a machine without Triton."""
    monkeypatch.setattr(fused_routing, "_triton_present", lambda: True)
    monkeypatch.delenv(fused_routing.ENV_SWITCH, raising=False)
    assert fused_routing_available("cuda", 2) and not fused_routing_available("cuda", 0)
    for switch, expected in (("1", True), ("triton", True), ("0", False)):
        monkeypatch.setenv(fused_routing.ENV_SWITCH, switch)
        assert fused_routing_available("cuda", 2) is expected
    monkeypatch.setattr(fused_routing, "_triton_present", lambda: False)
    monkeypatch.delenv(fused_routing.ENV_SWITCH)
    assert not fused_routing_available("cuda", 2)
    assert not fused_routing_available("mps", 2)


# ---------------------------------------------------------------------------------------------
# The Triton twin (triton_routing.py): Triton's CPU interpreter here, compiled on a GPU (-m gpu)
# ---------------------------------------------------------------------------------------------
# Triton decides at import whether its language is interpreted: a fresh process with TRITON_INTERPRET=1
TRITON_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_fused_routing import LAYOUTS, split, width
from moh_vision.attention.moh import formula_route
from moh_vision.attention.triton_routing import triton_route
torch.manual_seed(0)
for heads, shared, topk in [layout for layout in LAYOUTS if layout[2] > 0]:
    for with_loss in (True, False):
        logits = torch.randn(3, 37, width(heads, shared, topk), dtype=torch.float64) * 2  # 111 tokens: 2 blocks
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = triton_route(a, heads - shared, shared, topk, with_loss)
        ref = formula_route(split(b, heads, shared, topk), b[..., :1], heads - shared, shared, topk, with_loss)
        torch.testing.assert_close(out[0], ref.gates, rtol=1e-6, atol=1e-7)  # float32 arithmetic inside
        torch.testing.assert_close(out[1], ref.probs, rtol=1e-6, atol=1e-7)
        assert torch.equal(out[2], ref.mask) and torch.equal(out[3], ref.index)
        grad = torch.randn_like(out[0])
        ((out[0] * grad).sum() + (0.7 * out[4] if with_loss else 0)).backward()
        ((ref.gates * grad).sum() + (0.7 * ref.loss if with_loss else 0)).backward()
        if with_loss:
            torch.testing.assert_close(out[4], ref.loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=2e-6)
ties = triton_route(torch.zeros(2, 3, width(8, 2, 3)), 6, 2, 3, False)
assert ties[3].tolist() == [[[0, 1, 2]] * 3] * 2
print("triton routing: all equal")
"""


def test_triton_routing_in_the_interpreter_equals_the_formulas():
    pytest.importorskip("triton.runtime.interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(Path(__file__).parent)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "all equal" in done.stdout


# the routing and the gated merge in one kernel each way (triton_routing.TritonRouteMerge) against the formulas
# and merge_heads: the heads in SDPA's layout and contiguous, with and without the loss
TRITON_MERGE_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_fused_routing import LAYOUTS, split, width
from moh_vision.attention import build_attention
from moh_vision.attention.moh import formula_route
from moh_vision.attention.triton_routing import triton_route_merge
torch.manual_seed(0)
for heads, shared, topk in [layout for layout in LAYOUTS if layout[2] > 0]:
    for with_loss, sdpa_layout, d in ((True, True, 5), (False, False, 8)):
        B, N = 3, 37  # 111 tokens: 2 blocks
        # with SDPA's layout the logits are columns of a wider output, as MoH's packed qkv GEMM gives them
        extra = 7 if sdpa_layout else 0
        wide = torch.randn(B, N, extra + width(heads, shared, topk), dtype=torch.float64) * 2
        o = torch.randn(B, N, heads, d, dtype=torch.float64).transpose(1, 2) if sdpa_layout \
            else torch.randn(B, heads, N, d, dtype=torch.float64)
        mha = build_attention("mha", heads * d, heads)
        wide_a, b = wide.clone().requires_grad_(), wide[..., extra:].clone().requires_grad_()
        a = wide_a[..., extra:]
        oa, ob = o.clone().requires_grad_(), o.clone().requires_grad_()
        out = triton_route_merge(oa, a, heads - shared, shared, topk, with_loss)
        ref = formula_route(split(b, heads, shared, topk), b[..., :1], heads - shared, shared, topk, with_loss)
        merged_ref = mha.merge_heads(ob, ref.gates)
        torch.testing.assert_close(out[1], ref.gates, rtol=1e-6, atol=1e-7)  # float32 arithmetic inside
        torch.testing.assert_close(out[0], merged_ref, rtol=1e-6, atol=1e-7)
        assert torch.equal(out[3], ref.mask) and torch.equal(out[4], ref.index)
        grad = torch.randn_like(out[0])
        ((out[0] * grad).sum() + (0.7 * out[5] if with_loss else 0)).backward()
        ((merged_ref * grad).sum() + (0.7 * ref.loss if with_loss else 0)).backward()
        if with_loss:
            torch.testing.assert_close(out[5], ref.loss, rtol=1e-6, atol=0)
        assert oa.grad.stride() == o.stride()
        torch.testing.assert_close(oa.grad, ob.grad, rtol=1e-6, atol=1e-7)
        # the gates' gradient is a float32 sum over d inside the kernel (float64 here in the reference)
        torch.testing.assert_close(wide_a.grad[..., extra:], b.grad, rtol=1e-4, atol=2e-5)
        assert not wide_a.grad[..., :extra].any()
print("triton route_merge: all equal")
"""


def test_triton_route_merge_in_the_interpreter_equals_the_formulas_and_merge_heads():
    from helpers import run_in_triton_interpreter
    run_in_triton_interpreter(TRITON_MERGE_SCRIPT)


@pytest.mark.parametrize("layout", [(6, 2, 2), (8, 1, 3), (4, 0, 2), (16, 4, 7)])
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("inputs", ["*bf16", "*fp32"])
def test_triton_routing_kernels_compile_for_hopper_without_spills(layout, merge, inputs, tmp_path):
    """Both kernels, with and without the merge, compiled for sm_90 with bf16 autocast's types (bf16 logits and
    heads, float32 gates) and in float32, DiT-XL's head width (72), with the warps they launch with. (The merge at
    first took [64, 128] tiles, then [64, 32] with 4 warps: 255 registers a thread and up to 22 kB spilled.)"""
    pytest.importorskip("triton")
    from helpers import assert_compiles_for_hopper_without_spills
    from moh_vision.attention import triton_routing as kernels

    heads, shared, topk = layout
    meta = kernels._meta(heads - shared, shared, topk, torch.float32, 72 if merge else 0)
    fp32 = {name: "*fp32" for name in ("G", "P", "M", "SUMS", "GG", "GL")}
    fp32.update({name: inputs for name in ("Z", "DZ", "O", "OUT", "GM", "DO")}, I="*i64")
    for fn in (kernels._route_forward, kernels._route_backward):
        assert_compiles_for_hopper_without_spills(fn, meta, fp32, meta["num_warps"], tmp_path, ints=("T", "N"),
                                                  floats=("loss_scale",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_triton_routing_in_the_layer_on_cuda(autocast, monkeypatch):
    """Compiled on a GPU, in a training step with the recorder (the masked path: the routing and its gated merge in
    one kernel each way): output, gradients, aux loss as the formulas and ``merge_heads``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = build_attention("moh", 256, 8, activation_ratio=0.75, impl="masked").cuda().train()
    x = torch.randn(4, 197, 256, device="cuda")

    def run(switch):
        monkeypatch.setenv(fused_routing.ENV_SWITCH, switch)
        assert m.uses_fused_routing(x) == (switch == "1")  # the default: Triton on CUDA
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), record_routing(m) as routing:
            y = m(xi)
            loss = y.float().square().mean() + routing.aux_loss()
        loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return y.float(), xi.grad, grads, routing.aux_loss()

    y, gx, grads, aux = run("1")
    y_ref, gx_ref, grads_ref, aux_ref = run("0")
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-4, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **tol)
