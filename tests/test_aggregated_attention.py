"""TransNeXt's aggregated attention without window copies (moh_vision.ops.aggregated) equals the official
``F.unfold`` form in its output and every gradient: the plain-op reference, the ``fused`` ``torch.library``
operator on the CPU, its Triton kernels under Triton's interpreter, and (``gpu``) on CUDA."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from moh_vision.ops.aggregated import aggregated_attention_fused as aggregated_attention
from moh_vision.ops.aggregated import aggregated_attention_reference, local_window_mask

# (B, h, hk, H, W, d, P, window): TransNeXt's stage-1 head size, a non-square map, a 5x5 window, one token,
# a shared key/value head (MoA), one pooled token
SHAPES = [(2, 2, 2, 5, 7, 24, 9, 3), (1, 3, 3, 4, 6, 8, 4, 5), (2, 2, 2, 1, 1, 4, 1, 3), (2, 3, 1, 4, 4, 6, 4, 3),
          (1, 2, 2, 8, 3, 5, 1, 3)]


def unfold_form(q, k, v, k_pool, v_pool, pool_bias, local_bias, local_weight, size, window):
    """The official TransNeXt formula: every key and value copied ``window ** 2`` times by ``F.unfold``."""
    B, h, N, d = q.shape
    L = window * window

    def windows(t):
        image = t.transpose(-2, -1).reshape(B, t.shape[1] * d, *size)
        return F.unfold(image, window, padding=window // 2).reshape(B, t.shape[1], d, L, N).permute(0, 1, 4, 2, 3)

    logits_local = (q.unsqueeze(-2) @ windows(k)).squeeze(-2) + local_bias.unsqueeze(1)
    logits_local = logits_local.masked_fill(local_window_mask(size, window)[1], float("-inf"))
    logits_pool = q @ k_pool.transpose(-2, -1) + pool_bias
    attn = torch.cat([logits_local, logits_pool], dim=-1).softmax(dim=-1)
    attn_local, attn_pool = attn.split([L, k_pool.shape[-2]], dim=-1)
    out_local = ((attn_local + local_weight).unsqueeze(-2) @ windows(v).transpose(-2, -1)).squeeze(-2)
    return out_local + attn_pool @ v_pool


def make_inputs(B, h, hk, H, W, d, P, window, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, L = H * W, window * window
    shapes = [(B, h, N, d), (B, hk, N, d), (B, hk, N, d), (B, hk, P, d), (B, hk, P, d), (h, N, P), (h, L), (B, h, N, L)]
    tensors = [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    tensors[1] = F.normalize(tensors[1], dim=-1)  # normalised keys, as the layer gives them
    return [t.requires_grad_() for t in tensors], torch.randn(B, h, N, d, generator=g, dtype=torch.float64).to(dtype)


def values_and_grads(fn, inputs, grad, size, window):
    for t in inputs:
        t.grad = None
    out = fn(*inputs, size, window)
    (out * grad).sum().backward()
    return [out.detach()] + [t.grad.clone() for t in inputs]


def relative_errors(got, want):
    return [((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
            for a, b in zip(got, want)]


@pytest.fixture(params=["kernel", "formulas"])
def cpu_impl(request, monkeypatch):
    """The operator's two CPU implementations: the C++ kernels (``csrc/aggregated_attention.cpp``) and the
    shifted-view formulas (without a compiler)."""
    from moh_vision.ops import aggregated as module
    if request.param == "kernel" and not module.cpu_kernels_available():
        pytest.skip("the C++ kernels could not be built here")
    if request.param == "formulas":
        monkeypatch.setattr(module, "cpu_kernels_available", lambda: False)
    return request.param


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fn", [aggregated_attention_reference, aggregated_attention], ids=["reference", "operator"])
def test_equals_the_unfold_form_in_float64(shape, fn):
    inputs, grad = make_inputs(*shape)
    size, window = shape[3:5], shape[-1]
    want = values_and_grads(unfold_form, inputs, grad, size, window)
    got = values_and_grads(fn, inputs, grad, size, window)
    assert max(relative_errors(got, want)) < 1e-12


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_operator_in_float32_within_1e5_of_the_unfold_form(shape):
    inputs, grad = make_inputs(*shape)
    size, window = shape[3:5], shape[-1]
    want = values_and_grads(unfold_form, inputs, grad, size, window)
    single = [t.detach().float().requires_grad_() for t in inputs]
    got = values_and_grads(aggregated_attention, single, grad.float(), size, window)
    assert max(relative_errors(got, want)) < 1e-5


@pytest.mark.usefixtures("cpu_impl")
def test_operator_in_bfloat16_within_stated_tolerance():
    shape = SHAPES[0]
    inputs, grad = make_inputs(*shape, dtype=torch.bfloat16)
    size, window = shape[3:5], shape[-1]
    got = values_and_grads(aggregated_attention, inputs, grad, size, window)
    exact = [t.detach().double().requires_grad_() for t in inputs]  # the same (rounded) inputs, exactly
    want = values_and_grads(unfold_form, exact, grad.double(), size, window)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert max(relative_errors(got, want)) < 1e-2  # float32 arithmetic inside, results rounded to bf16 (8 bits)


@pytest.mark.usefixtures("cpu_impl")
def test_operator_passes_gradcheck_and_opcheck():
    inputs, _ = make_inputs(1, 2, 2, 3, 4, 3, 2, 3)
    size = (3, 4)
    assert torch.autograd.gradcheck(lambda *t: aggregated_attention(*t, size, 3), inputs)
    torch.library.opcheck(torch.ops.moh_vision.aggregated_attention.default, (*[t.detach().float() for t in inputs],
                                                                               3, 4, 3))


@pytest.mark.usefixtures("cpu_impl")
def test_operator_keeps_only_its_inputs_and_the_logsumexp_for_backward():
    """No window copies saved: besides the inputs (which the layer holds anyway), one float per query."""
    B, h, H, W, d, P = 2, 3, 6, 6, 8, 4
    inputs, _ = make_inputs(B, h, h, H, W, d, P, 3, dtype=torch.float32)
    held = {t.untyped_storage().data_ptr() for t in inputs}
    extra = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            extra.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        aggregated_attention(*inputs, (H, W), 3)
    assert sum(extra) == B * h * H * W * 4  # the float32 log-sum-exp


@pytest.mark.parametrize("capability, suffix", [("AVX512", "_avx2"), ("AVX2", "_avx2"), ("DEFAULT", ""), ("SVE256", "")])
def test_cpu_kernels_are_built_for_the_vector_instructions_aten_uses(monkeypatch, capability, suffix):
    """AVX2 and FMA where ATen dispatches to AVX2 or AVX-512, the compiler's baseline elsewhere, and a build name
    per instruction set (a shared extensions cache never hands one machine's build to another)."""
    from moh_vision.ops import extensions
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    name, flags = extensions.vector_flags()
    assert name == suffix and (flags == ["-mavx2", "-mfma"]) == bool(suffix)


def test_the_build_is_named_by_the_sources_content_not_its_path(tmp_path, monkeypatch):
    """Two checkouts of the same source share one build made from one copy of it (from each path, each rebuilt the
    kernel after the other: a test's copy of the project cost 12 s of CPU twice); a changed source is another."""
    from moh_vision.ops import extensions
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    first, second, changed = (tmp_path / name / "kernel.cpp" for name in ("a", "b", "c"))
    for path, code in ((first, "int f();\n"), (second, "int f();\n"), (changed, "int g();\n")):
        path.parent.mkdir()
        path.write_text(code)
    (shared, digest), (again, same) = extensions.shared_source(first), extensions.shared_source(second)
    assert (shared, digest) == (again, same) and shared.read_text() == "int f();\n"
    assert shared.is_relative_to(tmp_path / "cache") and shared.name == "kernel.cpp"
    other, changed_digest = extensions.shared_source(changed)
    assert changed_digest != digest and other != shared and other.read_text() == "int g();\n"
    assert not list((tmp_path / "cache").rglob("*.tmp"))


@pytest.mark.parametrize("shape", SHAPES)
def test_flex_candidate_forward_equals_the_unfold_form(shape):
    """The FlexAttention candidate (moh_vision.ops.aggregated_flex) on the CPU, forward only (FlexAttention has
    no CPU backward): float64 exactly, float32 within 1e-5."""
    from moh_vision.ops.aggregated_flex import aggregated_attention_flex

    size, window = shape[3:5], shape[-1]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        inputs, _ = make_inputs(*shape, dtype=dtype)
        inputs = [t.detach() for t in inputs]
        want = unfold_form(*[t.double() for t in inputs], size, window)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FlexAttention's "compile me" warning, eager on the CPU
            got = aggregated_attention_flex(*inputs, size, window)
        assert got.dtype == dtype and max(relative_errors([got], [want])) < tol


def test_model_traces_to_one_graph_around_the_operator():
    import timm
    import moh_vision  # noqa: F401 (registers the models)

    torch.manual_seed(0)
    model = timm.create_model("transnext_nano", img_size=64, num_classes=5).train()
    x = torch.randn(2, 3, 64, 64)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("aggregated_attention" in op for op in ops)


# Under Triton's interpreter: tests/test_triton_interpreter.py runs it in a process with TRITON_INTERPRET=1.
TRITON_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_aggregated_attention import SHAPES, make_inputs, relative_errors
from moh_vision.ops import aggregated_triton as kernels
from moh_vision.ops.aggregated import _forward_plain, _backward_plain
worst = {}
for dtype, shapes in ((torch.float32, SHAPES), (torch.float16, SHAPES[:1])):  # half precision: the rounding alone
    for B, h, hk, H, W, d, P, window in shapes:
        inputs, grad = make_inputs(B, h, hk, H, W, d, P, window, dtype=dtype)
        inputs = [t.detach() for t in inputs]
        inputs[1], inputs[2] = inputs[1].expand(B, h, -1, -1), inputs[2].expand(B, h, -1, -1)  # as the op gets them
        inputs[3], inputs[4] = inputs[3].expand(B, h, -1, -1), inputs[4].expand(B, h, -1, -1)
        inputs[0] = inputs[0].transpose(1, 2).contiguous().transpose(1, 2)  # strided, as split heads give it
        out, lse = kernels.forward(*inputs, (H, W), window)
        want_out, want_lse = _forward_plain(*[t.double() for t in inputs], (H, W), window)
        grads = kernels.backward(grad, *inputs, lse, (H, W), window)
        want = _backward_plain(grad.double(), *[t.double() for t in inputs], want_lse, (H, W), window)
        errors = relative_errors([out, lse, *grads], [want_out, want_lse, *want])
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), max(errors))
print(worst)
assert worst["torch.float32"] < 1e-5, worst
assert worst["torch.float16"] < 2e-3, worst
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(4, 4, 4, 56, 56, 24, 49, 3), (2, 16, 16, 14, 14, 24, 49, 3)] + SHAPES
                         + [(2, 2, 2, 24, 20, 24, 144, 3)])  # TransNeXt's stages first: a time limit cuts the rest
