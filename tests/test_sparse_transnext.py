"""Sparse MoH over TransNeXt's kernels (aggregated local + pooled attention, full cosine attention)
against the masked reference: outputs, input gradient and every parameter gradient (routers
included), per layer and for whole MoH-ViT models."""
import json
import math

import pytest
import timm
import torch

import moh_vision.models  # noqa: F401  (registers the TransNeXt kernels and models)
from helpers import bf16_train_outputs, load_tool, recorded_backward
from moh_vision.attention import build_attention, register_kernel
from moh_vision.attention import registry as registry_module
from moh_vision.attention.sparse import build_dispatch, kernels_supporting, sparse_forward, sparse_support
from moh_vision.errors import ConfigError
from moh_vision.models.transnext import TransNeXtAggregatedAttention, TransNeXtFullAttention, local_window_index

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes: a second intra-op thread only adds synchronisation (seconds on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


KERNELS = {
    # kernel: construction arguments (a non-square token grid; the pooled grid of 5x7 / 2 is 2x3)
    "transnext_aggregated": dict(input_resolution=(5, 7), sr_ratio=2),
    "transnext_full": dict(input_resolution=(4, 5)),
}


def perturb(module, seed, router_scale=1.0):
    """Every parameter moved off its (often zero or constant) initialisation; routers made decisive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = router_scale if name.split(".")[-2:-1] and name.split(".")[-2].startswith("wg") else 0.05
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def make_pair(kernel, dim, heads, seed=0, **opts):
    torch.manual_seed(seed)
    ref = build_attention("moh", dim, heads, kernel=kernel, impl="masked", **KERNELS[kernel], **opts)
    perturb(ref, seed)
    sparse = build_attention("moh", dim, heads, kernel=kernel, impl="sparse", **KERNELS[kernel], **opts)
    sparse.load_state_dict(ref.state_dict())
    return ref, sparse


def run(m, x, grad_out, train):
    """Forward + backward of ``sum(y * grad_out) + aux``: output, input and parameter gradients, aux loss."""
    y, x_grad, grads, routing = recorded_backward(m, x, grad_out, train)
    return y, x_grad, grads, routing.aux_loss(coef=1.0).detach()


def close(actual, expected, name="", rtol=1e-4, atol=1e-5):
    """fp32 agreement up to summation order: ``atol`` scaled by the tensor's largest entry (the
    length-scaled queries, ~10x, amplify gradients, and with them the rounding of long sums)."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=lambda m: f"{name}: {m}")


def assert_same(ref_run, run_):
    (y_ref, gx_ref, grads_ref, aux_ref), (y, gx, grads, aux) = ref_run, run_
    close(y, y_ref, "output")
    close(gx, gx_ref, "input gradient")
    torch.testing.assert_close(aux, aux_ref)
    assert grads.keys() == grads_ref.keys()
    for name, g_ref in grads_ref.items():
        assert (g_ref is None) == (grads[name] is None), name
        if g_ref is not None:
            close(grads[name], g_ref, name)


def check_layer(kernel, batch, dim, heads, opts, train=True, seed=0):
    ref, sparse = make_pair(kernel, dim, heads, seed=seed, **opts)
    tokens = ref.num_tokens
    assert sparse.execution_path(torch.zeros(1, tokens, dim)) == "sparse"
    x, grad_out = torch.randn(batch, tokens, dim), torch.randn(batch, tokens, dim)
    assert_same(run(ref, x, grad_out, train), run(sparse, x, grad_out, train))
    return ref, sparse


