"""The models as first-class timm models (issue 16): registered pretrained cfgs, feature backbones,
released checkpoints through ``pretrained=True``, training hooks, timm ViT/DeiT checkpoints, family tags.

timm's own model tests are in tests/test_timm_conformance.py. Everything here runs on the smallest
model of each family (or on the meta device); checkpoints in the official formats are made from
deterministic weights, and the full-size official key lists are exercised under ``-m slow``.
"""
import argparse
import json
import re
from pathlib import Path

import pytest
import timm
import timm.optim
import torch

import moh_vision  # noqa: F401  (registers the models)
from moh_vision.attention import find_attention
from moh_vision.errors import ConfigError
from moh_vision.models import DiT, PlainViT, TransNeXt, build_model, list_models, model_family
from moh_vision.models.vit import TIMM_EQUIVALENTS, checkpoint_filter_fn

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
SMALLEST = {"transnext": "transnext_nano", "vit": "plain_vit_nano", "dit": "dit_tiny_2"}
MOH = dict(attention="moh", activation_ratio=0.5)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (10x faster on a busy 2-core machine); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def meta(name, **kwargs):
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def deterministic_(model, seed=0):
    """Every parameter and buffer from one seeded generator (no dependence on init order or threads)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    return model


def dit_batch(model, B=2):
    g = torch.Generator().manual_seed(1)
    C, (H, W) = model.in_channels, model.input_size
    return (torch.randn(B, C, H, W, generator=g), torch.randint(0, 1000, (B,), generator=g).float(),
            torch.randint(0, model.num_classes, (B,), generator=g))


# ---------------------------------------------------------------------------------------------
# Family tags (issue 13) and which names are ours
# ---------------------------------------------------------------------------------------------
def test_our_models_are_exactly_those_registered_from_our_modules():
    from timm.models import model_entrypoint
    registered = {n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("moh_vision.")}
    assert set(list_models()) == registered and len(registered) == 34
    assert {cls.family for cls in (TransNeXt, DiT, PlainViT)} == {"transnext", "dit", "vit"}
    assert {model_family(n) for n in list_models()} == {"transnext", "dit", "vit"}
    assert model_family("moh_dit_xl_2_90") == "dit" and model_family("moh_transnext_base_50") == "transnext"
    features = timm.create_model("transnext_nano", features_only=True)
    assert model_family(features) == "transnext" and model_family(timm.create_model("dit_tiny_2")) == "dit"



def test_wrapped_models_are_looked_through_with_timms_unwrap_model():
    """The project keeps no unwrapping helper of its own (issue 60): ``moh_vision.models.unwrap_model`` is timm's,
    which looks through ``torch.compile`` and DDP (anything holding the model as ``.module``), nested either way; the
    family tag and the routing recorder's layer names are read through it."""
    from timm.utils.model import unwrap_model as timms
    from moh_vision.attention import record_routing
    from moh_vision.models import unwrap_model

    class Wrapper(torch.nn.Module):  # what DistributedDataParallel looks like from outside: the model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = timm.create_model("dit_tiny_2", attention="moh")
    assert unwrap_model is timms
    for wrapped in (torch.compile(model), Wrapper(torch.compile(model)), torch.compile(Wrapper(model))):
        assert unwrap_model(wrapped) is model and model_family(wrapped) == "dit"
        assert record_routing(wrapped).model is model

def test_unknown_model_names_are_config_errors_with_suggestions():
    from moh_vision.models.families import check_model_name
    with pytest.raises(ConfigError, match="did you mean transnext_nano"):
        check_model_name("transnext_nanoo")
    with pytest.raises(ConfigError, match="not one of moh-vision's"):
        model_family("resnet18")


# ---------------------------------------------------------------------------------------------
# Item 3: a pretrained cfg for every registered model
# ---------------------------------------------------------------------------------------------
BUILT = ["transnext_nano", "transnext_micro", "moh_transnext_base_50", "plain_vit_nano", "plain_vit_base", "dit_tiny_2",
         "dit_s_8", "moh_dit_s_2_75"]  # built on the meta device (all 34 take 5 s); every cfg is checked


