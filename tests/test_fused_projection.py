"""Issue 43, item 2: MoH's routers inside the ``qkv`` GEMM (moh_vision/attention/fused_projection.py), with the gates
applied in the routing kernel's merge (``moh_routing.route_merge``, tests/test_fused_routing.py). Against the previous
formulation (the routers' own GEMM, ``route``, then ``merge_heads``): outputs, every gradient, the aux loss and the
statistics; the official state-dict keys; official-layout state dicts and checkpoints; copies, saves and
replaced parameters."""
import copy
import io
import pickle

import pytest
import timm
import torch
from helpers import Spy

from moh_vision.attention import build_attention, record_routing
from moh_vision.attention.fused_projection import packed_width
from moh_vision.attention.fused_routing import fused_routing_available
from moh_vision.attention.moh import MoH

needs_kernel = pytest.mark.skipif(not fused_routing_available(), reason="no C++ compiler for torch extensions")

LAYERS = [dict(activation_ratio=0.75), dict(shared_heads=0, topk=2), dict(shared_heads=1, topk=3),
          dict(activation_ratio=1.0), dict(activation_ratio=0.5, qkv_bias=False),
          dict(activation_ratio=0.75, qk_norm=True)]
OFFICIAL_KEYS = {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "wg.weight", "wg_0.weight", "wg_1.weight"}


def previous_formulation(patch):
    """The masked path as it was: the routers' GEMM and the routing first, then the heads from ``qkv`` alone and the
    gates multiplied in ``merge_heads``."""
    patch.setattr(MoH, "merge_routed", lambda m, x, weights: m.merge_heads(m.heads(x), m.route_fixed(x, weights).gates))


def randomised(m):
    with torch.no_grad():
        for name, _ in m.routers():
            getattr(m, name).weight.normal_(0, 0.5)
    return m


def packed(m):
    return packed_width(m.qkv.weight, m.qkv.bias, [r.weight for _, r in m.routers()]) is not None


def step(m, x, autocast=False):
    """One recorded forward + backward: output, the input's and every parameter's gradient, the routing record."""
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            record_routing(m, keep_selection=True) as routing:
        y = m(xi)
        loss = y.float().square().mean() + routing.aux_loss()
    if m.training:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return y.detach().float(), xi.grad, grads, routing.records[0]