def test_operator_on_cuda_equals_the_unfold_form(shape, dtype, tol):
    inputs, grad = make_inputs(*shape, dtype=dtype)
    size, window = shape[3:5], shape[-1]
    exact = [t.detach().double().requires_grad_() for t in inputs]  # the same (rounded) inputs, exactly
    want = values_and_grads(unfold_form, exact, grad.double(), size, window)
    cuda = [t.detach().cuda().requires_grad_() for t in inputs]
    got = values_and_grads(aggregated_attention, cuda, grad.cuda(), size, window)
    assert max(relative_errors([g.cpu() for g in got], want)) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_model_on_cuda_trains_as_the_reference(compiled, monkeypatch):
    """A TransNeXt step on CUDA (eager and compiled): the Triton kernels' gradients equal the reference
    formula's (``kernels.aggregated=reference``) on the same weights."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("transnext_micro", img_size=64, num_classes=10).cuda().train()
    reference = timm.create_model("transnext_micro", img_size=64, num_classes=10,
                                  kernels={"aggregated": "reference"}).cuda().train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 64, 64, device="cuda")

    def grads(net, run):
        net.zero_grad()
        run(x).square().mean().backward()
        return [p.grad.clone() for p in net.parameters()]

    got = grads(model, torch.compile(model) if compiled else model)
    want = grads(reference, reference)
    assert max(relative_errors(got, want)) < 1e-3  # TF32-free kernels; cuBLAS/cuDNN elsewhere may use TF32


def test_queries_function_equals_the_plain_form_and_keeps_only_q():
    from moh_vision.ops.recompute import _CosineQueries, cosine_queries, cosine_queries_reference

    g = torch.Generator().manual_seed(3)
    B, h, N, d, L = 2, 3, 5, 4, 9
    shapes = [(B, h, N, d), (h, 1, d), (h, N, 1), (h, d, L), (h, 1, L)]
    inputs = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    assert torch.autograd.gradcheck(_CosineQueries.apply, inputs)
    grads = [torch.randn(B, h, N, d, generator=g, dtype=torch.float64), torch.randn(B, h, N, L, generator=g,
                                                                                     dtype=torch.float64)]

    def run(fn):
        for t in inputs:
            t.grad = None
        kept = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.add(t.untyped_storage().data_ptr()) or t,
                                                      lambda t: t):
            outs = fn(*inputs)
        sum((o * gr).sum() for o, gr in zip(outs, grads)).backward()
        return [o.detach() for o in outs] + [t.grad for t in inputs], kept

    got, kept = run(lambda *t: cosine_queries(*t, kernel="recompute"))
    want, kept_plain = run(cosine_queries_reference)
    assert max(relative_errors(got, want)) < 1e-12
    large = {t.untyped_storage().data_ptr() for t in inputs[:1]}
    assert kept & large == large and len(kept) < len(kept_plain)


def test_model_trains_under_bf16_autocast_close_to_float32():
    """The operator, the queries' and the ConvGLU's Functions under CPU bf16 autocast: a TransNeXt step's
    gradients follow the float32 step's (bf16 rounding apart)."""
    import timm
    import moh_vision  # noqa: F401 (registers the models)

    torch.manual_seed(0)
    model = timm.create_model("transnext_nano", img_size=64, num_classes=5).train()
    x = torch.randn(2, 3, 64, 64)

    def grads(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().square().mean()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full, half = grads(False), grads(True)
    assert torch.isfinite(half).all()
    assert torch.nn.functional.cosine_similarity(full, half, dim=0) > 0.99


def test_triton_kernels_compile_for_hopper_without_register_spills(tmp_path):
    """The three Triton kernels compiled for sm_90 (no GPU needed: Triton's compiler and its bundled ptxas) at
    TransNeXt's stage shapes (bf16, head dim 24, 49 pooled keys) keep every value in registers: spills to local
    memory are what made the unrolled, 4-warp backward kernels slow to reason about (0.9-1.5 kB a thread)."""
    pytest.importorskip("triton")
    from helpers import assert_compiles_for_hopper_without_spills
    from moh_vision.ops import aggregated_triton as kernels

    meta = dict(WS=3, LP=16, BLOCK=64, BD=32, BP=64, PRECISION="tf32")
    fp32 = {name: "*fp32" for name in ("LSE", "DSL", "AL", "DKP", "DVP", "DPB")}
    for fn in (kernels._forward, kernels._backward_queries, kernels._backward_keys):
        assert_compiles_for_hopper_without_spills(fn, meta, fp32, kernels.NUM_WARPS, tmp_path,
                                                  ints=("HEADS", "N", "P", "L", "D", "HEIGHT", "WIDTH"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_candidate_on_cuda_equals_the_unfold_form_with_gradients():
    """The FlexAttention candidate's output and every gradient (the biases' through its score modifier) on CUDA."""
    from moh_vision.ops.aggregated_flex import aggregated_attention_flex

    shape = SHAPES[0]
    inputs, grad = make_inputs(*shape, dtype=torch.float32)
    size, window = shape[3:5], shape[-1]
    exact = [t.detach().double().requires_grad_() for t in inputs]
    want = values_and_grads(unfold_form, exact, grad.double(), size, window)
    cuda = [t.detach().cuda().requires_grad_() for t in inputs]
    got = values_and_grads(aggregated_attention_flex, cuda, grad.cuda(), size, window)
    assert max(relative_errors([g.cpu() for g in got], want)) < 2e-3  # its fp32 products may run as TF32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_on_cuda_with_the_candidates_trains_as_without():
    """A TransNeXt step on CUDA with the CUDA candidates (kernels.aggregated=flex, kernels.depthwise=triton): the same
    gradients as the model's defaults on the same weights."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("transnext_micro", img_size=64, num_classes=10).cuda().train()
    candidates = timm.create_model("transnext_micro", img_size=64, num_classes=10,
                                   kernels={"aggregated": "flex", "depthwise": "triton"}).cuda().train()
    candidates.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 64, 64, device="cuda")

    def grads(net):
        net.zero_grad()
        net(x).square().mean().backward()
        return [p.grad.clone() for p in net.parameters()]

    assert max(relative_errors(grads(candidates), grads(model))) < 1e-3