def test_every_model_has_a_registered_cfg_that_fits_it():
    for name in list_models():
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg is not None and cfg.architecture == name, name
        channels = cfg.input_size[0]
        assert len(cfg.mean) == len(cfg.std) == channels, name
        assert cfg.crop_pct and cfg.interpolation in ("bicubic", "bilinear") and cfg.fixed_input_size, name
        assert cfg.first_conv and cfg.classifier and cfg.num_classes > 0 and cfg.origin_url, name
        if name not in BUILT:
            continue
        model = meta(name)
        assert model.pretrained_cfg["input_size"] == cfg.input_size, name
        keys = model.state_dict()
        assert f"{cfg.first_conv}.weight" in keys and f"{cfg.classifier}.weight" in keys, name
        assert keys[f"{cfg.first_conv}.weight"].shape[1] == channels, name
        if model_family(name) == "transnext":
            assert cfg.pool_size == (cfg.input_size[1] // 32, cfg.input_size[2] // 32), name
        else:
            assert cfg.pool_size is None, name
    paper = timm.models.get_pretrained_cfg("transnext_tiny")
    assert (paper.input_size, paper.crop_pct, paper.interpolation, paper.pool_size) == ((3, 224, 224), 0.875,
                                                                                        "bicubic", (7, 7))
    assert timm.models.get_pretrained_cfg("dit_xl_2").input_size == (4, 32, 32)


def test_data_config_describes_the_built_model():
    dit = timm.create_model("dit_tiny_2")
    assert timm.data.resolve_model_data_config(dit)["input_size"] == (1, 16, 16)
    latent = meta("dit_s_2", input_size=64)
    assert timm.data.resolve_model_data_config(latent)["input_size"] == (4, 64, 64)
    grey = timm.create_model("transnext_nano", in_chans=1, img_size=64, num_classes=3)
    cfg = grey.pretrained_cfg
    assert (cfg["input_size"], cfg["pool_size"], cfg["num_classes"], cfg["mean"]) == ((1, 64, 64), (2, 2), 3, (0.5,))
    assert grey.default_cfg is cfg and cfg["architecture"] == "transnext_nano"


def test_pretrained_without_a_local_file_is_refused():
    with pytest.raises(ConfigError, match=r"pretrained_cfg_overlay=dict\(file="):
        timm.create_model("transnext_nano", pretrained=True)
    with pytest.raises(ConfigError, match="does not exist"):
        timm.create_model("dit_tiny_2", pretrained=True, pretrained_cfg_overlay=dict(file="/nonexistent.pth"))


# ---------------------------------------------------------------------------------------------
# Released weights from where they live: the hub (and DiT's URL), tested offline on a pre-populated cache
# ---------------------------------------------------------------------------------------------
SHRUNK = {"transnext": dict(depths=(1, 1, 1, 1)), "dit": dict(depth=1, hidden_size=64, num_heads=4)}


def hub_cache_file(cache, repo, filename, obj):
    """``obj`` saved where huggingface_hub's cache keeps ``repo``'s ``filename`` at revision main."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "a" * 40
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    torch.save(obj, folder / "snapshots" / commit / filename)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache and torch hub dir in tmp_path, HF_HUB_OFFLINE=1, and no socket may connect."""
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path


def test_pretrained_cfgs_say_where_the_released_weights_live():
    cfg = lambda name: timm.models.get_pretrained_cfg(name).to_dict()  # noqa: E731
    for size in ("micro", "tiny", "small", "base"):
        assert (cfg(f"transnext_{size}")["hf_hub_id"], cfg(f"transnext_{size}")["hf_hub_filename"]) == (
            f"DaiShiResearch/transnext-{size}-224-1k", f"transnext_{size}_224_1k.pth")
    for size in ("small", "base"):
        assert (cfg(f"transnext_{size}.in1k_384")["hf_hub_id"], cfg(f"transnext_{size}.in1k_384")["input_size"]) == (
            f"DaiShiResearch/transnext-{size}-384-1k-ft-1k", (3, 384, 384))
    assert {cfg(f"moh_transnext_{n}")["hf_hub_id"] for n in ("base_75", "base_50", "small_80", "small_75")} == {
        f"Chat-UniVi/MoH-ViT-{n}" for n in ("B-75", "B-50", "S-80", "S-75")}
    assert cfg("moh_dit_xl_2_90")["hf_hub_id"] == "Chat-UniVi/MoH-DiT-XL-90"
    assert cfg("dit_xl_2")["url"].endswith("/DiT-XL-2-256x256.pt")
    assert cfg("dit_xl_2.in1k_512")["url"].endswith("/DiT-XL-2-512x512.pt")
    assert not any(cfg(name).get(k) for name in ("transnext_nano", "dit_s_2") for k in ("hf_hub_id", "url"))


def test_pretrained_true_loads_released_weights_from_the_hub_cache_offline(offline_hub):
    cache = offline_hub / "hf"
    # TransNeXt: the released plain state dict, under the name the repo publishes
    source = deterministic_(timm.create_model("transnext_micro", **SHRUNK["transnext"]))
    hub_cache_file(cache, "DaiShiResearch/transnext-micro-224-1k", "transnext_micro_224_1k.pth", source.state_dict())
    model = timm.create_model("transnext_micro", pretrained=True, **SHRUNK["transnext"])
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    assert model.pretrained_cfg["file"].startswith(str(cache))
    # the 384 fine-tune is its own tag and repo
    small = deterministic_(timm.create_model("transnext_small", **SHRUNK["transnext"]), seed=3)
    hub_cache_file(cache, "DaiShiResearch/transnext-small-384-1k-ft-1k", "transnext_small_384_1k_ft_1k.pth",
                   small.state_dict())
    model = timm.create_model("transnext_small.in1k_384", pretrained=True, **SHRUNK["transnext"])
    assert torch.equal(model.head.weight, small.head.weight)
    # MoH-ViT: a training checkpoint (pickled arguments); a repo whose one weights file has another name is found
    moh = deterministic_(timm.create_model("moh_transnext_small_80", **SHRUNK["transnext"]), seed=1)
    hub_cache_file(cache, "Chat-UniVi/MoH-ViT-S-80", "checkpoint.pth",
                   {"model": moh.state_dict(), "args": argparse.Namespace(model="moh_transnext_small_80")})
    model = timm.create_model("moh_transnext_small_80", pretrained=True, **SHRUNK["transnext"])
    assert all(torch.equal(v, moh.state_dict()[k]) for k, v in model.state_dict().items())
    # DiT: the released URL's file in timm's download cache ($TORCH_HOME/hub/checkpoints)
    dit = deterministic_(timm.create_model("dit_xl_2", **SHRUNK["dit"]), seed=2)
    (offline_hub / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(dit.state_dict(), offline_hub / "torch" / "hub" / "checkpoints" / "DiT-XL-2-256x256.pt")
    model = timm.create_model("dit_xl_2", pretrained=True, **SHRUNK["dit"])
    assert all(torch.equal(v, dit.state_dict()[k]) for k, v in model.state_dict().items())
    # a local file still wins, and is all it reads
    local = offline_hub / "local.pth"
    torch.save(moh.state_dict(), local)
    model = timm.create_model("moh_transnext_small_80", pretrained=True, pretrained_cfg_overlay=dict(file=str(local)),
                              **SHRUNK["transnext"])
    assert model.pretrained_cfg["file"] == str(local)


def test_pretrained_true_without_the_weights_names_the_id_and_the_local_route(offline_hub):
    with pytest.raises(ConfigError, match=r"Chat-UniVi/MoH-DiT-XL-90: HF_HUB_OFFLINE is set and it is not in the "
                                          r"hub cache .*pretrained_cfg_overlay=dict\(file=<path>\)"):
        timm.create_model("moh_dit_xl_2_90", pretrained=True, **SHRUNK["dit"])
    with pytest.raises(ConfigError, match=r"DaiShiResearch/transnext-base-224-1k \(transnext_base_224_1k.pth\).*"
                                          r"hf download DaiShiResearch"):
        timm.create_model("transnext_base", pretrained=True, **SHRUNK["transnext"])
    with pytest.raises(ConfigError, match=r"DiT-XL-2-512x512.pt: HF_HUB_OFFLINE is set.*pretrained_cfg_overlay"):
        timm.create_model("dit_xl_2.in1k_512", pretrained=True, **SHRUNK["dit"])


@pytest.mark.parametrize("name,kwargs,fmt", [
    ("transnext_nano", {}, "plain"),                               # released TransNeXt .pth: the state dict
    ("transnext_nano", MOH, "moh_vit_training"),                   # MoH-ViT main.py checkpoint (pickled args)
    ("dit_tiny_2", {}, "plain"),                                   # DiT-XL-2-256x256.pt: EMA state dict
    ("dit_tiny_2", dict(attention="moh", shared_heads=1, topk=2), "dit_training"),  # MoH-DiT train.py: EMA
    ("plain_vit_nano", MOH, "timm_training"),                      # timm train.py: state_dict(_ema)
])
def test_pretrained_true_loads_official_formats(tmp_path, name, kwargs, fmt):
    source = deterministic_(timm.create_model(name, **kwargs)).eval()
    state = source.state_dict()
    args = argparse.Namespace(model=name, lr=1e-3, betas=[0.9, 0.999], output_dir="results", resume="")
    noise = {k: v + 1.0 for k, v in state.items()}  # raw weights, which must NOT be taken over EMA ones
    ckpt = {
        "plain": state,
        "moh_vit_training": {"model": {f"module.{k}": v for k, v in state.items()}, "optimizer": {"state": {}},
                             "lr_scheduler": None, "epoch": 299, "scaler": {}, "args": args, "max_accuracy": 84.7},
        "dit_training": {"model": noise, "ema": state, "opt": {"state": {}, "param_groups": []}, "args": args},
        "timm_training": {"state_dict": noise, "state_dict_ema": state, "epoch": 3, "arch": name},
    }[fmt]
    path = tmp_path / f"{name}_{fmt}.pth"
    torch.save(ckpt, path)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs).eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert model.pretrained_cfg["file"] == str(path) and "state_dict" not in model.pretrained_cfg
    with torch.no_grad():
        if isinstance(model, DiT):
            torch.testing.assert_close(model(*dit_batch(model)), source(*dit_batch(source)), rtol=0, atol=0)
        else:
            x = torch.randn(2, *model.pretrained_cfg["input_size"])
            torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["transnext_nano", "plain_vit_nano"])
