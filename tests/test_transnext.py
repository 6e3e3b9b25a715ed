"""TransNeXt / MoH-ViT: checkpoint layout, sizes, presets, routing equivalences and the timm entry points.

Big models are built on the meta device (no memory, no init cost); everything that runs uses
``transnext_nano`` or tiny widths so the file stays fast on two CPU cores.
"""
import json
import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

from moh_vision.attention import build_attention, find_attention, record_routing
from moh_vision.errors import ConfigError
from moh_vision.models import transnext as T

DATA = Path(__file__).parent / "data"

DENSE = {"transnext_micro": 12.8e6, "transnext_tiny": 28.2e6, "transnext_small": 49.7e6, "transnext_base": 89.7e6}
# REFERENCE.md, section 1: per-stage (heads, shared_heads, topk)
MOH = {
    "moh_transnext_small_80": ((3, 6, 12, 24), (3, 6, 3, 8), (0, 0, 6, 12)),
    "moh_transnext_small_75": ((3, 6, 12, 24), (3, 6, 3, 4), (0, 0, 6, 12)),
    "moh_transnext_base_75": ((4, 8, 16, 32), (4, 8, 4, 5), (0, 0, 8, 16)),
    "moh_transnext_base_50": ((4, 8, 16, 32), (2, 2, 2, 4), (2, 4, 6, 8)),
}


def meta_model(name, **kwargs):
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def stage_attention(model, stage):
    return [m for n, m in find_attention(model) if n.startswith(f"block{stage}.")]


def zero_routers(model):
    with torch.no_grad():
        for _, m in find_attention(model):
            for name in ("wg", "wg_0", "wg_1", "w_gate"):
                if hasattr(m, name):
                    getattr(m, name).weight.zero_()


def tiny(**kwargs):
    """A 4-stage TransNeXt small enough to run many times: 2 heads of 8 in stage 1."""
    args = dict(img_size=64, embed_dims=(16, 32, 48, 64), num_heads=(2, 4, 6, 8), depths=(1, 1, 1, 1),
                mlp_ratios=(2, 2, 2, 2), num_classes=5)
    return T.TransNeXt(**{**args, **kwargs})


# ---------------------------------------------------------------------------------------------
# Checkpoint layout and sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["transnext_micro", "moh_transnext_small_80", "moh_transnext_base_50"])
def test_state_dict_equals_official_keys_and_shapes(name):
    """tests/data/transnext_official_keys.json was written by running the official TransNeXt /
    MoH-ViT code; names, shapes and order must match so released checkpoints load strictly."""
    official = json.loads((DATA / "transnext_official_keys.json").read_text())["models"][name]
    mine = [[k, list(v.shape)] for k, v in meta_model(name).state_dict().items()]
    assert mine == official


@pytest.mark.parametrize("name", sorted(DENSE))
def test_parameter_counts_match_paper(name):
    count = sum(p.numel() for p in meta_model(name).parameters())
    assert abs(count - DENSE[name]) / DENSE[name] < 0.005, count


def test_checkpoint_has_no_buffers():
    model = T.transnext_nano()
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    assert any(True for _ in model.buffers())  # position tables exist, they are just not saved


# ---------------------------------------------------------------------------------------------
# Presets and timm entry points
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DENSE) + ["transnext_nano"])
def test_dense_presets_build_with_dense_attention(name):
    model = meta_model(name)
    for stage in range(1, 5):
        layers = stage_attention(model, stage)
        assert layers and all(m.attention_name == "mha" for m in layers)
        expected_form = "transnext_full" if stage == 4 else "transnext_aggregated"
        assert all(m.form_name == expected_form for m in layers)
        assert all(m.head_dim == 24 for m in layers)


@pytest.mark.parametrize("name", sorted(MOH))
def test_moh_presets_have_documented_heads(name):
    model = meta_model(name)
    heads, shared, topk = MOH[name]
    for stage in range(4):
        layers = stage_attention(model, stage + 1)
        assert {(m.attention_name, m.num_heads, m.shared_heads, m.topk) for m in layers} == {
            ("moh", heads[stage], shared[stage], topk[stage])}
    assert model.pretrained_cfg["architecture"] == name