@needs_kernel
@pytest.mark.parametrize("options", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "bf16 autocast"])
@pytest.mark.parametrize("training", [True, False])
def test_layer_equals_the_previous_formulation(options, dtype, training, monkeypatch):
    """One GEMM for qkv and the routers, the gates in the routing kernel's merge: the previous formulation's output,
    input and parameter gradients, aux loss and statistics (float64 / float32 to rounding, bf16 autocast within
    bf16's), and no operator of the previous one left: no weight stacked per call, no router GEMM, no gate
    multiply, one routing operator each way."""
    autocast = dtype == "bf16 autocast"
    torch.manual_seed(5)
    m = randomised(build_attention("moh", 48, 6, impl="masked", **options))
    m = m.to(torch.float32 if autocast else dtype).train(training)
    x = torch.randn(3, 9, 48, dtype=m.qkv.weight.dtype)
    assert packed(m)
    with Spy() as ops:
        y, gx, grads, rec = step(m, x, autocast)
    gemms = [op for op in ops.seen if op in ("aten.mm", "aten.addmm")]
    assert gemms.count("aten.addmm") + gemms.count("aten.mm") == (6 if training else 2)  # qkv+routers, proj (+ bwd)
    assert "aten.cat" not in ops.seen[:ops.seen.index("aten.pow")]  # the forward stacks nothing
    assert "aten.mul" not in ops.seen[:ops.seen.index("aten.pow")]  # no gate multiply of its own
    assert ops.seen.count("moh_routing.route_merge") == 1 and "moh_routing.route" not in ops.seen
    assert ops.seen.count("moh_routing.route_merge_backward") == training

    with monkeypatch.context() as patch:
        previous_formulation(patch)
        y_ref, gx_ref, grads_ref, rec_ref = step(m, x, autocast)
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}.get(
        dtype, dict(rtol=2e-2, atol=2e-2))
    torch.testing.assert_close(y, y_ref, **tol)
    if training:
        torch.testing.assert_close(gx, gx_ref, **tol)
        assert grads.keys() == grads_ref.keys() == {n for n, p in m.named_parameters()}
        for name in grads_ref:
            assert grads[name].dtype == grads_ref[name].dtype
            torch.testing.assert_close(grads[name], grads_ref[name], **tol, msg=name)
    if training and m.topk > 0:
        torch.testing.assert_close(rec.aux_loss, rec_ref.aux_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(rec.selection, rec_ref.selection)
    torch.testing.assert_close(rec.stats["load"], rec_ref.stats["load"], rtol=0, atol=0)


@needs_kernel
def test_state_dict_keys_are_official_and_an_official_layout_loads_with_identical_outputs(monkeypatch):
    """The packed layer's state dict has the official keys and shapes; a state dict of separate tensors (an official
    checkpoint's layout) loads strictly, copied or assigned, packs, and gives what the previous formulation gives
    with those weights (float64, to rounding)."""
    torch.manual_seed(1)
    m = randomised(build_attention("moh", 48, 6, impl="masked", activation_ratio=0.75)).double().eval()
    assert set(m.state_dict()) == OFFICIAL_KEYS
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {
        "qkv.weight": (144, 48), "qkv.bias": (144,), "proj.weight": (48, 48), "proj.bias": (48,),
        "wg.weight": (4, 48), "wg_0.weight": (2, 48), "wg_1.weight": (2, 48)}  # 2 shared, top-2 of 4
    official = {k: torch.randn_like(v) for k, v in m.state_dict().items()}  # one storage per tensor
    x = torch.randn(2, 11, 48, dtype=torch.float64)
    with monkeypatch.context() as patch:
        previous_formulation(patch)
        reference = build_attention("moh", 48, 6, impl="masked", activation_ratio=0.75).double().eval()
        reference.load_state_dict(official)
        with torch.no_grad():
            expected = reference(x)
    for assign in (False, True):
        fresh = build_attention("moh", 48, 6, impl="masked", activation_ratio=0.75).double().eval()
        fresh.load_state_dict(official, strict=True, assign=assign)
        assert packed(fresh)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, official[key]), key
        with torch.no_grad():
            torch.testing.assert_close(fresh(x), expected, rtol=1e-12, atol=1e-12)  # one GEMM's rounding, not two


@needs_kernel
def test_official_layout_checkpoint_loads_into_a_model(tmp_path, monkeypatch):
    """``checkpoint_path=`` with a checkpoint of separate tensors: every MoH layer packed, the outputs the previous
    formulation's with those weights."""
    torch.manual_seed(2)
    kw = dict(input_size=8, hidden_size=48)
    src = timm.create_model("moh_dit_s_2_75", **kw)
    path = tmp_path / "official.pt"
    torch.save({k: v.clone() for k, v in src.state_dict().items()}, path)  # no shared storage, as released
    loaded = timm.create_model("moh_dit_s_2_75", checkpoint_path=str(path), **kw).eval()
    layers = [b.attn for b in loaded.blocks]
    assert all(packed(a) for a in layers)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 4])
    with torch.no_grad():
        out = loaded(x, t, y)
        with monkeypatch.context() as patch:
            previous_formulation(patch)
            ref = loaded(x, t, y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_the_layout_survives_copies_and_is_restored_after_apply():
    """pickle and torch.save keep one storage; deepcopy (which clones each parameter: EMA copies) and ``.double()`` /
    ``.float()`` (new storages) pack again;
    a replaced parameter leaves the layer unpacked, and it runs the GEMMs apart with the same output."""
    torch.manual_seed(3)
    m = randomised(build_attention("moh", 32, 4, impl="masked", activation_ratio=0.75)).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        y = m(x)
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(buffer, weights_only=False),
                  copy.deepcopy(m).double().float()):
        assert packed(other)
        with torch.no_grad():
            assert torch.equal(other(x), y)
    loose = copy.deepcopy(m)
    loose.wg_0.weight = torch.nn.Parameter(loose.wg_0.weight.detach().clone())
    assert not packed(loose)
    with Spy() as ops, torch.no_grad():
        y_loose = loose(x)
    assert ops.seen.count("aten.addmm") + ops.seen.count("aten.mm") == 3  # qkv, the routers, proj
    torch.testing.assert_close(y_loose, y, rtol=1e-5, atol=1e-6)  # three GEMMs against one: float32 rounding