def test_pretrained_adapts_channels_and_classes_like_timm(tmp_path, name):
    """timm's test_model_load_pretrained (in_chans=1, num_classes=5 / 0) and test_model_features_pretrained,
    with a local file instead of the hub."""
    source = deterministic_(timm.create_model(name))
    path = tmp_path / f"{name}.pth"
    torch.save(source.state_dict(), path)
    overlay = dict(file=str(path))
    first_conv, width = source.pretrained_cfg["first_conv"], source.num_features
    grey = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, in_chans=1, num_classes=5)
    expected = source.get_parameter(f"{first_conv}.weight").sum(dim=1, keepdim=True)  # timm's adapt_input_conv
    torch.testing.assert_close(grey.get_parameter(f"{first_conv}.weight"), expected)
    kept = [k for k in source.state_dict() if k.endswith("attn.proj.weight")][-1]
    assert torch.equal(grey.state_dict()[kept], source.state_dict()[kept])
    assert grey.get_classifier().out_features == 5
    features = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0)
    assert features(torch.randn(1, 3, 32, 32)).shape == (1, width)
    backbone = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, features_only=True)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in backbone.model.state_dict().items())
    assert "state_dict" not in backbone.pretrained_cfg and "state_dict" not in backbone.model.pretrained_cfg
    with pytest.raises(ConfigError, match=f"do not fit {name}"):
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, attention="moa")


