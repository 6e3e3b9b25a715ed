"""MoH's fused routing (moh_vision/ops/routing.py: ``kernels.routing=fused``, the Triton kernels on CUDA) against the
formulas written out with ATen operators (``route``, then the gates applied in ``merge_heads``): the gated merge,
gates, probabilities, selections, the load-balance loss and every gradient, under Triton's interpreter on the CPU,
compiled for Hopper, and (``gpu``) in the layer on CUDA; and where the formulas run instead."""
import pytest
import torch
from helpers import Spy

from moh_vision.attention import build_attention, record_routing
from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels, resolved
from moh_vision.ops import routing as ops_routing
from moh_vision.ops.routing import topk_mask

# (heads, shared, topk): mix + shared softmax, one shared head, no shared head, every head shared, wider pools
LAYOUTS = [(6, 2, 2), (8, 1, 3), (4, 0, 2), (6, 6, 0), (8, 4, 3), (16, 4, 7)]


def width(heads, shared, topk):
    """Columns of the stacked logits (wg, wg_0, wg_1) of a layer with this layout."""
    return sum(ops_routing.router_widths(heads - shared, shared, topk))


def heads_of(B, h, N, d, dtype, sdpa_layout):
    """Head outputs ``[B, h, N, d]``: in SDPA's layout (a transposed ``[B, N, h, d]``) or contiguous."""
    if sdpa_layout:
        return torch.randn(B, N, h, d, dtype=dtype).transpose(1, 2)
    return torch.randn(B, h, N, d, dtype=dtype)


def test_ties_go_to_the_lower_head():
    """Partial ties rank the lower head first, and every (index, mask) pair agrees (the Triton kernels choose the
    same: the interpreter test below)."""
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


def test_the_formulas_run_wherever_the_kernels_do_not():
    """``auto``: the Triton kernels on CUDA where Triton is installed, the formulas on the CPU; an explicit ``fused``
    on the CPU is a one-line error; tracers record the formulas; a layer that routes nothing runs them too."""
    assert resolved(Kernels(), "cuda")["moh_routing"] == ("fused" if ops_routing.triton_available() else "reference")
    assert resolved(Kernels(), "cpu")["moh_routing"] == "reference"
    m = build_attention("moh", 32, 8, shared_heads=2, topk=3).eval()
    x = torch.randn(2, 5, 32)
    with Spy() as spy:
        m(x)
    assert "aten._softmax" in spy.seen  # the formulas
    fused = build_attention("moh", 32, 8, shared_heads=2, topk=3, kernels={"routing": "fused"})
    with pytest.raises(ConfigError, match="kernels.routing=fused runs on cuda, not on cpu"):
        fused(x)
    with torch.no_grad():
        traced = torch.jit.trace(fused.eval(), (x,), check_trace=False)  # tracers: the formulas, nothing refused
    fused.load_state_dict(m.state_dict())
    torch.testing.assert_close(traced(x), m(x))


