"""eval.py on released weights (``model=<preset> pretrained=<file | hub id | true>``), checked against timm's
``validate.py`` conventions on the same folder and weights: timm's own dataset reader, ``resolve_data_config`` and
``create_transform`` from the model's pretrained cfg, timm's checkpoint loader and ``accuracy``."""
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from moh_vision.config import compose, validate
from moh_vision.apps import released
from moh_vision.engine.distributed import DistInfo

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = [f"class_{i}" for i in range(10)]  # transnext_nano's 10 classes; natural and plain sort agree
# A pretrained cfg unlike the data config's defaults (224, crop 0.875, ImageNet statistics): eval.py must take this
CFG_OVERLAY = {"crop_pct": 0.8, "interpolation": "bicubic"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An ImageFolder (train/ and val/, 10 classes) of small images of several sizes and aspect ratios, a colour
    per class plus noise, so that the crop and resize change what the model sees."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    sizes = [(40, 52), (36, 36), (60, 45)]
    for split, per_class in (("train", 1), ("val", 3)):
        for c, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                h, w = sizes[i % len(sizes)]
                base = np.array([25 * c, 255 - 20 * c, 120 + 10 * (c % 3)], dtype=np.float64)
                ramp = np.linspace(-60, 60, w)[None, :, None] * (1 if i % 2 else -1)
                pixels = np.clip(base + ramp + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def official_weights(tmp_path_factory):
    """transnext_nano's weights as TransNeXt releases them: a plain state dict in a .pth file."""
    torch.manual_seed(0)
    model = timm.create_model("transnext_nano")
    path = tmp_path_factory.mktemp("weights") / "transnext_nano_official.pth"
    torch.save(model.state_dict(), path)
    return path


def timm_validate(folder, weights, overlay=CFG_OVERLAY):
    """top-1, top-5 and mean cross-entropy as timm's validate.py computes them (no prefetcher, fp32)."""
    from timm.data import create_dataset, create_transform, resolve_data_config
    from timm.models import load_checkpoint
    from timm.utils import accuracy

    model = timm.create_model("transnext_nano", num_classes=len(CLASSES), pretrained_cfg_overlay=overlay)
    load_checkpoint(model, str(weights))
    model.eval()
    config = resolve_data_config({}, model=model, use_test_size=True)
    dataset = create_dataset("", root=str(folder), split="validation")
    dataset.transform = create_transform(**config)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    hits1 = hits5 = loss = count = 0.0
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            top1, top5 = accuracy(logits, y, topk=(1, 5))  # percentages of this batch, in float32
            hits1, hits5 = hits1 + round(top1.item() * len(y) / 100), hits5 + round(top5.item() * len(y) / 100)
            loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            count += len(y)
    return {"acc1": 100 * hits1 / count, "acc5": 100 * hits5 / count, "loss": loss / count, "count": count}


def eval_words(folder, weights, out):
    return ("model=transnext_nano", f"pretrained={weights}", "data=imagefolder", f"data.root={folder}",
            "+model.kwargs.pretrained_cfg_overlay={crop_pct: 0.8, interpolation: bicubic}", "eval.batch_size=4",
            "eval.num_workers=0", "eval.device=cpu", f"hydra.run.dir={out}")


def test_top1_equals_timms_validate_on_the_same_folder_and_weights(folder, official_weights, tmp_path,
                                                                   eval_in_process):
    code, err = eval_in_process(*eval_words(folder, official_weights, tmp_path / "eval"))
    assert code == 0, err
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    expected = timm_validate(folder, official_weights)
    assert summary["val/count"] == expected["count"] == 30
    assert summary["val/acc1"] == pytest.approx(expected["acc1"], abs=1e-9)
    assert summary["val/acc5"] == pytest.approx(expected["acc5"], abs=1e-9)
    assert summary["val/loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert summary["eval_transform"] == {"input_size": [3, 32, 32], "interpolation": "bicubic", "mean": [0.5] * 3,
                                         "std": [0.5] * 3, "crop_pct": 0.8, "crop_mode": "center"}
    # the check can fail: the registered cfg's crop (1.0) and bilinear resize give other numbers
    other = timm_validate(folder, official_weights, overlay={})
    assert abs(other["loss"] - summary["val/loss"]) > 1e-4


def test_ranks_split_the_images_and_their_sums_add_up(folder, official_weights, tmp_path, monkeypatch):
    """Under torchrun each rank takes every WORLD_SIZE-th image; the all-reduced sums are the single process's."""
    cfg = compose("eval", list(eval_words(folder, official_weights, tmp_path))[:-1])
    options = validate(cfg)
    per_rank = []
    monkeypatch.setattr(released, "reduce_sums", lambda sums, dist, device: per_rank.append(sums) or dict(sums))
    for rank in (0, 1):
        monkeypatch.setattr(released, "init_distributed", lambda device, rank=rank: DistInfo(rank=rank, world_size=2))
        released.evaluate_released(cfg, tmp_path / f"rank{rank}", options)
    monkeypatch.setattr(released, "init_distributed", lambda device: DistInfo())
    single = released.evaluate_released(cfg, tmp_path / "single", options)
    assert [sums["count"] for sums in per_rank] == [15, 15, 30]
    for key in ("acc1", "acc5", "count"):
        assert per_rank[0][key] + per_rank[1][key] == per_rank[2][key]
    assert per_rank[0]["loss"] + per_rank[1]["loss"] == pytest.approx(per_rank[2]["loss"], rel=1e-6)
    assert single["val/count"] == 30 and not (tmp_path / "rank1" / "summary.json").exists()  # rank 0 writes


def test_released_weights_that_do_not_fit_or_cannot_be_found_are_one_error_line(folder, tmp_path, monkeypatch,
                                                                                 eval_in_process):
    torch.save(timm.create_model("transnext_nano", num_classes=5).state_dict(), tmp_path / "five_classes.pth")
    code, err = eval_in_process(*eval_words(folder, tmp_path / "five_classes.pth", tmp_path / "a"))
    assert code == 2 and "does not fit the model as built" in err and "the data have 10 classes" in err
    # a hub id goes through the hub cache (moh_vision.models.hub): offline and not cached, nothing is fetched
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, err = eval_in_process(*eval_words(folder, "SomeLab/transnext-nano", tmp_path / "b"))
    assert code == 2 and "SomeLab/transnext-nano" in err and "HF_HUB_OFFLINE is set" in err
    code, err = eval_in_process(*eval_words(folder, tmp_path / "missing.pth", tmp_path / "c"))
    assert code == 2 and "missing.pth does not exist" in err
    code, err = eval_in_process("model=transnext_nano", f"data.root={folder}", f"hydra.run.dir={tmp_path / 'd'}",
                                "data=imagefolder")
    assert code == 2 and "ckpt is required" in err and "pretrained=" in err
    code, err = eval_in_process(*eval_words(folder, tmp_path / "five_classes.pth", tmp_path / "e")[:2],
                                f"hydra.run.dir={tmp_path / 'e'}")
    assert code == 2 and "need data to evaluate on" in err