def test_pickled_objects_other_than_arguments_are_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"model": {}, "hook": Path("/tmp")}, path)
    with pytest.raises(ConfigError, match="convert_checkpoint.py"):
        timm.create_model("dit_tiny_2", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


def _official_state(keys_and_shapes):
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(tuple(shape), generator=g) * 0.02 for k, shape in keys_and_shapes.items()}


@pytest.mark.slow
def test_pretrained_loads_full_size_files_built_from_the_official_key_lists(tmp_path):
    """Released-format files from the key lists the official code produces (tests/data): TransNeXt-Micro as a
    plain state dict, MoH-DiT-S/2-75 as its training checkpoint (EMA weights, pickled arguments)."""
    official = json.loads((DATA / "transnext_official_keys.json").read_text())["models"]["transnext_micro"]
    state = _official_state(dict(official))
    torch.save(state, tmp_path / "transnext_micro_224_1k.pth")
    model = timm.create_model("transnext_micro", pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / "transnext_micro_224_1k.pth")))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    official = json.loads((DATA / "dit_official_keys_moh_dit_s_2_75.json").read_text())["state_dict"]
    state = _official_state(dict(official))
    torch.save({"model": state, "ema": state, "opt": {}, "args": argparse.Namespace(model="MoH-DiT-S/2-75")},
               tmp_path / "0400000.pt")
    model = timm.create_model("moh_dit_s_2_75", pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / "0400000.pt")))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------