# ---------------------------------------------------------------------------------------------
# The Triton kernels (routing_triton.py): Triton's CPU interpreter here, compiled on a GPU (-m gpu)
# ---------------------------------------------------------------------------------------------
# the routing and the gated merge in one kernel each way (routing_triton.TritonRouteMerge) against the formulas
# and merge_heads: the heads in SDPA's layout and contiguous, with and without the loss
# (run under the interpreter by tests/test_triton_interpreter.py)
TRITON_MERGE_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_fused_routing import LAYOUTS, heads_of, width
from moh_vision.ops.routing import merge_heads, route
from moh_vision.ops.routing_triton import triton_route_merge
torch.manual_seed(0)
for heads, shared, topk in [layout for layout in LAYOUTS if layout[2] > 0]:
    for with_loss, sdpa_layout, d in ((True, True, 5), (False, False, 8)):
        B, N = 3, 37  # 111 tokens: 2 blocks
        extra = 7 if sdpa_layout else 0  # the logits as columns of a wider output
        wide = torch.randn(B, N, extra + width(heads, shared, topk), dtype=torch.float64) * 2
        o = heads_of(B, heads, N, d, torch.float64, sdpa_layout)
        wide_a, b = wide.clone().requires_grad_(), wide[..., extra:].clone().requires_grad_()
        a = wide_a[..., extra:]
        oa, ob = o.clone().requires_grad_(), o.clone().requires_grad_()
        out = triton_route_merge(oa, a, heads - shared, shared, topk, with_loss)
        ref = route(b, heads - shared, shared, topk, with_loss)
        merged_ref = merge_heads(ob, ref.gates)
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
o = torch.randn(2, 8, 3, 4)
ties = triton_route_merge(o, torch.zeros(2, 3, width(8, 2, 3)), 6, 2, 3, False)
assert ties[4].tolist() == [[[0, 1, 2]] * 3] * 2
# under autocast: bf16 logits and heads read as they are, float32 gates (as autocast's float32 softmax gives them)
z, o = (torch.randn(3, 37, width(8, 2, 3)) * 2).bfloat16(), torch.randn(3, 8, 37, 5).bfloat16()
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = triton_route_merge(o, z, 6, 2, 3, True)
ref = route(z.float(), 6, 2, 3, True)
assert out[1].dtype == torch.float32 and out[0].dtype == torch.bfloat16
torch.testing.assert_close(out[1], ref.gates, rtol=1e-6, atol=1e-6)
torch.testing.assert_close(out[5], ref.loss, rtol=1e-6, atol=0)
# (the bf16 merged output itself: the gpu test; the interpreter does not emulate bf16 stores)
print("triton route_merge: all equal")
"""


@pytest.mark.parametrize("layout", [(6, 2, 2), (8, 1, 3), (4, 0, 2), (16, 4, 7)])
@pytest.mark.parametrize("inputs", ["*bf16", "*fp32"])
def test_triton_routing_kernels_compile_for_hopper_without_spills(layout, inputs, tmp_path):
    """Both kernels compiled for sm_90 with bf16 autocast's types (bf16 logits and heads, float32 gates) and in
    float32, DiT-XL's head width (72), with the warps they launch with. (The merge at first took [64, 128] tiles,
    then [64, 32] with 4 warps: 255 registers a thread and up to 22 kB spilled.)"""
    pytest.importorskip("triton")
    from helpers import assert_compiles_for_hopper_without_spills
    from moh_vision.ops import routing_triton as kernels

    heads, shared, topk = layout
    meta = kernels._meta(heads - shared, shared, topk, torch.float32, 72)
    fp32 = {name: "*fp32" for name in ("G", "P", "M", "SUMS", "GG", "GL")}
    fp32.update({name: inputs for name in ("Z", "DZ", "O", "OUT", "GM", "DO")}, I="*i64")
    for fn in (kernels._route_forward, kernels._route_backward):
        assert_compiles_for_hopper_without_spills(fn, meta, fp32, meta["num_warps"], tmp_path, ints=("T", "N"),
                                                  floats=("loss_scale",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_triton_routing_in_the_layer_on_cuda(autocast):
    """Compiled on a GPU, in a training step with the recorder (the routing and its gated merge in one kernel each
    way): output, gradients, aux loss as the formulas and ``merge_heads``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    fused = build_attention("moh", 256, 8, activation_ratio=0.75).cuda().train()
    reference = build_attention("moh", 256, 8, activation_ratio=0.75, kernels={"routing": "reference"}).cuda().train()
    reference.load_state_dict(fused.state_dict())
    x = torch.randn(4, 197, 256, device="cuda")

    def step(m):
        xi = x.clone().requires_grad_()
        with Spy() as spy, torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), \
                record_routing(m) as routing:
            y = m(xi)
            loss = y.float().square().mean() + routing.aux_loss()
        loss.backward()
        return y.float(), xi.grad, [p.grad.clone() for p in m.parameters()], routing.aux_loss(), spy.seen

    y, gx, grads, aux, seen = step(fused)
    y_ref, gx_ref, grads_ref, aux_ref, _ = step(reference)
    assert "aten._softmax" not in seen  # the routing ran in the Triton kernel
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-4, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **tol)
