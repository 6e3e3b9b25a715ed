"""The PyTorch clients users point at these models: ``torch.jit.trace``, both ONNX exporters (run in
onnxruntime), torchvision's ``create_feature_extractor`` (torch.fx) and ``torch.func`` (``grad``, ``vmap``,
``jacrev``, ``functional_call``), on the smallest member of every family with ``mha``, ``moh`` and ``moa``.

Every client is checked on a NEW input (not the one it traced) against the eager model, which runs the default
kernels (``auto``: on the CPU TransNeXt's fused attention and recomputing pieces; checked by
:func:`assert_eager_runs_kernels`) while every client records the reference formulas
(:mod:`moh_vision.ops.dispatch`).

DiT takes ``(x, t, y)``: it runs every client with its three inputs (torchvision traces the whole model, and
a block's attention is a node like any other). Routers and all other weights are drawn at random (DiT's
adaLN-Zero would otherwise make the output exactly zero, and MoA's zero-initialised router ties every token).
"""
import io
import logging

import pytest
import timm
import torch
from torch.func import functional_call, grad, jacrev, vmap

import moh_vision  # noqa: F401  (registers the models)
from helpers import Spy

from moh_vision.attention import build_attention

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


def assert_eager_runs_kernels(model, args, family, attention):
    """Eagerly the package's kernels run where the model has them (so that a client recording the reference
    formulas means something): TransNeXt's fused aggregated attention."""
    with Spy() as spy:
        eager(model, args)
    if family == "transnext":
        assert "moh_vision.aggregated_attention" in spy.seen


# ---------------------------------------------------------------------------------------------
# torch.jit.trace
# ---------------------------------------------------------------------------------------------
@every
def test_jit_trace_is_exact_on_a_new_input(family, attention):
    model = make_model(family, attention)
    assert_eager_runs_kernels(model, inputs(family, 0), family, attention)
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
# (TransNeXt's, 18 s, with the slow ones too)
DYNAMO_CASES = [pytest.param(f, a, marks=() if a == "moh" and f != "transnext" else pytest.mark.slow)
                for f in FAMILIES for a in ATTENTIONS]


@pytest.mark.parametrize("family,attention", DYNAMO_CASES)
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