# Item 2: dense prediction backbones
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention,options", [("mha", {}), ("moh", dict(activation_ratio=0.5)), ("moa", dict(topk=1))])
def test_transnext_features_with_every_attention(attention, options):
    torch.manual_seed(0)
    model = timm.create_model("transnext_nano", attention=attention, img_size=64, **options).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        assert [tuple(m.shape) for m in maps] == [(2, 24, 16, 16), (2, 48, 8, 8), (2, 96, 4, 4), (2, 192, 2, 2)]
        assert torch.equal(final, model.forward_features(x)) and torch.equal(final, maps[-1])
        tokens = model.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)
        assert torch.equal(tokens[0], maps[1].flatten(2).transpose(1, 2))
        backbone = timm.create_model("transnext_nano", attention=attention, img_size=64, features_only=True,
                                     out_indices=(1, 2), **options).eval()
        backbone.model.load_state_dict(model.state_dict(), strict=False)
        assert backbone.feature_info.channels() == [48, 96] and backbone.feature_info.reduction() == [8, 16]
        assert not hasattr(backbone.model, "block4")  # stages after the last wanted one are pruned
        feats = backbone(x)
    assert all(torch.equal(f, m) for f, m in zip(feats, maps[1:3]))


@pytest.mark.parametrize("attention,options", [("mha", {}), ("moh", dict(activation_ratio=0.5)), ("moa", dict(topk=2))])
def test_vit_features_with_every_attention(attention, options):
    torch.manual_seed(0)
    model = timm.create_model("plain_vit_nano", attention=attention, **options).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x, indices=(1, 3, 5), return_prefix_tokens=True)
        assert [(tuple(m.shape), tuple(p.shape)) for m, p in maps] == [((2, 128, 8, 8), (2, 1, 128))] * 3
        assert torch.equal(final, model.forward_features(x))
        backbone = timm.create_model("plain_vit_nano", attention=attention, features_only=True, out_indices=(1, 3),
                                     **options).eval()
        backbone.model.load_state_dict(model.state_dict(), strict=False)
        assert backbone.feature_info.channels() == [128, 128] and len(backbone.model.blocks) == 4
        feats = backbone(x)
    assert all(torch.equal(f, m) for f, (m, _) in zip(feats, maps[:2]))
    assert len(timm.create_model("plain_vit_nano", features_only=True)(x)) == 3  # timm's default: the last 3 blocks