@needs_kernel
def test_functional_call_with_other_tensors_runs_the_gemms_apart():
    """torch.func.functional_call with parameters of their own storages (as torch.func transforms pass them)."""
    torch.manual_seed(4)
    m = randomised(build_attention("moh", 32, 4, impl="masked", activation_ratio=0.75)).train()
    x = torch.randn(2, 5, 32)
    params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    y = torch.func.functional_call(m, params, (x,))
    y.square().sum().backward()
    y_ref = m(x)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)  # one GEMM against three
    for name, p in m.named_parameters():
        # one GEMM against three: float32 rounding of gradients up to ~20 in size
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@needs_kernel
def test_a_weight_changed_in_place_before_the_backward_is_caught():
    """As with ``F.linear``: autograd refuses a backward after a router's or ``qkv``'s weight was modified in place."""
    for name in ("qkv", "wg_0"):
        m = build_attention("moh", 32, 4, impl="masked", activation_ratio=0.75).train()
        y = m(torch.randn(2, 5, 32, requires_grad=True))
        with torch.no_grad():
            getattr(m, name).weight.mul_(2)
        with pytest.raises(RuntimeError, match="inplace"):
            y.sum().backward()


@needs_kernel
def test_safetensors_save_file_writes_the_packed_state_dict_and_it_loads_back(tmp_path):
    """``safetensors.torch.save_file`` of a packed model's state dict (timm's ``push_to_hub`` path) writes every tensor
    apart; the file loads into a fresh model with equal outputs, and that model packs."""
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(6)
    kw = dict(input_size=8, hidden_size=48)
    src = timm.create_model("moh_dit_s_2_75", **kw).eval()
    assert all(packed(b.attn) for b in src.blocks)
    path = tmp_path / "model.safetensors"
    st.save_file(src.state_dict(), str(path))
    loaded = st.load_file(str(path))
    assert loaded.keys() == src.state_dict().keys()
    dst = timm.create_model("moh_dit_s_2_75", **kw).eval()
    dst.load_state_dict(loaded)
    assert all(packed(b.attn) for b in dst.blocks)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 4])
    with torch.no_grad():
        assert torch.equal(dst(x, t, y), src(x, t, y))


class Wrapped(torch.Tensor):
    """A tensor subclass standing for one that manages its own storage (FSDP's DTensor shards)."""


@needs_kernel
def test_a_tensor_subclass_parameter_is_never_packed():
    """``.float()`` (``Module._apply``, which packs) leaves a layer whose ``qkv`` weight is a tensor subclass unpacked,
    and it computes what it did."""
    torch.manual_seed(7)
    m = randomised(build_attention("moh", 32, 4, impl="masked", activation_ratio=0.75)).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        y = m(x)
    m.qkv.weight = torch.nn.Parameter(m.qkv.weight.detach().clone().as_subclass(Wrapped))
    m.float()
    assert not packed(m) and type(m.qkv.weight.data) is Wrapped
    with torch.no_grad():
        torch.testing.assert_close(m(x).as_subclass(torch.Tensor), y, rtol=1e-5, atol=1e-6)  # one GEMM against three