def test_create_model_passes_attention_options_and_overrides():
    model = meta_model("transnext_tiny", attention="moh", activation_ratio=0.5, img_size=64)
    assert model.img_size == (64, 64)
    stage3 = stage_attention(model, 3)[0]
    assert (stage3.attention_name, stage3.shared_heads + stage3.topk) == ("moh", 6)

    preset = meta_model("moh_transnext_small_75", img_size=96, depths=(1, 1, 2, 1))
    assert preset.img_size == (96, 96) and len(preset.block3) == 2
    assert stage_attention(preset, 4)[0].topk == 12
    # an activation ratio or another attention replaces the preset's heads
    ratio = meta_model("moh_transnext_small_75", activation_ratio=0.5, depths=(1, 1, 1, 1))
    assert stage_attention(ratio, 4)[0].shared_heads + stage_attention(ratio, 4)[0].topk == 12
    dense = meta_model("moh_transnext_small_75", attention="mha", depths=(1, 1, 1, 1))
    assert stage_attention(dense, 4)[0].attention_name == "mha"
    per_stage = meta_model("transnext_micro", depths=(1, 1, 1, 1), attention=["mha", "mha", "moh", "moa"],
                           topk=[None, None, 2, 3], shared_heads=[None, None, 2, None])
    assert [stage_attention(per_stage, s)[0].attention_name for s in range(1, 5)] == ["mha", "mha", "moh", "moa"]
    assert stage_attention(per_stage, 4)[0].topk == 3


def test_pretrained_download_is_refused(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (this machine has no network: the Hub's retries took 20 s)
    with pytest.raises(ConfigError, match="checkpoint_path"):
        timm.create_model("transnext_micro", pretrained=True)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(img_size=100), "multiple of 32"),
    (dict(img_size=224, pretrain_size=200), "multiple of 32"),
    (dict(depths=(1, 1, 1)), "4 per-stage values"),
    (dict(drop_path=0.1), "unknown argument(s) drop_path"),
    (dict(attention="moh", input_resolution=7), "sets the attention argument(s) input_resolution"),
    (dict(attention="flash"), "unknown attention 'flash'"),
])
def test_bad_configs_fail_at_construction_in_one_line(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        meta_model("transnext_nano", **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_wrong_input_size_says_how_to_fix():
    model = T.transnext_nano()
    with pytest.raises(ConfigError, match="img_size=64"):
        model(torch.randn(1, 3, 64, 64))
    attn = stage_attention(model, 1)[0]
    with pytest.raises(ConfigError, match="8x8 token grid"):
        attn(torch.randn(1, 10, 24))


def test_checkpoint_path_loads_strictly(tmp_path):
    torch.manual_seed(0)
    model = T.transnext_nano(attention="moh", activation_ratio=0.5, in_chans=1).eval()
    path = tmp_path / "nano.pt"
    torch.save(model.state_dict(), path)
    loaded = timm.create_model("transnext_nano", attention="moh", activation_ratio=0.5, in_chans=1,
                               checkpoint_path=str(path)).eval()
    x = torch.randn(2, 1, 32, 32)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Missing key"):  # strict: a MoH checkpoint is not a dense one
        timm.create_model("transnext_nano", attention="moa", in_chans=1, checkpoint_path=str(path))


def test_model_api():
    model = T.transnext_nano(num_classes=7)
    assert model.no_weight_decay_keywords() == {"query_embedding", "relative_pos_bias_local", "cpb", "temperature"}
    assert "block1.0.attn.query_embedding" in model.no_weight_decay()  # exact names (tests/test_timm_models.py)
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 32, 32) and cfg["pool_size"] == (1, 1)  # nano: the digits' settings
    assert timm.models.get_pretrained_cfg("transnext_tiny").crop_pct == 0.875
    assert cfg["num_classes"] == 7 and model.default_cfg is cfg
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)  # timm: the stage-4 map
    assert feats.shape == (2, 192, 1, 1) and model.forward_head(feats, pre_logits=True).shape == (2, 192)
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)


