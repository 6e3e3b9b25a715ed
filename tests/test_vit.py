"""Plain ViT classifier: timm layout and numerics, presets, pluggable attention, checkpoints."""
import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from moh_vision.attention import record_routing
from moh_vision.errors import ConfigError
from moh_vision.models.vit import PlainViT

PRESETS = {  # name: (img_size, patch, width, heads, depth)
    "plain_vit_tiny": (224, 16, 192, 3, 12),
    "plain_vit_small": (224, 16, 384, 6, 12),
    "plain_vit_base": (224, 16, 768, 12, 12),
    "plain_vit_nano": (32, 4, 128, 4, 6),
}


def small(attention="mha", **kw):
    args = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=7)
    args.update(kw)
    return PlainViT(attention=attention, **args)


# ---------------------------------------------------------------------------------------------
# Same layout and function as timm's VisionTransformer
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours,theirs", [("plain_vit_tiny", "vit_tiny_patch16_224"),
                                         ("plain_vit_small", "vit_small_patch16_224"),
                                         ("plain_vit_base", "vit_base_patch16_224")])
def test_keys_and_shapes_equal_timm_vit(ours, theirs):
    with torch.device("meta"):
        a, b = timm.create_model(ours), timm.create_model(theirs)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}


def test_mha_computes_what_timm_vit_computes():
    torch.manual_seed(0)
    ref = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=7).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    model = small().eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True),
                                   ref.forward_head(ref.forward_features(x), pre_logits=True), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Presets and conventions
# ---------------------------------------------------------------------------------------------
def test_presets_build_with_their_sizes():
    for name, (img, patch, width, heads, depth) in PRESETS.items():
        with torch.device("meta"):
            model = timm.create_model(name)
        assert model.patch_embed.patch_size == (patch, patch) and model.patch_embed.img_size == (img, img)
        assert model.embed_dim == width and len(model.blocks) == depth
        assert all(b.attn.num_heads == heads and b.attn.attention_name == "mha" for b in model.blocks)
        assert model.pretrained_cfg["input_size"] == (3, img, img) == model.default_cfg["input_size"]
        assert timm.models.get_pretrained_cfg(name).input_size == (3, img, img)
    assert timm.create_model("plain_vit_nano").num_classes == 10


def test_kwargs_options_and_timm_extras():
    model = timm.create_model("plain_vit_nano", attention="moh", activation_ratio=0.75, in_chans=1, num_classes=3,
                              drop_path_rate=0.1, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None)
    assert all((b.attn.shared_heads, b.attn.topk) == (1, 2) for b in model.blocks)
    assert model.pretrained_cfg["input_size"] == (1, 32, 32) and model.pretrained_cfg["num_classes"] == 3
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 3)
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    model.reset_classifier(5)
    assert model.get_classifier().out_features == 5
    with pytest.raises(ConfigError, match="checkpoint_path"):
        timm.create_model("plain_vit_nano", pretrained=True)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(img_size=30), "img_size=30 is not divisible by patch_size=8"),
    (dict(global_pool="max"), "global_pool='max' is unknown"),
    (dict(num_heads=[4, 4, 4]), "num_heads has 3 entries but depth=2"),
    (dict(attention="moh", shared_heads=1, topk=5), "ViT block 0: topk=5 exceeds"),
])
def test_invalid_configs_raise_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        small(**kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_mean_pooling_has_no_class_token():
    model = small(global_pool="avg")
    assert model.cls_token is None and model.pos_embed.shape == (1, 16, 64)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_drop_path_rises_linearly_and_is_off_in_eval():
    model = small(drop_path_rate=0.3, depth=4)
    rates = [getattr(b.drop_path1, "drop_prob", 0.0) for b in model.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


# ---------------------------------------------------------------------------------------------
# Attention variants
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention,opts", [("mha", {}), ("moh", dict(shared_heads=1, topk=2)),
                                            ("moh", dict(shared_heads=[4, 2], topk=[0, 1])), ("moa", dict(topk=2))])
def test_forward_backward_reaches_every_parameter(attention, opts):
    torch.manual_seed(0)
    model = small(attention, **opts).train()
    if attention == "moa":  # MoA starts from a zero router; give it a direction so every expert gets gradient
        with torch.no_grad():
            for b in model.blocks:
                b.attn.w_gate.weight.normal_()
    x = torch.randn(4, 3, 32, 32)
    with record_routing(model) as routing:
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3])) + routing.aux_loss(coef=1.0)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    if attention == "moa":
        assert all(b.attn.topk == 2 for b in model.blocks)


def test_moh_zero_router_all_heads_equals_dense():
    torch.manual_seed(1)
    dense = small().eval()
    moh = small("moh", shared_heads=[1, 4], topk=[3, 0]).eval()
    result = moh.load_state_dict(dense.state_dict(), strict=False)
    assert not result.unexpected_keys
    with torch.no_grad():
        for k in result.missing_keys:
            moh.get_parameter(k).zero_()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(moh(x), dense(x), rtol=1e-5, atol=1e-5)


def test_create_model_checkpoint_path_strict_load(tmp_path):
    src = timm.create_model("plain_vit_nano", attention="moh", activation_ratio=0.5, depth=2)
    path = tmp_path / "vit.pt"
    torch.save(src.state_dict(), path)
    loaded = timm.create_model("plain_vit_nano", attention="moh", activation_ratio=0.5, depth=2,
                               checkpoint_path=str(path))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), src.eval()(x))
