"""The one dispatch of the ops (moh_vision.ops.dispatch): the ``kernels`` config, what ``auto`` picks per device, the
reference under tracers and exporters, one-line errors for a kernel on a device it does not run on; and the
``recompute`` pieces: the formulas' values and gradients, with less kept for backward."""
import pytest
import torch
import timm
from helpers import Spy

import moh_vision  # noqa: F401  (registers the models)
from harness import saved_tensor_bytes
from moh_vision.errors import ConfigError
from moh_vision.ops import OPS, Kernels, choices, resolved
from moh_vision.ops.recompute import _GatedTail, gated_tail_reference

pytestmark = pytest.mark.usefixtures("one_thread")
REFERENCE = {key: "reference" for key in Kernels().as_dict()}


def test_kernels_config_checks_its_entries():
    assert Kernels.of(None) == Kernels() and Kernels.of({"routing": "reference"}).routing == "reference"
    assert set(choices("aggregated")) == {"auto", "reference", "fused", "flex"}
    assert set(choices("depthwise")) == {"auto", "reference", "channels_last", "triton", "written_grad"}
    with pytest.raises(ConfigError, match="kernels.aggregated=cuda is unknown; allowed: auto, reference, flex, fused"):
        Kernels(aggregated="cuda")
    with pytest.raises(ConfigError, match="kernels.route is unknown; the kernels config has aggregated, depthwise"):
        Kernels.of({"route": "fused"})


def test_auto_is_the_recorded_winner_per_device_and_the_reference_elsewhere():
    assert resolved(Kernels(), "cpu") == {"aggregated_attention": "fused", "moh_routing": "reference",
                                          "depthwise_conv": "channels_last", "gated_tail": "recompute",
                                          "cosine_queries": "recompute", "average_pool": "recompute",
                                          "position_mlp": "recompute"}
    assert set(resolved(Kernels(), "meta").values()) == {"reference"}  # no record for that device
    assert set(resolved(Kernels(**REFERENCE), "cpu").values()) == {"reference"}
    x = torch.zeros(2, 3)
    aggregated, recompute = OPS["aggregated_attention"], OPS["gated_tail"]
    assert aggregated.choose("auto", x).name == "fused"
    assert aggregated.choose("auto", torch.zeros(2, 3, device="meta")).name == "reference"
    assert recompute.choose("auto", x).name == "recompute"
    with torch.no_grad():  # nothing to save without autograd
        assert recompute.choose("auto", x).name == recompute.choose("recompute", x).name == "reference"


def test_tracers_and_exporters_record_the_reference():
    """``auto`` and an explicit choice run the formula under fx, ``torch.func`` and (but for a ``torch.library``
    operator, which the FLOP counter counts as one node) ``torch.jit.trace``."""
    aggregated, recompute = OPS["aggregated_attention"], OPS["gated_tail"]
    seen = []

    def probe(x):
        seen.append((aggregated.choose("auto", x).name, aggregated.choose("fused", x).name,
                     recompute.choose("recompute", x).name))
        return x * 2

    torch.jit.trace(probe, (torch.zeros(2),), check_trace=False)
    torch.func.vmap(probe)(torch.zeros(3, 2))
    assert seen == [("reference", "fused", "reference"), ("reference", "reference", "reference")]


def test_a_kernel_on_a_device_it_does_not_run_on_is_a_one_line_error():
    x = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="kernels.aggregated=flex runs on cuda, not on cpu"):
        OPS["aggregated_attention"].choose("flex", x)
    with pytest.raises(ConfigError, match="kernels.depthwise=triton runs on cuda, not on cpu"):
        OPS["depthwise_conv"].choose("triton", x)
    model = timm.create_model("transnext_nano", kernels={"aggregated": "flex"})
    with pytest.raises(ConfigError, match="kernels.aggregated=flex"):
        model(torch.randn(1, 3, 32, 32))


def model_grads(model, x):
    model.zero_grad()
    y = model(x)
    y.square().mean().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


def test_every_model_runs_on_the_reference_formulas_alone():
    """``kernels=reference``: no operator of the package's kernels runs, and outputs and gradients equal the default
    kernels' (float64)."""
    for name, kwargs, x in (("transnext_nano", dict(attention="moh"), (torch.randn(2, 3, 32, 32),)),
                            ("transnext_micro", dict(img_size=64), (torch.randn(1, 3, 64, 64),))):
        default = timm.create_model(name, **kwargs).double().train()
        reference = timm.create_model(name, kernels=REFERENCE, **kwargs).double().train()
        reference.load_state_dict(default.state_dict())
        x = [t.double() for t in x]
        with Spy() as spy:
            y_ref, g_ref = model_grads(reference, *x)
        assert not [op for op in spy.seen if op.startswith(("moh_vision.", "moh_aggregated."))]
        y, g = model_grads(default, *x)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


def test_recompute_keeps_less_for_backward_with_the_same_gradients():
    """TransNeXt with ``kernels.recompute=recompute`` against ``reference``: the same gradients, fewer saved bytes."""
    torch.manual_seed(0)
    kept = {}
    for choice in ("recompute", "reference"):
        model = timm.create_model("transnext_micro", img_size=64, kernels={"recompute": choice}).train()
        if choice == "recompute":
            state = model.state_dict()
        model.load_state_dict(state)
        x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
        kept[choice] = saved_tensor_bytes(lambda: model_grads(model, x), model.parameters())
        kept[choice + "_grads"] = model_grads(model, x)[1]
    for a, b in zip(kept["recompute_grads"], kept["reference_grads"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert kept["recompute"] < 0.8 * kept["reference"]


def test_gated_tail_function_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    B, H, W, C, out = 2, 3, 4, 5, 6
    shapes = [(B, H * W, C), (B, H * W, C), (C, 1, 3, 3), (C,), (out, C), (out,)]
    inputs = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    assert torch.autograd.gradcheck(lambda *t: _GatedTail.apply(*t, H, W, "reference"), inputs)
    torch.testing.assert_close(_GatedTail.apply(*inputs, H, W, "reference"), gated_tail_reference(*inputs, H, W))


def test_position_biases_equal_the_official_gather():
    """Every layer of a TransNeXt-Micro in float64: the bias (its MLP over the distinct offsets, then gathered one
    axis at a time) and the MLP's gradients equal the official one-gather form."""
    model = timm.create_model("transnext_micro").double()
    from moh_vision.models import transnext as T
    for attn in (m for m in model.modules() if isinstance(m, T._TransNeXtAttention)):
        params = list(attn.cpb_fc1.parameters()) + list(attn.cpb_fc2.parameters())
        bias = attn.position_bias()
        grad = torch.randn_like(bias)
        got = (bias.detach(), *torch.autograd.grad((bias * grad).sum(), params))
        table = attn.cpb_fc2(attn.cpb_act(attn.cpb_fc1(attn.relative_coords_table)))
        table = table.transpose(0, 1).reshape(attn.num_heads, *attn.bias_grid)
        index_h, index_w = attn.relative_index_h, attn.relative_index_w
        ref = table[:, index_h[:, None, :, None], index_w[None, :, None, :]].reshape(attn.num_heads,
                                                                                      attn.num_tokens, -1)
        want = (ref.detach(), *torch.autograd.grad((ref * grad).sum(), params))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