# ---------------------------------------------------------------------------------------------
# Running: every attention in every stage, every size
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention,options", [("mha", {}), ("moh", dict(activation_ratio=0.5)), ("moa", dict(topk=1))])
def test_nano_forward_backward_all_attentions(attention, options):
    torch.manual_seed(0)
    model = T.transnext_nano(attention=attention, in_chans=1, drop_path_rate=0.1, **options).train()
    assert {m.attention_name for _, m in find_attention(model)} == {attention}
    x = torch.randn(4, 1, 32, 32)
    with record_routing(model) as routing:
        logits = model(x)
    loss = F.cross_entropy(logits, torch.arange(4)) + routing.aux_loss()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("attention,options", [("moh", dict(shared_heads=(0, 2, 2, 2), topk=(1, 1, 2, 3))),
                                               ("moa", dict(topk=(1, 2, 3, 4)))])
def test_every_parameter_learns_at_64(attention, options):
    """At 64x64 every stage has a real token grid, so every parameter (routers, position MLPs,
    local biases, learnable tokens) must get a non-zero gradient."""
    torch.manual_seed(1)
    model = tiny(attention=attention, **options).train()
    for _, m in find_attention(model):  # a non-uniform router, so routing gradients are not symmetric
        for name in ("wg", "wg_0", "wg_1", "w_gate"):
            if hasattr(m, name):
                torch.nn.init.normal_(getattr(m, name).weight)
    x = torch.randn(2, 3, 64, 64)
    with record_routing(model) as routing:
        y = model(x)
    loss = y.square().mean() + routing.aux_loss(coef=1.0)
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not dead


def test_moh_preset_runs_at_reduced_size():
    torch.manual_seed(2)
    model = timm.create_model("moh_transnext_base_50", img_size=64, depths=(1, 1, 1, 1), num_classes=10).train()
    with record_routing(model) as routing:
        y = model(torch.randn(2, 3, 64, 64))
    (y.square().mean() + routing.aux_loss()).backward()
    assert y.shape == (2, 10) and torch.isfinite(y).all()
    assert routing.aux_loss() > 0


def test_bfloat16_autocast():
    model = tiny(attention=["moh", "moa", "moh", "moa"], topk=(1, 2, 3, 4), shared_heads=(1, None, 2, None)).train()
    with torch.autocast("cpu", dtype=torch.bfloat16), record_routing(model) as routing:
        y = model(torch.randn(2, 3, 64, 64))
        loss = y.float().square().mean() + routing.aux_loss()
    loss.backward()
    assert y.dtype == torch.bfloat16 and all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("img_size", [32, 64, 224, (64, 96)])
def test_nano_runs_at_many_sizes(img_size):
    model = T.transnext_nano(img_size=img_size).eval()
    size = (img_size, img_size) if isinstance(img_size, int) else img_size
    with torch.no_grad():
        y = model(torch.randn(1, 3, *size))
    assert y.shape == (1, 10) and torch.isfinite(y).all()


def test_fixed_pool_size():
    model = tiny(fixed_pool_size=1).eval()
    assert {m.pool_size for m in stage_attention(model, 2)} == {(1, 1)}
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 64, 64))).all()


# ---------------------------------------------------------------------------------------------
# Equivalences
# ---------------------------------------------------------------------------------------------
def test_moh_with_zero_router_and_all_heads_equals_dense_model():
    torch.manual_seed(3)
    dense = tiny().eval()
    # stage 1: dense-weighted (all shared); stages 2-4: shared + routed covering every head
    moh = tiny(attention="moh", shared_heads=(2, 1, 2, 3), topk=(0, 3, 4, 5)).eval()
    missing, unexpected = moh.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and missing and all(".wg" in k for k in missing)
    zero_routers(moh)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(moh(x), dense(x), rtol=1e-5, atol=1e-5)


