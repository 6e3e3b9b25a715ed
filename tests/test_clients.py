"""The PyTorch clients users point at these models: ``torch.jit.trace``, both ONNX exporters (run in
onnxruntime), torchvision's ``create_feature_extractor`` (torch.fx) and ``torch.func`` (``grad``, ``vmap``,
``jacrev``, ``functional_call``), on the smallest member of every family with ``mha``, ``moh`` and ``moa``.

Every client is checked on a NEW input (not the one it traced) against the eager model. MoH runs
``impl="auto"`` with a rule that picks the sparse path everywhere (:func:`sparse_everywhere`): eagerly the
layers run sparse, so a tracer that froze the sparse path's data-dependent dispatch into its graph would give
the new input a wrong result; under every client ``auto`` must run the reference (masked) path. An explicit
``impl="sparse"`` refuses under the tracers with one line.

DiT takes ``(x, t, y)``: it runs every client with its three inputs (torchvision traces the whole model, and
a block's attention is a node like any other). Routers and all other weights are drawn at random (DiT's
adaLN-Zero would otherwise make the output exactly zero, and MoA's zero-initialised router ties every token).
"""
import dataclasses
import io
import logging

import pytest
import timm
import torch
from torch.func import functional_call, grad, jacrev, vmap

import moh_vision  # noqa: F401  (registers the models)
from moh_vision.attention import build_attention, moh as moh_module, routed_modules
from moh_vision.attention import sparse as sparse_module
from moh_vision.attention.kernels import GatedMerge
from moh_vision.errors import ConfigError

FAMILIES = {  # family: (registered name, shrink options); TransNeXt at 64 px: at 32 its few stage-3/4 tokens
    "transnext": ("transnext_nano", dict(img_size=64)),  # routed alike on both inputs, hiding a frozen dispatch
    "vit": ("plain_vit_nano", dict(depth=2)),
    "dit": ("dit_tiny_2", dict(depth=2)),
}
ATTENTIONS = {"mha": {}, "moh": dict(activation_ratio=0.5), "moa": dict(activation_ratio=0.5)}
ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

parametrize_all = [pytest.mark.parametrize("attention", list(ATTENTIONS)),
                   pytest.mark.parametrize("family", list(FAMILIES))]


def every(test):
    for mark in parametrize_all:
        test = mark(test)
    return test


@pytest.fixture(autouse=True)
def sparse_everywhere(monkeypatch):
    """``impl="auto"`` picks the sparse path on every call where a kernel has one (eagerly)."""
    real = sparse_module.sparse_support

    def forced(module_or_class):
        support = real(module_or_class)
        return None if support is None else dataclasses.replace(support, auto=lambda m, x: "sparse")

    monkeypatch.setattr(moh_module, "sparse_support", forced)


def make_model(family, attention, **options):
    name, shrink = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(name, attention=attention, **ATTENTIONS[attention], **shrink, **options).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def inputs(family, seed, batch=2):
    g = torch.Generator().manual_seed(seed)
    if family == "dit":
        return (torch.randn(batch, 1, 16, 16, generator=g), torch.rand(batch, generator=g) * 999,
                torch.randint(0, 10, (batch,), generator=g))
    size = FAMILIES[family][1].get("img_size", 32)
    return (torch.randn(batch, 3, size, size, generator=g),)


def eager(model, args):
    with torch.no_grad():
        return model(*args)


def assert_eager_runs_sparse(model, args):
    """The forced rule is in force: a routed MoH layer picks sparse eagerly (so the client test means something)."""
    moh = [m for _, m in routed_modules(model) if isinstance(m, moh_module.MoH) and m.topk > 0]
    if moh:
        tokens = torch.randn(2, 16, moh[0].dim)
        assert moh[0].execution_path(tokens) == "sparse"