# ---------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------
LAYER_CASES = [
    # batch, dim, heads, options
    (2, 48, 6, dict(shared_heads=0, topk=2)),  # no shared head, no wg_0
    (3, 48, 6, dict(shared_heads=2, topk=2)),
    (2, 48, 6, dict(shared_heads=1, topk=5)),  # top-k = the whole routed pool; one shared head
    (2, 48, 6, dict(shared_heads=3, topk=1)),
    (2, 48, 6, dict(activation_ratio=0.5)),  # the ratio policy: 1 shared + 2 routed
    (2, 40, 4, dict(shared_heads=1, topk=2, head_dim=12, qkv_bias=False)),  # inner dim != dim, no q bias
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("batch,dim,heads,opts", LAYER_CASES)
def test_layer_sparse_equals_masked(kernel, batch, dim, heads, opts):
    check_layer(kernel, batch, dim, heads, opts)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_layer_sparse_equals_masked_in_eval(kernel):
    check_layer(kernel, 2, 48, 6, dict(shared_heads=2, topk=2), train=False)


def test_full_kernel_explicit_softmax_sparse_equals_masked():
    check_layer("transnext_full", 2, 48, 6, dict(shared_heads=1, topk=3, fused_attn=False))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_learned_shared_heads_run_sparse_with_their_head_order(kernel):
    """A frozen learned partition that shares heads 1 and 4: the driver takes the head order
    (shared first) instead of a permuted copy of the module."""
    ref, sparse = make_pair(kernel, 48, 6, shared_heads="learned", activation_ratio=0.67, learn_shared_steps=0)
    assert ref.learned_shared and (ref.shared_heads, ref.topk) == (2, 2)
    mask = torch.tensor([False, True, False, False, True, False])
    for m in (ref, sparse):
        m.shared_mask.copy_(mask)
    x, grad_out = torch.randn(2, ref.num_tokens, 48), torch.randn(2, ref.num_tokens, 48)
    assert sparse.execution_path(x) == "sparse"
    assert_same(run(ref, x, grad_out, True), run(sparse, x, grad_out, True))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_routed_head_nobody_chose(kernel):
    """Gates and indices handed straight to the driver: routed head 0 is never selected, so it has
    no packed row (an empty per-head batch)."""
    ref, m = make_pair(kernel, 36, 6, seed=1, shared_heads=2, topk=2)
    B, N, E = 2, ref.num_tokens, 4
    x = torch.randn(B, N, 36, requires_grad=True)
    index = torch.stack([torch.randperm(E - 1)[:2] + 1 for _ in range(B * N)]).view(B, N, 2)
    assert build_dispatch(index, E).lengths[0] == 0
    routed = torch.zeros(B, N, E).scatter_(-1, index, torch.rand(B, N, 2) + 0.5)
    gates = torch.cat([torch.rand(B, N, 2) + 0.5, routed], dim=-1).requires_grad_(True)
    y_ref = ref.output(ref.heads(x), gates)
    y = sparse_forward(m, x, gates, index)
    close(y, y_ref)
    grad_out = torch.randn_like(y)
    g_ref = torch.autograd.grad(y_ref, [x, gates, *ref.parameters()], grad_out, allow_unused=True)
    g = torch.autograd.grad(y, [x, gates, *m.parameters()], grad_out, allow_unused=True)
    mask = torch.cat([torch.ones(B, N, 2), (routed > 0).float()], -1)  # unselected gates: unused
    close(g[0], g_ref[0])
    close(g[1] * mask, g_ref[1] * mask)
    for a, b in zip(g[2:], g_ref[2:]):
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b)


def test_window_index_matches_unfold():
    H, W, ws = 4, 6, 3
    index = local_window_index((H, W), ws, torch.device("cpu"))
    image = torch.arange(1.0, H * W + 1).view(1, 1, H, W)
    unfolded = torch.nn.functional.unfold(image, ws, padding=1)[0].t()  # [N, 9], 0 = padding
    assert torch.equal(index + 1, unfolded.long())


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_sparse_under_bfloat16_autocast_close_to_masked(kernel):
    ref, sparse = make_pair(kernel, 48, 6, shared_heads=2, topk=2)
    x = torch.randn(2, ref.num_tokens, 48)
    outs = bf16_train_outputs((ref, sparse), x)
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)


# ---------------------------------------------------------------------------------------------
# Which kernels run sparse, and what auto picks
# ---------------------------------------------------------------------------------------------
def test_transnext_kernels_declare_sparse():
    assert {"sdpa", "transnext_aggregated", "transnext_full"} <= set(kernels_supporting("sparse"))


def test_a_subclass_registered_as_another_kernel_does_not_inherit_the_sparse_path():
    @register_kernel("test_cosine_variant")
    class Variant(TransNeXtFullAttention):  # its math could differ: it must declare support itself
        pass

    try:
        assert sparse_support(Variant) is None and sparse_support(TransNeXtFullAttention) is not None
        with pytest.raises(ConfigError, match="supports kernel"):
            build_attention("moh", 48, 6, kernel="test_cosine_variant", input_resolution=4, shared_heads=2,
                            topk=2, impl="sparse")
        m = build_attention("moh", 48, 6, kernel="test_cosine_variant", input_resolution=4, activation_ratio=0.5)
        assert m.execution_path(torch.zeros(1, 16, 48)) == "masked"
    finally:
        registry_module._KERNELS.pop("test_cosine_variant")
        for key in [key for key in registry_module._COMPOSED if key[1] is Variant]:
            registry_module._COMPOSED.pop(key)


