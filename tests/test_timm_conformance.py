"""timm's own model tests, run on the smallest model of each image-classifier family.

The checks are those of ``tests/test_models.py`` in huggingface/pytorch-image-models (read at the
newest snapshot available to us, timm 1.0.29.dev0 sources; the installed wheel is ``timm.__version__``,
which ships no tests), reproduced here function by function with timm's own helpers, constants and
assertions. timm applies to a model the tests of its kind: TransNeXt is a hierarchical backbone (like
``pvt_v2``: the "std" default-cfg test, features_only, forward_intermediates), the plain ViT is a
``vit_*`` (the "non-std" default-cfg test, forward_intermediates). Each runs with dense attention and
with MoH (activation ratio 0.5: routed heads in every multi-head layer). DiT's forward takes
``(x, t, y)``, so timm's image-classifier tests do not apply to it (see tests/test_timm_models.py).

Not reproduced: the torchscript tests (``test_model_forward_torchscript``, ``..._fx_torchscript``; the
attention registry composes classes at run time and records routing through a context variable, which
TorchScript cannot compile; timm is moving away from TorchScript) and ``test_model_inference`` (hub
weights). ``test_model_load_pretrained`` / ``test_model_features_pretrained`` run with a local weights
file instead of the hub (tests/test_timm_models.py).
"""
import math

import pytest
import timm
import torch
from timm.layers import get_channel_dim, get_spatial_dim
from timm.models import get_notrace_functions, get_notrace_modules

import moh_vision  # noqa: F401  (registers the models)
from moh_vision.models import model_family

try:
    from torchvision.models.feature_extraction import NodePathTracer, create_feature_extractor, get_graph_node_names
    HAS_FX = True
except ImportError:  # pragma: no cover
    HAS_FX = False

# timm's size limits (test_models.py)
TARGET_FWD_SIZE = MAX_FWD_SIZE = 384
TARGET_BWD_SIZE = 128
MAX_BWD_SIZE = 320
MAX_FWD_OUT_SIZE = 448
TARGET_FFEAT_SIZE = 96
MAX_FFEAT_SIZE = 256
TARGET_FWD_FX_SIZE = 128
MAX_FWD_FX_SIZE = 256
TARGET_BWD_FX_SIZE = 128
MAX_BWD_FX_SIZE = 224

ATTENTIONS = {"mha": {}, "moh": dict(activation_ratio=0.5)}
HIERARCHICAL = ["transnext_nano"]  # timm's "std" models (spatial features, features_only)
TOKEN_MODELS = ["plain_vit_nano"]  # timm's NON_STD_FILTERS kind (vit_*)
MODELS = HIERARCHICAL + TOKEN_MODELS


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread avoids thread start-up and spinning (10x faster on a busy 2-core
    machine); the previous setting is restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def create(name, attention, **kwargs):
    """``timm.create_model(name, ...)`` as timm's tests call it, with the attention under test."""
    return timm.create_model(name, attention=attention, **ATTENTIONS[attention], **kwargs)


def get_input_size(model=None, model_name="", target=None):
    """timm's ``_get_input_size``: from the model's cfg, or from the registered pretrained cfg."""
    if model is None:
        cfg = timm.models.get_pretrained_cfg(model_name).to_dict()
    else:
        cfg = model.default_cfg
    input_size = cfg["input_size"]
    if cfg.get("fixed_input_size", None):
        return input_size
    if cfg.get("min_input_size", None):
        if target and max(input_size) > target:
            input_size = cfg["min_input_size"]
    elif target and max(input_size) > target:
        input_size = tuple(min(x, target) for x in input_size)
    return input_size


def check_feature_outputs(outputs, channels, reductions, input_size, batch_size, output_fmt="NCHW"):
    feat_axis, spatial_axis = get_channel_dim(output_fmt), get_spatial_dim(output_fmt)
    assert len(channels) == len(outputs)
    for e, r, o in zip(channels, reductions, outputs):
        assert e == o.shape[feat_axis]
        assert o.shape[spatial_axis[0]] <= math.ceil(input_size[-2] / r) + 1
        assert o.shape[spatial_axis[1]] <= math.ceil(input_size[-1] / r) + 1
        assert o.shape[0] == batch_size
        assert not torch.isnan(o).any()


parametrize_models = pytest.mark.parametrize("attention", list(ATTENTIONS))


# ---------------------------------------------------------------------------------------------
# test_model_forward / test_model_backward
# ---------------------------------------------------------------------------------------------
@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False).eval()
    input_size = get_input_size(model=model, target=TARGET_FWD_SIZE)
    assert max(input_size) <= MAX_FWD_SIZE
    inputs = torch.randn((batch_size, *input_size))
    outputs = model(inputs)
    assert outputs.shape[0] == batch_size
    assert not torch.isnan(outputs).any(), "Output included NaNs"
    # grad checkpointing is supported (timm only skips models that raise) and changes nothing
    model.set_grad_checkpointing()
    outputs2 = model(inputs)
    assert torch.allclose(outputs, outputs2, rtol=1e-4, atol=1e-5), "Output does not match"