def _moa_as_dense(moa, dense):
    """Give ``dense`` (mha over the same form) MoA's weights with its one key/value head repeated
    for every head, so that ``dense(x) == E * moa(x)`` when MoA's router is uniform over all E."""
    E, d = moa.num_heads, moa.head_dim
    k_w, v_w = moa.kv_proj.weight[:d], moa.kv_proj.weight[d:]
    kv_bias = moa.kv_proj.bias if moa.kv_proj.bias is not None else torch.zeros(2 * d)  # official MoA: no bias
    k_b, v_b = kv_bias[:d], kv_bias[d:]
    state = {k: v for k, v in moa.state_dict().items() if not k.startswith(("q_proj", "kv_proj", "proj", "w_gate"))}
    kv_w, kv_b = torch.cat([k_w.repeat(E, 1), v_w.repeat(E, 1)]), torch.cat([k_b.repeat(E), v_b.repeat(E)])
    q_w, q_b = moa.q_proj.weight, torch.zeros(E * d)
    if hasattr(dense, "qkv"):
        state.update({"qkv.weight": torch.cat([q_w, kv_w]), "qkv.bias": torch.cat([q_b, kv_b])})
    else:
        state.update({"q.weight": q_w, "q.bias": q_b, "kv.weight": kv_w, "kv.bias": kv_b})
    state.update({"proj.weight": moa.proj.weight, "proj.bias": torch.zeros(moa.dim)})
    dense.load_state_dict(state, strict=True)


@pytest.mark.parametrize("kv_bias", [False, True], ids=["official-no-kv-bias", "kv-bias"])
@pytest.mark.parametrize("form,args", [
    ("transnext_aggregated", dict(input_resolution=8, sr_ratio=4, pretrain_size=8)),
    ("transnext_full", dict(input_resolution=(3, 4))),
])
def test_one_head_keys_values_broadcast_to_all_heads(form, args, kv_bias):
    """MoA over the TransNeXt kernels: its single key/value head behaves exactly like that head
    copied into every head of the dense form."""
    torch.manual_seed(4)
    E, dim = 4, 32
    moa = build_attention("moa", dim, E, form=form, topk=E, kv_bias=kv_bias, **args).eval()
    assert moa.kv_proj.out_features == 2 * moa.head_dim
    assert (moa.kv_proj.bias is not None) == kv_bias
    with torch.no_grad():
        if kv_bias:
            moa.kv_proj.bias.normal_()
        if hasattr(moa, "learnable_bias"):
            moa.learnable_bias.normal_()
    dense = build_attention("mha", dim, E, form=form, **args).eval()
    _moa_as_dense(moa, dense)
    x = torch.randn(2, moa.num_tokens, dim)
    with torch.no_grad():
        torch.testing.assert_close(moa(x) * E, dense(x), rtol=1e-4, atol=1e-5)


def test_fused_and_explicit_full_attention_agree():
    torch.manual_seed(5)
    fused = build_attention("moh", 48, 4, form="transnext_full", input_resolution=4, shared_heads=1, topk=2)
    explicit = build_attention("moh", 48, 4, form="transnext_full", input_resolution=4, shared_heads=1, topk=2,
                               fused_attn=False)
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(2, 16, 48)
    torch.testing.assert_close(fused(x), explicit(x), rtol=1e-5, atol=1e-5)


def test_position_bias_equals_direct_mlp_over_all_pairs():
    """The separable gather equals evaluating the bias MLP on every (query, key) offset."""
    torch.manual_seed(6)
    attn = build_attention("mha", 24, 2, form="transnext_aggregated", input_resolution=(6, 8), sr_ratio=2,
                           pretrain_size=(7, 5))
    qh, qw = torch.meshgrid(torch.arange(6.0), torch.arange(8.0), indexing="ij")
    kh = F.adaptive_avg_pool1d(torch.arange(6.0)[None], 3)[0]
    kw = F.adaptive_avg_pool1d(torch.arange(8.0)[None], 4)[0]
    kh, kw = torch.meshgrid(kh, kw, indexing="ij")
    dh = (qh.reshape(-1, 1) - kh.reshape(1, -1)) / 6 * 8
    dw = (qw.reshape(-1, 1) - kw.reshape(1, -1)) / 4 * 8
    coords = torch.stack([dh, dw], dim=-1)
    coords = torch.sign(coords) * torch.log2(coords.abs() + 1) / math.log2(8)
    direct = attn.cpb_fc2(torch.relu(attn.cpb_fc1(coords))).permute(2, 0, 1)
    torch.testing.assert_close(attn.position_bias(), direct)