def test_dit_is_not_a_feature_backbone():
    with pytest.raises(ConfigError, match="not a feature backbone"):
        timm.create_model("dit_tiny_2", features_only=True)


def _docs_example(title):
    """The python block under ``title`` in docs/models.md's timm section, run as written (tests/test_docs.py
    runs every snippet; these check what the snippets compute)."""
    text = (REPO / "docs" / "models.md").read_text()
    match = re.search(re.escape(title) + r".*?```python\n(.*?)```", text, re.S)
    assert match, f"docs/models.md has no example '{title}'"
    return match.group(1)


def test_docs_feature_extraction_example_runs_as_written():
    namespace = {}
    exec(compile(_docs_example("Feature extraction"), "docs/models.md", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]) and namespace["backbone"].feature_info.channels() == [24, 48, 96, 192]


# ---------------------------------------------------------------------------------------------
# Item 4: training-time hooks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["transnext", "vit", "dit"])
def test_grad_checkpointing_gives_the_same_gradients(family):
    name = SMALLEST[family]
    kwargs = dict(attention="moh", shared_heads=1, topk=2) if family == "dit" else dict(MOH, drop_path_rate=0.1)
    torch.manual_seed(0)
    a = deterministic_(timm.create_model(name, **kwargs)).train()
    b = deterministic_(timm.create_model(name, **kwargs)).train()
    b.set_grad_checkpointing(True)
    if family == "dit":
        inputs = dit_batch(a)
    else:
        inputs = (torch.randn(2, *a.pretrained_cfg["input_size"]),)
    for m in (a, b):
        torch.manual_seed(1)  # the same drop path / label dropout in both
        m(*inputs).square().mean().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_no_weight_decay_names_exactly_what_the_official_recipes_exclude():
    model = timm.create_model("transnext_nano", **MOH)
    names = model.no_weight_decay()
    official = {n for n, _ in model.named_parameters()
                if any(k in n for k in ("query_embedding", "relative_pos_bias_local", "cpb", "temperature"))}
    assert names == official and names <= dict(model.named_parameters()).keys()
    assert {n.split(".")[-1] for n in names if ".cpb" not in n} == {"query_embedding", "temperature",
                                                                     "relative_pos_bias_local"}
    optimizer = timm.optim.create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    params = dict(model.named_parameters())
    assert all(id(params[n]) not in decayed for n in names)
    assert id(params["block4.0.attn.qkv.weight"]) in decayed and id(params["block3.0.attn.wg.weight"]) in decayed
    assert timm.create_model("plain_vit_nano").no_weight_decay() == {"pos_embed", "cls_token"}
    assert timm.create_model("plain_vit_nano", global_pool="avg").no_weight_decay() == {"pos_embed"}
    assert timm.create_model("dit_tiny_2").no_weight_decay() == set()  # official recipe: weight decay 0


def test_group_matcher_orders_layers_for_layer_decay():
    from timm.models import group_parameters
    model = timm.create_model("transnext_nano", **MOH)
    layer = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    assert layer["patch_embed1.proj.weight"] == 0 and layer["block1.0.attn.q.weight"] == 1
    assert layer["norm1.weight"] == layer["block1.0.mlp.fc2.weight"] < layer["patch_embed2.proj.weight"]
    assert layer["patch_embed2.proj.weight"] < layer["block2.0.norm1.weight"] < layer["block3.1.attn.wg.weight"]
    assert layer["head.weight"] == max(layer.values())
    coarse = group_parameters(model, model.group_matcher(coarse=True), reverse=True)
    assert len(set(coarse.values())) == 6  # stem, four stages, head
    vit = timm.create_model("plain_vit_nano")
    layer = group_parameters(vit, vit.group_matcher(), reverse=True)
    assert layer["cls_token"] == layer["pos_embed"] == 0 and layer["blocks.5.attn.qkv.weight"] == 6
    dit = meta("dit_tiny_2")
    layer = group_parameters(dit, dit.group_matcher(), reverse=True)
    assert layer["y_embedder.embedding_table.weight"] == 0 and layer["final_layer.linear.weight"] == 6
    for m in (model, vit):
        optimizer = timm.optim.create_optimizer_v2(m, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)
        assert len({g["lr_scale"] for g in optimizer.param_groups}) > 4