@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)
def test_model_backward(model_name, attention, batch_size=2):
    assert model_name in timm.list_models(name_matches_cfg=True)  # timm only tests models with a cfg
    input_size = get_input_size(model_name=model_name, target=TARGET_BWD_SIZE)
    assert max(input_size) <= MAX_BWD_SIZE
    model = create(model_name, attention, pretrained=False, num_classes=42)
    encoder_only = model.num_classes == 0
    num_params = sum(x.numel() for x in model.parameters())
    model.train()
    outputs = model(torch.randn((batch_size, *input_size)))
    outputs.mean().backward()
    for n, x in model.named_parameters():
        assert x.grad is not None, f"No gradient for {n}"
    num_grad = sum(x.grad.numel() for x in model.parameters() if x.grad is not None)
    assert not encoder_only and outputs.shape[-1] == 42
    assert num_params == num_grad, "Some parameters are missing gradients"
    assert not torch.isnan(outputs).any(), "Output included NaNs"


# ---------------------------------------------------------------------------------------------
# test_model_default_cfgs (hierarchical) / test_model_default_cfgs_non_std (ViT)
# ---------------------------------------------------------------------------------------------
def check_names_in_state_dict(cfg, state_dict):
    if cfg.get("num_classes", None):
        classifier = cfg["classifier"]
        for c in (classifier,) if not isinstance(classifier, (tuple, list)) else classifier:
            assert c + ".weight" in state_dict.keys(), f"{c} not in model params"
    first_conv = cfg["first_conv"]
    first_conv = (first_conv,) if isinstance(first_conv, str) else first_conv
    assert isinstance(first_conv, (tuple, list))
    for fc in first_conv:
        assert fc + ".weight" in state_dict.keys(), f"{fc} not in model params"


@parametrize_models
@pytest.mark.parametrize("model_name", HIERARCHICAL)
def test_model_default_cfgs(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False).eval()
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    state_dict = model.state_dict()
    cfg = model.default_cfg
    pool_size, input_size = cfg["pool_size"], cfg["input_size"]
    output_fmt = getattr(model, "output_fmt", "NCHW")
    spatial_axis, feat_axis = get_spatial_dim(output_fmt), get_channel_dim(output_fmt)
    assert len(spatial_axis) == 2
    assert all(x <= MAX_FWD_OUT_SIZE for x in input_size)
    input_tensor = torch.randn((batch_size, *input_size))

    # forward_features (always unpooled) and forward_head with pre_logits
    outputs = model.forward_features(input_tensor)
    outputs_pre = model.forward_head(outputs, pre_logits=True)
    assert outputs.shape[spatial_axis[0]] == pool_size[0], f"unpooled feature shape {outputs.shape} != config"
    assert outputs.shape[spatial_axis[1]] == pool_size[1], f"unpooled feature shape {outputs.shape} != config"
    assert outputs.shape[feat_axis] == model.num_features
    assert outputs_pre.shape[1] == model.head_hidden_size

    # classifier removed: pooled features
    model.reset_classifier(0)
    assert model.num_classes == 0
    outputs = model.forward(input_tensor)
    assert len(outputs.shape) == 2
    assert outputs.shape[1] == model.head_hidden_size
    assert outputs.shape == outputs_pre.shape

    # classifier and pooling removed
    model.reset_classifier(0, "")
    outputs = model.forward(input_tensor)
    assert len(outputs.shape) == 4
    assert outputs.shape[spatial_axis[0]] == pool_size[0] and outputs.shape[spatial_axis[1]] == pool_size[1]

    # the same through __init__
    model = create(model_name, attention, pretrained=False, num_classes=0, global_pool="").eval()
    outputs = model.forward(input_tensor)
    assert len(outputs.shape) == 4
    assert outputs.shape[spatial_axis[0]] == pool_size[0] and outputs.shape[spatial_axis[1]] == pool_size[1]

    check_names_in_state_dict(cfg, state_dict)


@parametrize_models
@pytest.mark.parametrize("model_name", TOKEN_MODELS)
def test_model_default_cfgs_non_std(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False).eval()
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    state_dict = model.state_dict()
    cfg = model.default_cfg
    input_size = get_input_size(model=model)
    assert max(input_size) <= 320
    input_tensor = torch.randn((batch_size, *input_size))
    feat_dim = getattr(model, "feature_dim", None)

    outputs = model.forward_features(input_tensor)
    outputs_pre = model.forward_head(outputs, pre_logits=True)
    if feat_dim is None:
        feat_dim = -1 if outputs.ndim == 3 else 1
    assert outputs.shape[feat_dim] == model.num_features
    assert outputs_pre.shape[1] == model.head_hidden_size

    model.reset_classifier(0)
    assert model.num_classes == 0
    outputs = model.forward(input_tensor)
    feat_dim = -1 if outputs.ndim == 3 else 1
    assert outputs.shape[feat_dim] == model.head_hidden_size, "pooled num_features != config"
    assert outputs.shape == outputs_pre.shape

    model = create(model_name, attention, pretrained=False, num_classes=0).eval()
    outputs = model.forward(input_tensor)
    feat_dim = -1 if outputs.ndim == 3 else 1
    assert outputs.shape[feat_dim] == model.num_features

    check_names_in_state_dict(cfg, state_dict)