# ---------------------------------------------------------------------------------------------
# torch.jit.trace
# ---------------------------------------------------------------------------------------------
@every
def test_jit_trace_is_exact_on_a_new_input(family, attention):
    model = make_model(family, attention)
    assert_eager_runs_sparse(model, inputs(family, 0))
    with torch.no_grad():
        traced = torch.jit.trace(model, inputs(family, 0), check_trace=False)
    new = inputs(family, 1)
    torch.testing.assert_close(traced(*new), eager(model, new), atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# ONNX: the TorchScript-based exporter and the torch.export-based one (dynamo=True), run in onnxruntime
# ---------------------------------------------------------------------------------------------
def run_onnx(data: bytes, args):
    import onnxruntime as ort  # requirements.txt pins it (and onnx, onnxscript)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    feed = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    return torch.from_numpy(session.run(None, feed)[0])


@every
def test_onnx_legacy_exporter_runs_in_onnxruntime(family, attention):
    model = make_model(family, attention)
    buffer = io.BytesIO()
    torch.onnx.export(model, inputs(family, 0), buffer, dynamo=False)
    new = inputs(family, 1)
    torch.testing.assert_close(run_onnx(buffer.getvalue(), new), eager(model, new), atol=ATOL, rtol=1e-4)


# the torch.export-based exporter takes 6-30 s a model on one CPU thread: moh (the case with a data-dependent
# path) in the default run, the dense and MoA layers (one static path each) with the slow tests
DYNAMO_ATTENTIONS = [pytest.param(a, marks=() if a == "moh" else pytest.mark.slow) for a in ATTENTIONS]


@pytest.mark.parametrize("attention", DYNAMO_ATTENTIONS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_onnx_dynamo_exporter_runs_in_onnxruntime(family, attention):
    model = make_model(family, attention)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    program = torch.onnx.export(model, inputs(family, 0), dynamo=True, verbose=False)
    new = inputs(family, 1)
    # its decompositions round differently (DiT: 4e-5 on outputs of ~1); a frozen dispatch was 2e-3 off and more
    torch.testing.assert_close(run_onnx(program.model_proto.SerializeToString(), new), eager(model, new),
                               atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# torch.fx: torchvision's create_feature_extractor, called as torchvision documents it
# ---------------------------------------------------------------------------------------------
@every
def test_torchvision_feature_extractor(family, attention):
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names
    model = make_model(family, attention)
    _, nodes = get_graph_node_names(model)
    attn = [n for n in nodes if n.rsplit(".", 1)[0].endswith("attn")]  # nodes inside the attention layers
    assert attn, "the attention layers are traced through, their inside is addressable"
    extractor = create_feature_extractor(model, return_nodes={attn[-1]: "inner", nodes[-1]: "output"})
    new = inputs(family, 1)
    with torch.no_grad():
        features = extractor(*new)
    torch.testing.assert_close(features["output"], eager(model, new), atol=ATOL, rtol=1e-4)
    assert torch.isfinite(features["inner"]).all()


def test_torchvision_feature_extractor_learned_shared_heads():
    """MoH learning its shared heads traces too (torchvision traces the train mode as well: the warm-up's
    straight-through estimator)."""
    from torchvision.models.feature_extraction import create_feature_extractor
    model = make_model("vit", "moh", shared_heads="learned", learn_shared_steps=5)
    extractor = create_feature_extractor(model, return_nodes={"head": "logits"})
    new = inputs("vit", 1)
    with torch.no_grad():
        torch.testing.assert_close(extractor(*new)["logits"], eager(model, new), atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# torch.func
# ---------------------------------------------------------------------------------------------
def loss_of(model):
    def loss(params, *args):
        return functional_call(model, params, args).square().mean()
    return loss


@every
def test_torch_func_grad_equals_autograd(family, attention):
    model = make_model(family, attention)
    params = {k: v.detach() for k, v in model.named_parameters()}
    new = inputs(family, 1)
    grads = grad(loss_of(model))(params, *new)
    model.zero_grad()
    model(*new).square().mean().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:  # torch.func differentiates every parameter it is given, autograd the trainable ones
            torch.testing.assert_close(grads[name], p.grad if p.grad is not None else torch.zeros_like(p),
                                       atol=1e-6, rtol=1e-4, msg=name)


@every
def test_torch_func_vmap_equals_the_batch(family, attention):
    model = make_model(family, attention)
    new = inputs(family, 1, batch=3)
    per_sample = vmap(lambda *args: model(*(a.unsqueeze(0) for a in args)).squeeze(0))(*new)
    torch.testing.assert_close(per_sample, eager(model, new), atol=ATOL, rtol=1e-4)


@every
def test_torch_func_per_sample_gradients(family, attention):
    """``vmap(grad(...))`` (per-sample gradients, the torch.func recipe) equals one backward per sample."""
    model = make_model(family, attention)
    params = {k: v.detach() for k, v in model.named_parameters()}
    new = inputs(family, 1, batch=2)
    loss = loss_of(model)
    per_sample = vmap(grad(lambda p, *a: loss(p, *(t.unsqueeze(0) for t in a))), in_dims=(None,) * 1 + (0,) * len(new))(
        params, *new)
    for i in range(2):
        one = grad(loss)(params, *(t[i:i + 1] for t in new))
        for name in ("head.weight", "final_layer.linear.weight"):
            if name in one:
                torch.testing.assert_close(per_sample[name][i], one[name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_torch_func_jacrev_of_a_layer(attention):
    """``jacrev`` (vmap over the backward) through each attention layer (MoH: its gated merge) equals the
    Jacobian autograd builds row by row."""
    torch.manual_seed(0)
    layer = build_attention(attention, 16, 4, **ATTENTIONS[attention]).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(1, 5, 16)
    jac = jacrev(layer)(x)
    rows = torch.autograd.functional.jacobian(layer, x)
    torch.testing.assert_close(jac, rows, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The custom autograd Functions under torch.func, against their plain-op definitions
# ---------------------------------------------------------------------------------------------
def gated_merge_plain(o, gates):
    B, h, N, d = o.shape
    return (o.transpose(1, 2) * gates.unsqueeze(-1)).reshape(B, N, h * d)


def test_gated_merge_under_grad_vmap_and_jacrev():
    torch.manual_seed(0)
    o, gates = torch.randn(3, 2, 4, 5, 6).transpose(3, 4), torch.rand(3, 2, 6, 4)  # o: [V, B, h, N, d], not merged
    one = (o[0], gates[0])
    torch.testing.assert_close(vmap(GatedMerge.apply)(o, gates), vmap(gated_merge_plain)(o, gates))
    torch.testing.assert_close(vmap(GatedMerge.apply, in_dims=(0, None))(o, gates[0]),
                               vmap(gated_merge_plain, in_dims=(0, None))(o, gates[0]))
    for argnums in (0, 1):
        torch.testing.assert_close(grad(lambda *a: GatedMerge.apply(*a).sin().sum(), argnums)(*one),
                                   grad(lambda *a: gated_merge_plain(*a).sin().sum(), argnums)(*one))
        torch.testing.assert_close(jacrev(GatedMerge.apply, argnums)(*one), jacrev(gated_merge_plain, argnums)(*one))


def dispatch_case():
    torch.manual_seed(0)
    B, N, E, k, d, C = 2, 6, 3, 2, 4, 8
    index = torch.rand(B, N, E).topk(k, dim=-1).indices
    return sparse_module.build_dispatch(index, E), B * N, E, d, C


def test_head_projections_under_grad_vmap_and_jacrev():
    dispatch, T, E, d, C = dispatch_case()
    rows, segments, R = dispatch.rows, dispatch.segments, dispatch.num_rows
    heads = dispatch.heads

    def gathered_plain(x, w, b):
        return (x[rows].unsqueeze(1) @ w.view(E, d, C)[heads].transpose(1, 2)).squeeze(1) + b.view(E, d)[heads]

    def gathered(x, w, b):
        return sparse_module.GatheredHeadProjection.apply(x, w, b, rows, segments)

    def scattered_plain(y, o, gate, w):
        contrib = ((o * gate[:, None]).unsqueeze(1) @ w.view(C, E, d).permute(1, 2, 0)[heads]).squeeze(1)
        return y.index_add(0, rows, contrib)

    def scattered(y, o, gate, w):
        return sparse_module.ScatteredHeadProjection.apply(y.clone(), o, gate, w, rows, segments)

    cases = [(gathered, gathered_plain, (torch.randn(T, C), torch.randn(E * d, C), torch.randn(E * d))),
             (scattered, scattered_plain, (torch.randn(T, C), torch.randn(R, d), torch.rand(R), torch.randn(C, E * d)))]
    for fn, plain, args in cases:
        torch.testing.assert_close(fn(*args), plain(*args))
        batched = tuple(torch.stack([a, a * 0.5 + 1]) for a in args)
        torch.testing.assert_close(vmap(fn)(*batched), vmap(plain)(*batched))
        for argnums in range(len(args)):
            torch.testing.assert_close(grad(lambda *a: fn(*a).sin().sum(), argnums)(*args),
                                       grad(lambda *a: plain(*a).sin().sum(), argnums)(*args))
            torch.testing.assert_close(jacrev(fn, argnums)(*args), jacrev(plain, argnums)(*args))


def test_key_value_heads_under_grad_vmap_and_jacrev():
    torch.manual_seed(0)
    B, N, h, d, C, groups = 2, 3, 4, 2, 6, (1, 3)
    shape = (B, N, 2, h, d)

    def fused(x, w, b):
        return sparse_module.KeyValueHeads.apply(x, w, b, shape, groups)

    def plain(x, w, b):
        return sparse_module._key_value_groups(sparse_module._projected_keys_values(x, w, b, shape), groups)

    args = (torch.randn(B, N, C), torch.randn(2 * h * d, C), torch.randn(2 * h * d))
    batched = tuple(torch.stack([a, a - 1]) for a in args)
    torch.testing.assert_close(vmap(fused)(*batched), vmap(plain)(*batched))
    for argnums in range(3):
        torch.testing.assert_close(grad(lambda *a: sum(t.sin().sum() for t in fused(*a)), argnums)(*args),
                                   grad(lambda *a: sum(t.sin().sum() for t in plain(*a)), argnums)(*args))
        torch.testing.assert_close(jacrev(fused, argnums)(*args), jacrev(plain, argnums)(*args))


# ---------------------------------------------------------------------------------------------
# An explicit sparse path: refused under the tracers, exact under torch.func.grad
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_explicit_sparse_refuses_under_tracers(family):
    model = make_model(family, "moh", impl="sparse")
    args = inputs(family, 0)
    from torchvision.models.feature_extraction import create_feature_extractor
    clients = {
        "torch.jit.trace": lambda: torch.jit.trace(model, args, check_trace=False),
        "torch.onnx.export": lambda: torch.onnx.export(model, args, io.BytesIO(), dynamo=False),
        "torch.export": lambda: torch.export.export(model, args),
        "torch.fx": lambda: create_feature_extractor(model, return_nodes=["add"]),
        "torch.func.vmap": lambda: vmap(lambda *a: model(*(t.unsqueeze(0) for t in a)))(*args),
    }
    for client, call in clients.items():
        model.eval()  # torchvision traces the train mode too, and leaves a model there when its trace raises
        with torch.no_grad(), pytest.raises(ConfigError, match="impl='sparse' dispatches tokens") as err:
            call()
        assert "\n" not in str(err.value), client


@pytest.mark.parametrize("family", ["transnext", "vit"])
def test_explicit_sparse_under_torch_func_grad_equals_masked(family):
    sparse, masked = make_model(family, "moh", impl="sparse"), make_model(family, "moh", impl="masked")
    new = inputs(family, 1)
    params = {k: v.detach() for k, v in masked.named_parameters()}
    got, want = grad(loss_of(sparse))(params, *new), grad(loss_of(masked))(params, *new)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)