def test_reset_classifier_has_timms_semantics():
    x = torch.randn(2, 3, 32, 32)
    model = timm.create_model("transnext_nano").eval()
    assert model.get_classifier() is model.head
    model.reset_classifier(0, "")
    assert model(x).shape == (2, 192, 1, 1) and model.global_pool == ""
    model.reset_classifier(0, "avg")
    assert model(x).shape == (2, 192)
    model.reset_classifier(7)
    assert model(x).shape == (2, 7) and model.get_classifier().out_features == 7
    with pytest.raises(ConfigError, match="num_classes=0"):
        model.reset_classifier(3, "")
    vit = timm.create_model("plain_vit_nano").eval()
    vit.reset_classifier(0, "")
    assert vit(x).shape == (2, 65, 128)
    vit.reset_classifier(5, "avg")
    assert vit(x).shape == (2, 5) and vit.global_pool == "avg"
    torch.testing.assert_close(vit.forward_head(vit.forward_features(x), pre_logits=True),
                               vit.forward_features(x)[:, 1:].mean(1))
    with pytest.raises(ConfigError, match="global_pool='max'"):
        vit.reset_classifier(5, "max")


# ---------------------------------------------------------------------------------------------
# Item 5: timm ViT / DeiT checkpoints
# ---------------------------------------------------------------------------------------------
def test_timm_vit_checkpoint_loads_into_the_matching_preset_and_continue_tunes(tmp_path):
    assert TIMM_EQUIVALENTS["vit_tiny_patch16_224"] == TIMM_EQUIVALENTS["deit_tiny_patch16_224"] == "plain_vit_tiny"
    torch.manual_seed(0)
    theirs = timm.create_model("vit_tiny_patch16_224").eval()
    path = tmp_path / "vit_tiny_patch16_224.pth"
    torch.save(theirs.state_dict(), path)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        expected = theirs(x)
        ours = timm.create_model("plain_vit_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        # dense -> MoH with every head active starts as the very same function ...
        moh = build_model("plain_vit_tiny", attention={"name": "moh", "activation_ratio": 1.0},
                          init_from=str(path)).eval()
        torch.testing.assert_close(moh(x), expected, rtol=1e-4, atol=1e-4)
        # ... and a real MoH-ViT (75% of the heads) starts from the same weights
        moh = build_model("plain_vit_tiny", attention={"name": "moh", "activation_ratio": 0.75},
                          init_from=str(path)).eval()
        assert torch.equal(moh.blocks[3].attn.qkv.weight, theirs.blocks[3].attn.qkv.weight)
        assert {m.topk for _, m in find_attention(moh)} == {1} and torch.isfinite(moh(x)).all()


def test_timm_vit_checkpoint_filter_resamples_and_refuses_other_variants():
    theirs = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=1, num_classes=10)
    model = timm.create_model("plain_vit_nano", img_size=64, embed_dim=192, num_heads=3, depth=1)
    state = checkpoint_filter_fn(theirs.state_dict(), model)
    assert state["pos_embed"].shape == model.pos_embed.shape == (1, 257, 192)
    model.load_state_dict(state)
    distilled = {**theirs.state_dict(), "dist_token": torch.zeros(1, 1, 192)}
    with pytest.raises(ConfigError, match="distillation token"):
        checkpoint_filter_fn(distilled, model)


def test_docs_timm_vit_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(_docs_example("From a timm ViT"), "docs/models.md", "exec"), namespace)
    torch.testing.assert_close(namespace["moh_out"], namespace["timm_out"], rtol=1e-4, atol=1e-4)