# ---------------------------------------------------------------------------------------------
# test_model_forward_features / ..._intermediates_features / ..._intermediates
# ---------------------------------------------------------------------------------------------
def check_features_only(model, batch_size: int) -> None:
    """timm's checks of a ``features_only`` model: input size within bounds, one map per feature_info
    entry with its channels and reduction."""
    channels, reductions = model.feature_info.channels(), model.feature_info.reduction()
    input_size = get_input_size(model=model, target=TARGET_FFEAT_SIZE)
    assert max(input_size) <= MAX_FFEAT_SIZE
    output_fmt = getattr(model, "output_fmt", "NCHW")
    outputs = model(torch.randn((batch_size, *input_size)))
    check_feature_outputs(outputs, channels, reductions, input_size, batch_size, output_fmt)


@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)  # timm skips vit_* here; issue 16 asks features_only of the ViT too
def test_model_forward_features(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False, features_only=True).eval()
    assert len(model.feature_info.channels()) >= 3
    check_features_only(model, batch_size)


@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_intermediates_features(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False, features_only=True, feature_cls="getter").eval()
    check_features_only(model, batch_size)


@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_intermediates(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False).eval()
    feature_info = timm.models.FeatureInfo(model.feature_info, len(model.feature_info))
    channels, reductions = feature_info.channels(), feature_info.reduction()
    assert len(channels) >= 3
    input_size = get_input_size(model=model, target=TARGET_FFEAT_SIZE)
    assert max(input_size) <= MAX_FFEAT_SIZE
    inpt = torch.randn((batch_size, *input_size))
    output, intermediates = model.forward_intermediates(inpt, output_fmt="NCHW")
    check_feature_outputs(intermediates, channels, reductions, input_size, batch_size, "NCHW")
    assert torch.allclose(output, model.forward_features(inpt))
    model.set_grad_checkpointing()
    output3, _ = model.forward_intermediates(inpt, output_fmt="NCHW")
    assert torch.allclose(output, output3, rtol=1e-4, atol=1e-5), "Output does not match"


# ---------------------------------------------------------------------------------------------
# test_model_forward_fx / test_model_backward_fx
# ---------------------------------------------------------------------------------------------
def create_fx_model(model, train=False):
    """timm's ``_create_fx_model``: trace with timm's leaf modules / autowrapped functions and return
    the node(s) feeding the output."""
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                         param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    eval_return_nodes, train_return_nodes = [eval_nodes[-1]], [train_nodes[-1]]
    if train:
        graph = NodePathTracer(**tracer_kwargs).trace(model)
        graph_nodes = list(reversed(graph.nodes))
        output_node_names = [n.name for n in graph_nodes[0]._input_nodes.keys()]
        graph_node_names = [n.name for n in graph_nodes]
        train_return_nodes = [train_nodes[-graph_node_names.index(name)] for name in output_node_names]
    return create_feature_extractor(model, train_return_nodes=train_return_nodes,
                                    eval_return_nodes=eval_return_nodes, tracer_kwargs=tracer_kwargs)


@pytest.mark.skipif(not HAS_FX, reason="torchvision feature extraction needed")
@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_fx(model_name, attention, batch_size=1):
    model = create(model_name, attention, pretrained=False).eval()
    input_size = get_input_size(model=model, target=TARGET_FWD_FX_SIZE)
    assert max(input_size) <= MAX_FWD_FX_SIZE
    with torch.inference_mode():
        inputs = torch.randn((batch_size, *input_size))
        outputs = model(inputs)
        fx_outputs = torch.cat(tuple(create_fx_model(model)(inputs).values()))
    assert torch.all(fx_outputs == outputs)
    assert outputs.shape[0] == batch_size
    assert not torch.isnan(outputs).any(), "Output included NaNs"


@pytest.mark.skipif(not HAS_FX, reason="torchvision feature extraction needed")
@parametrize_models
@pytest.mark.parametrize("model_name", MODELS)
def test_model_backward_fx(model_name, attention, batch_size=2):
    input_size = get_input_size(model_name=model_name, target=TARGET_BWD_FX_SIZE)
    assert max(input_size) <= MAX_BWD_FX_SIZE
    model = create(model_name, attention, pretrained=False, num_classes=42).train()
    num_params = sum(x.numel() for x in model.parameters())
    model = create_fx_model(model, train=True)
    outputs = torch.cat(tuple(model(torch.randn((batch_size, *input_size))).values()))
    outputs.mean().backward()
    for n, x in model.named_parameters():
        assert x.grad is not None, f"No gradient for {n}"
    num_grad = sum(x.grad.numel() for x in model.parameters() if x.grad is not None)
    assert outputs.shape[-1] == 42
    assert num_params == num_grad, "Some parameters are missing gradients"
    assert not torch.isnan(outputs).any(), "Output included NaNs"


def test_the_families_under_test_are_the_image_classifiers():
    assert {model_family(n) for n in HIERARCHICAL} == {"transnext"}
    assert {model_family(n) for n in TOKEN_MODELS} == {"vit"}
