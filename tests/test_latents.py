"""Latent diffusion data: extraction into shards with a tiny local VAE, the LatentsData contract,
resuming, the error messages, and train.py on the latents end to end."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import ATTENTION_PRESET, load_tool, model_config, read_summary
from moh_vision.data.extract_latents import Extraction, extract_latents
from moh_vision.data.latents import SCALE_FACTOR, LatentsData, center_crop_arr, load_shard, load_vae
from moh_vision.data.sampler import SeededItems
from moh_vision.errors import ConfigError

IMAGE_SIZE, CLASSES, PER_CLASS = 16, 3, 4  # the tiny VAE halves: 16 px -> 8x8x4 latents


def make_tiny_vae(path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=IMAGE_SIZE)
    vae.save_pretrained(path)
    return path


def make_image_tree(root):
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        folder = root / "train" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(PER_CLASS):  # odd sizes and aspect ratios exercise the center crop
            arr = rng.integers(0, 256, (IMAGE_SIZE + 3 * i, IMAGE_SIZE + 5 + c, 3), dtype=np.uint8)
            Image.fromarray(arr).save(folder / f"img{i}.png")
    (root / "train" / "class1" / "broken.jpg").write_bytes(b"not an image")
    return root


def extract(data, vae, out, *extra):
    args = [f"data={data}", f"vae={vae}", f"out={out}", f"image_size={IMAGE_SIZE}", "shard_size=5", "batch_size=3",
            "num_workers=0", "progress=false", *extra]
    return load_tool("extract_latents").main(args)


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    root = tmp_path_factory.mktemp("latents")
    vae, data = make_tiny_vae(root / "vae"), make_image_tree(root / "images")
    assert extract(data, vae, root / "out") == 0
    return {"vae": vae, "data": data, "out": root / "out"}


def test_center_crop_matches_adm():
    img = Image.fromarray(np.arange(100 * 60 * 3, dtype=np.uint32).reshape(100, 60, 3).astype(np.uint8))
    assert center_crop_arr(img, 16).shape == (16, 16, 3)  # 60x100 -> box-halved to 30x50 -> 16x27 -> crop
    square = Image.new("RGB", (16, 16), (10, 20, 30))
    assert (center_crop_arr(square, 16) == np.array([10, 20, 30])).all()


def test_index_and_shards_hold_the_encoder_distribution(latents):
    out = latents["out"]
    index = json.loads((out / "index.json").read_text())
    assert index["num_images"] == CLASSES * PER_CLASS and index["num_classes"] == CLASSES
    assert index["class_names"] == ["class0", "class1", "class2"] and index["skipped"] == ["class1/broken.jpg"]
    assert (index["latent_size"], index["latent_channels"], index["image_size"]) == (8, 4, IMAGE_SIZE)
    assert index["scale_factor"] == pytest.approx(SCALE_FACTOR) and index["flip"] is True
    # 13 sorted files (class1/broken.jpg is the 5th) in shards of 5; the unreadable one is left out.
    assert [s["count"] for s in index["shards"]] == [4, 5, 3]
    shard = load_shard(out / "shard_00000.pt")
    moments = shard["moments"]
    assert moments.dtype == torch.float16 and moments.shape == (4, 2, 2, 4, 8, 8)  # [n, flip, (mean, std), C, h, w]
    assert bool((moments[:, :, 1] > 0).all()), "std is stored, positive"
    assert not torch.equal(moments[:, 0], moments[:, 1]), "the flipped copy is encoded separately"
    assert shard["labels"].tolist() == [0, 0, 0, 0] and shard["source_index"].tolist() == [0, 1, 2, 3]
    assert load_shard(out / "shard_00001.pt")["source_index"].tolist() == [5, 6, 7, 8, 9]
    # The stored mean is what the VAE gives for the ADM-cropped image.
    vae = load_vae(latents["vae"])
    img = center_crop_arr(Image.open(latents["data"] / "train" / "class0" / "img2.png").convert("RGB"), IMAGE_SIZE)
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
    assert torch.allclose(moments[2, 0, 0].float(), dist.mean[0], atol=2e-3)
    assert torch.allclose(moments[2, 0, 1].float(), dist.std[0], rtol=2e-3)


def test_latents_data_contract_and_seeded_draws(latents):
    data = LatentsData(str(latents["out"]), val_size=4)
    assert (data.img_size, data.in_chans, data.num_classes) == (8, 4, CLASSES)
    assert (data.collate_fn, data.mixup, data.repeated_aug, data.label_smoothing) == (None, None, 1, 0.0)
    assert len(data.train) == 12 and len(data.val) == 4 and "8x8x4" in data.describe()
    x, y = data.train[7]
    assert x.shape == (4, 8, 8) and x.dtype == torch.float32 and y == 1
    # A draw is mean + std * eps of one of the two copies, times 0.18215.
    moments = load_shard(latents["out"] / "shard_00001.pt")["moments"][3].float()  # image 7 = shard 1, row 3
    z = x / SCALE_FACTOR
    assert min(((z - moments[f, 0]) / moments[f, 1]).abs().max() for f in (0, 1)) < 6
    # The trainer's per-item seeding makes the draws reproducible, and fresh each epoch.
    items = SeededItems(data.train, seed=3)
    first = items[7][0]
    assert torch.equal(first, items[7][0])
    items.epoch = 1
    assert not torch.equal(first, items[7][0])
    # Validation items are fixed and leave the global RNG alone.
    state = torch.get_rng_state()
    assert torch.equal(data.val[1][0], data.val[1][0]) and torch.equal(state, torch.get_rng_state())
    held = LatentsData(str(latents["out"]), val_size=4, val_holdout=True)
    assert len(held.train) == 8 and not set(held.train.items) & set(held.val.items)
    means = LatentsData(str(latents["out"]), sample_posterior=False, flip=False)
    assert torch.allclose(means.train[7][0], moments[0, 0] * SCALE_FACTOR)


def test_extraction_resumes_and_refuses_mixed_settings(latents, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(latents["out"], out)
    (out / "index.json").unlink()
    (out / "shard_00001.pt").unlink()
    with pytest.raises(ConfigError, match="unfinished"):
        LatentsData(str(out))
    kept = os.stat(out / "shard_00000.pt").st_mtime_ns
    assert extract(latents["data"], latents["vae"], out) == 0
    assert os.stat(out / "shard_00000.pt").st_mtime_ns == kept, "finished shards are not redone"
    assert torch.equal(load_shard(out / "shard_00001.pt")["moments"],
                       load_shard(latents["out"] / "shard_00001.pt")["moments"])
    assert json.loads((out / "index.json").read_text()) == json.loads((latents["out"] / "index.json").read_text())
    with pytest.raises(ConfigError, match="other settings"):
        extract_latents(Extraction(str(latents["data"]), str(latents["vae"]), str(out), image_size=32, shard_size=5,
                                   num_workers=0, progress=False), torch.device("cpu"))


def test_missing_latents_and_vae_fail_with_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="does not exist.*extract_latents"):
        LatentsData(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="holds no latents"):
        LatentsData(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist; expected a local diffusers AutoencoderKL"):
        load_vae(tmp_path / "no_vae")
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ConfigError, match="holds a UNet2DModel model, not an AutoencoderKL"):
        load_vae(tmp_path / "unet")
    with pytest.raises(SystemExit) as exited:
        extract(tmp_path, tmp_path / "no_vae", tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1].startswith("error: VAE path") and "nothing is downloaded" in err[-1]


def test_train_diffusion_on_latents_end_to_end(latents, tmp_path, train_in_process):
    # one config choice sets what latent diffusion needs; the VAE comes from the latents' index
    assert train_in_process(
        "experiment=latent_diffusion", f"data.root={latents['out']}", "data.val_size=4", "model=dit_tiny_2",
        "task.sample.steps=2", "task.sample.per_class=1", "trainer.epochs=1", "trainer.max_steps=2",
        "trainer.batch_size=4", "trainer.progress=false", "trainer.count_flops=false", f"hydra.run.dir={tmp_path}")[0] == 0
    summary = read_summary(tmp_path)
    assert summary["steps"] == 2 and summary["model"] == "dit_tiny_2" and summary["val/count"] == 4
    assert np.isfinite(summary["val/loss"]) and np.isfinite(summary["val_ema/loss"])
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["model"]["x_embedder.proj.weight"].shape[1] == 4, "the model sees 4 latent channels"
    assert state["config"]["data"]["name"] == "latents"
    grid = Image.open(tmp_path / "samples" / "epoch_0000.png")
    assert grid.mode == "RGB" and grid.height >= CLASSES * IMAGE_SIZE, "the grid holds decoded RGB images"


def test_latents_without_the_diffusion_task_is_a_one_line_error(latents):
    from moh_vision.tasks.classification import ClassificationTask
    data = LatentsData(str(latents["out"]), val_size=4)
    with pytest.raises(ConfigError, match="task=diffusion.*experiment=latent_diffusion"):
        ClassificationTask(model=model_config("transnext_nano"), attention=ATTENTION_PRESET).build_model(data)


OFFICIAL_STEPS = {**{f"moh_dit_{s}_2_{r}": 400_000 for s in "sbl" for r in (90, 75)},
                  "moh_dit_xl_2_90": 7_000_000, "moh_dit_xl_2_75": 2_000_000,
                  "dit_s_2": 400_000, "dit_b_2": 400_000, "dit_l_2": 400_000, "dit_xl_2": 7_000_000}


@pytest.mark.parametrize("name,steps", sorted(OFFICIAL_STEPS.items()))
def test_imagenet_experiments_compose_the_official_recipe(name, steps):
    from hydra import compose, initialize_config_dir

    from helpers import REPO

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={name}", "data.root=/latents"])
    assert cfg.model.name == name and cfg.attention.name == (None if name.startswith("moh") else "mha")
    assert cfg.task.name == "diffusion" and cfg.data.name == "latents"
    recipe = (cfg.trainer.batch_size, cfg.optim.lr, cfg.optim.weight_decay, cfg.sched.name, cfg.trainer.clip_grad)
    assert recipe == (256, 1e-4, 0.0, "constant", 0.0)
    assert cfg.trainer.ema.enabled and cfg.trainer.ema.decay == 0.9999 and cfg.trainer.max_steps == steps
    assert cfg.trainer.epochs * (1_281_167 // 256) >= steps
    sample = cfg.task.sample
    assert (sample.steps, sample.sampler, sample.cfg_scale, sample.guidance_channels) == ("250", "ddpm", 1.5, 3)
    assert sample.clip_denoised is False
    assert cfg.task.vae.path is None  # given on the command line, or taken from the latents' index