def test_convolutional_glu_keeps_less_and_equals_the_plain_form():
    """The ConvGLU after fc1 (``kernels.recompute=recompute``, the default) recomputes the depthwise convolution,
    GELU and the product in backward (fewer tensors kept) with the plain operators' values and gradients, in float32
    and under bf16 autocast."""
    from moh_vision.models import transnext as module

    torch.manual_seed(0)
    recomputing = module.ConvolutionalGLU(8, 24)
    plain = module.ConvolutionalGLU(8, 24, kernels={"recompute": "reference"})
    plain.load_state_dict(recomputing.state_dict())
    x = torch.randn(2, 12, 8, requires_grad=True)

    def run(mlp):
        mlp.zero_grad()
        x.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().data_ptr()) or t,
                                                      lambda t: t):
            y = mlp(x, 3, 4)
        y.square().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in mlp.parameters()], len(set(saved))

    fused, kept_fused = run(recomputing)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_bf16, _ = run(recomputing)
    want, kept_plain = run(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_bf16, _ = run(plain)
    assert kept_fused < kept_plain
    for got, ref in zip(fused, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for got, ref in zip(fused_bf16, plain_bf16):  # both in bf16 arithmetic, rounded differently
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_pooled_branch_and_position_mlp_keep_less_and_equal_the_plain_form():
    """In eager training the aggregated layer's position MLP keeps no hidden layer (recomputed in backward) and its
    average pool keeps nothing: fewer bytes saved, the plain operators' output and gradients."""
    from moh_vision.models import transnext as module

    attn = module.TransNeXtAggregatedAttention(16, 2, (6, 8), sr_ratio=2).double()
    plain = module.TransNeXtAggregatedAttention(16, 2, (6, 8), sr_ratio=2,
                                                kernels={"recompute": "reference"}).double()
    plain.load_state_dict(attn.state_dict())
    x = torch.randn(2, 48, 16, dtype=torch.float64, requires_grad=True)

    def run(layer):
        layer.zero_grad()
        x.grad = None
        kept = {}

        parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}  # alive anyway: not counted

        def pack(t):
            if t.untyped_storage().data_ptr() not in parameters:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in layer.parameters()], sum(kept.values())

    got, kept = run(attn)
    want, kept_plain = run(plain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    hidden = attn.relative_coords_table.shape[0] * module.CPB_HIDDEN * 8  # the MLP's hidden layer, float64
    pooled_input = 2 * 16 * 48 * 8                                         # the pool's input
    assert kept_plain - kept >= hidden + pooled_input


def test_average_pool_function_and_token_conv_equal_torch():
    from moh_vision.models.transnext import TokenConv1x1
    from moh_vision.ops.recompute import _AveragePool

    x = torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True)  # sizes the pool does not divide
    assert torch.autograd.gradcheck(lambda t: _AveragePool.apply(t, (3, 2)), (x,))
    torch.testing.assert_close(_AveragePool.apply(x, (3, 2)), torch.nn.functional.adaptive_avg_pool2d(x, (3, 2)))
    conv = TokenConv1x1(6).double()
    tokens = torch.randn(2, 12, 6, dtype=torch.float64)
    image = tokens.transpose(1, 2).reshape(2, 6, 3, 4)
    want = torch.nn.functional.conv2d(image, conv.weight, conv.bias).flatten(2).transpose(1, 2)
    torch.testing.assert_close(conv(tokens), want)
