"""tools/analyze_routing.py on a small trained checkpoint, and the plots it draws."""
import json
import math

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import moh_vision  # noqa: F401
from moh_vision.analysis import routing_plots
from moh_vision.attention import routed_modules
from moh_vision.errors import ConfigError

from conftest import entry_in_process
from helpers import ATTENTION_PRESET, FAST_TRAIN, load_tool as load, model_config
from moh_vision.analysis.routing_analysis import analyse, layer_statistics, write_outputs
from moh_vision.apps.analyze_routing import task_forward

PNGS = ("head_load.png", "gate_mass.png", "router_entropy.png", "head_utility.png")


def load_tool():
    return load("analyze_routing")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default run (MoH TransNeXt-nano on the digits), shrunk to 3 steps."""
    out = tmp_path_factory.mktemp("routing_run")
    with pytest.MonkeyPatch.context() as patch:
        code, _ = entry_in_process("train.py", patch)(*FAST_TRAIN, f"hydra.run.dir={out}")
    assert code == 0
    return out


@pytest.fixture(scope="module")
def analysed(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    result = load_tool().main([f"ckpt={trained / 'checkpoints' / 'last.pt'}", "num_images=6", "map_images=2",
                               "batch_size=4", f"out={out}", "logger=none"])
    return out, result


def test_writes_every_figure_and_the_numbers(analysed):
    out, result = analysed
    for name in PNGS + ("token_heads_0.png", "token_heads_1.png"):
        with Image.open(out / name) as image:
            assert image.size[0] > 100 and image.size[1] > 100, name
    assert not (out / "token_heads_2.png").exists()
    saved = json.loads((out / "routing_analysis.json").read_text())
    assert saved["num_images"] == 6 and saved["model"] == "transnext_nano" and saved["task"] == "classification"
    assert set(saved["files"].values()) >= set(PNGS) | {"selection.npz"}


def test_per_layer_loads_sum_to_the_active_heads(analysed):
    """Every token uses its shared heads plus exactly top-k routed heads."""
    out, result = analysed
    model = timm.create_model("transnext_nano", attention="moh", activation_ratio=0.75, in_chans=1)
    expected = {name: (m.shared_heads, m.topk, m.num_heads) for name, m in routed_modules(model)}
    assert list(result["layers"]) == list(expected)
    arrays = np.load(out / "selection.npz")
    for name, layer in result["layers"].items():
        shared, topk, heads = expected[name]
        assert (layer["shared_heads"], layer["topk"], layer["num_heads"]) == (shared, topk, heads)
        assert len(layer["load"]) == heads and layer["load"][:shared] == [1.0] * shared
        assert sum(layer["load"]) == pytest.approx(shared + topk, abs=1e-5)
        assert layer["active_heads_per_token"] == pytest.approx(shared + topk, abs=1e-5)
        assert all(0.0 <= v <= 1.0 for v in layer["load"])
        selection = arrays[f"selection/{name}"]
        H, W = layer["grid"]
        assert selection.shape == (2, H * W, heads) and selection.dtype == bool
        assert (selection.sum(-1) == shared + topk).all()
        assert arrays[f"gates/{name}"].shape == selection.shape
        if topk:
            assert 0.0 < layer["entropy"] <= layer["max_entropy"] + 1e-6
            ranked = [u["selected"] for u in layer["utility"]]
            assert ranked == sorted(ranked, reverse=True) and len(ranked) == heads - shared
            assert sum(u["selected_share"] for u in layer["utility"]) == pytest.approx(1.0)
        else:
            assert layer["entropy"] is None and layer["utility"] == []


def test_token_grids_follow_the_transnext_stages(analysed):
    _, result = analysed
    grids = {name.split(".")[0]: layer["grid"] for name, layer in result["layers"].items()}
    assert grids == {"block1": [8, 8], "block2": [4, 4], "block3": [2, 2], "block4": [1, 1]}  # 32 px / 4, 8, 16, 32
    assert all(layer["prefix_tokens"] == 0 for layer in result["layers"].values())


def test_trainer_routing_json_feeds_the_plots(trained, tmp_path):
    """The plots take the per-epoch format the trainer dumps (RoutingMeter.averages)."""
    epochs = json.loads((trained / "routing.json").read_text())
    stats = epochs[sorted(epochs, key=int)[-1]]
    for fn, name in ((routing_plots.plot_head_load, "load.png"), (routing_plots.plot_router_entropy, "ent.png"),
                     (routing_plots.plot_head_utility, "util.png")):
        assert fn(stats, tmp_path / name).is_file()


def test_dit_and_vit_grids_and_moa(tmp_path):
    """In-process on fresh models: DiT (noised input at a timestep, patch grid) and ViT with MoA
    (class token dropped from the maps; MoA loads sum to top-k experts)."""
    from moh_vision.tasks.diffusion import DiffusionTask

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    batch = [(torch.randn(3, 1, 16, 16), torch.tensor([1, 2, 3]))]

    task = DiffusionTask(model=model_config("dit_tiny_2"), attention=ATTENTION_PRESET)
    dit = timm.create_model("dit_tiny_2", attention="moh", shared_heads=1, topk=2)
    sums, maps, images, seen = analyse(dit, batch, task_forward(task, dit, cpu, timestep=100), 3, 1)
    stats = layer_statistics(dit, sums)
    assert seen == 3 and len(images) == 1 and len(stats) == 6
    for layer in stats.values():
        assert layer["grid"] == [8, 8] and layer["prefix_tokens"] == 0
        assert sum(layer["load"]) == pytest.approx(3.0)
    files = write_outputs(tmp_path / "dit", stats, maps, images, max_map_layers=3)
    assert (tmp_path / "dit" / files["token_heads_0"]).is_file()
    assert np.load(tmp_path / "dit" / "selection.npz")["selection/blocks.0.attn"].shape == (1, 64, 4)

    class Classify:
        name = "classification"

    vit = timm.create_model("plain_vit_nano", attention="moa", topk=2, in_chans=1)
    sums, maps, images, _ = analyse(vit, [(torch.randn(2, 1, 32, 32), torch.tensor([0, 1]))],
                                    task_forward(Classify(), vit, cpu), 2, 1)
    stats = layer_statistics(vit, sums)
    for layer in stats.values():
        assert layer["grid"] == [8, 8] and layer["prefix_tokens"] == 1  # 65 tokens = class token + 8x8
        assert layer["shared_heads"] == 0 and sum(layer["load"]) == pytest.approx(2.0)
        assert layer["entropy"] == pytest.approx(math.log(4), abs=1e-5)  # MoA's router starts uniform
    write_outputs(tmp_path / "vit", stats, maps, images, max_map_layers=2)
    assert (tmp_path / "vit" / "token_heads_0.png").is_file()
    # the analysis leaves nothing on the modules: no tensors of its forwards, no flags, no patched methods
    fresh = timm.create_model("plain_vit_nano", attention="moa", topk=2, in_chans=1)
    for model, reference in ((vit, fresh), (dit, timm.create_model("dit_tiny_2", attention="moh", shared_heads=1,
                                                                    topk=2))):
        for (name, m), (_, ref) in zip(routed_modules(model), routed_modules(reference)):
            assert not [k for k, v in vars(m).items() if isinstance(v, torch.Tensor)], name
            assert set(vars(m)) == set(vars(ref)), (name, set(vars(m)) ^ set(vars(ref)))
            assert m._forward_hooks == m._forward_pre_hooks == {}, name


def test_wandb_logging_path(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    result = load_tool().main([f"ckpt={trained / 'checkpoints' / 'last.pt'}", "num_images=2", "map_images=1",
                               f"out={tmp_path}", "logger=wandb", "data.val_fraction=0.1"])  # data overrides too
    assert result["wandb_run_id"] is not None and (tmp_path / "head_load.png").is_file()
    assert result["num_images"] == 2 and "/ 179 val images" in result["data"]  # val_fraction=0.1 of 1797, stratified


def test_user_errors(trained, tmp_path, capsys):
    for argv, message in ((["num_images=2"], "ckpt= is required"), (["ckpt=x", "bogus=1"], "unknown option 'bogus'"),
                          ([f"ckpt={tmp_path / 'missing.pt'}"], "does not exist"),
                          (["ckpt=x", "weights=best"], "weights=best: use one of model, ema")):
        with pytest.raises(SystemExit) as exited:
            load_tool().main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and message in err[0], (argv, err)
    mha = timm.create_model("plain_vit_nano", attention="mha")
    with pytest.raises(ConfigError, match="no routed attention"):
        analyse(mha, [], None, 1, 0)