AUTO_CASES = [
    # kernel, dim, grid side, batch, ratio, what auto runs (see the measurements in transnext.py)
    ("transnext_aggregated", 288, 14, 2, 0.5, "sparse"),  # stage 3 of transnext_tiny at 224 px
    ("transnext_aggregated", 192, 14, 8, 0.75, "masked"),  # stage 3 of transnext_micro: 3/4 active, no faster
    ("transnext_aggregated", 288, 14, 8, 0.67, "sparse"),  # 2/3 active: faster in training
    ("transnext_aggregated", 72, 56, 1, 0.5, "sparse"),  # stage 1 (3 heads: 2 active)
    ("transnext_aggregated", 192, 14, 1, 0.75, "masked"),  # one 196-token image: no faster
    ("transnext_aggregated", 96, 8, 4, 0.5, "masked"),  # shorter than measured
    ("transnext_full", 576, 7, 8, 0.5, "masked"),  # stage 4 at 224 px: 49 tokens, slower
    ("transnext_full", 576, 12, 2, 0.5, "sparse"),  # stage 4 at 384 px
    ("transnext_full", 576, 12, 2, 0.75, "masked"),
    ("transnext_full", 576, 12, 1, 0.5, "masked"),
]


@pytest.mark.parametrize("kernel,dim,side,batch,ratio,expected", AUTO_CASES)
def test_auto_runs_sparse_where_it_was_measured_faster(kernel, dim, side, batch, ratio, expected):
    args = dict(input_resolution=side, sr_ratio=2) if kernel == "transnext_aggregated" else dict(input_resolution=side)
    m = build_attention("moh", dim, dim // 24, kernel=kernel, activation_ratio=ratio, **args)
    assert m.impl == "auto"
    assert m.execution_path(torch.zeros(batch, side * side, dim)) == expected
    assert m.execution_path(torch.zeros(batch, side * side, dim, device="meta")) == "masked"  # not measured


# ---------------------------------------------------------------------------------------------
# Whole MoH-ViT models
# ---------------------------------------------------------------------------------------------
MODEL_CASES = {
    # every stage routed where the ratio allows (stage 1 has one head: dense-weighted)
    "ratio_0.5": dict(activation_ratio=0.5),
    # moh_transnext_small_75's layout, scaled: shared-only stages 1-2, routed stages 3-4
    "small_75_like": dict(shared_heads=[1, 2, 1, 2], topk=[0, 0, 2, 4]),
}


@pytest.mark.parametrize("opts", list(MODEL_CASES.values()), ids=list(MODEL_CASES))
def test_model_sparse_equals_masked(opts):
    common = dict(attention="moh", in_chans=1, img_size=64, num_classes=5, **opts)
    torch.manual_seed(0)
    ref = timm.create_model("transnext_nano", impl="masked", **common)
    perturb(ref, 0)
    sparse = timm.create_model("transnext_nano", impl="sparse", **common)
    sparse.load_state_dict(ref.state_dict())
    x = torch.randn(2, 1, 64, 64)
    paths = [m.execution_path(torch.zeros(1, m.num_tokens, m.dim)) for _, m in sparse.named_modules()
             if hasattr(m, "execution_path")]
    assert paths.count("sparse") >= 3 and "masked" in paths  # routed stages sparse, dense-weighted masked
    grad_out = torch.randn(2, 5)
    assert_same(run(ref, x, grad_out, True), run(sparse, x, grad_out, True))


def test_bench_times_moh_over_a_transnext_kernel_against_dense_on_that_kernel(tmp_path, capsys):
    """``tools/bench_attention.py kernel=...``: what the table's kernel rules are set from; the fit refuses its rows."""
    tool = load_tool("bench_attention")
    out = tmp_path / "k.md"
    args = ["kernel=transnext_aggregated", "dim=48", "heads=2", "seqlens=64", "batch=2", "ratios=0.5",
            "repeats=1", "warmup=0", "device=cpu", f"out={out}"]
    assert tool.main(args) == 0
    assert "kernel transnext_aggregated, dim 48" in capsys.readouterr().out
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["kernel"] == "transnext_aggregated" and math.isnan(row["bound"]) and row["max_rel_err"] < 1e-5
    assert row["sparse_fwdbwd"] > 0 and row["auto_fwd_pick"] in ("sparse", "masked")
    with pytest.raises(SystemExit):
        tool.main([f"fit_from={out.with_suffix('.json')}", f"fit={tmp_path / 't.json'}"])
    assert "only the sdpa rule is fitted" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["kernel=transnext_full", "dim=48", "heads=2", "seqlens=50", "repeats=1", "device=cpu"])
    assert "square token grid: seqlen=50" in capsys.readouterr().err
