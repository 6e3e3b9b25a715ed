"""tools/sample.py: class-conditional sampling from a trainer checkpoint or released weights, DiT's random labels,
the ADM .npz, guidance, rank sharding, ADM's metrics and the digits proxy metrics."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import REPO, load_tool, run_entry
from moh_vision.analysis.metrics import DigitsClassifier
from moh_vision.cli import parse_options
from moh_vision.engine import sampling as sampler
from moh_vision.engine.distributed import DistInfo
from moh_vision.errors import ConfigError

NUM_CLASSES = 10


def compose_config(name, overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint as the trainer writes it (model, model_ema, config) for the digits diffusion default,
    with random weights in place of training (DiT's zero-init output would make guidance a no-op)."""
    from moh_vision.config import build_data, build_task

    run = tmp_path_factory.mktemp("digits_run")
    cfg = compose_config("train", ["experiment=diffusion"])
    config = OmegaConf.to_container(cfg, resolve=True)
    data = build_data(config["data"])
    task = build_task(config["task"], model=config["model"], attention=config["attention"])
    torch.manual_seed(0)
    model = task.build_model(data)
    weights = {}
    for name in ("model", "model_ema"):
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
        weights[name] = {k: v.clone() for k, v in model.state_dict().items()}
    path = run / "checkpoints" / "last.pt"
    path.parent.mkdir()
    torch.save({**weights, "config": config, "step": 7, "epoch": 0}, path)
    # The proxy-metric classifier the training run would have left (avoids training one here).
    torch.manual_seed(1)
    torch.save({"model": DigitsClassifier().state_dict(), "img_size": 16}, run / "digits_classifier.pt")
    return path


def options(*words):
    return parse_options(words, load_tool("sample").OPTIONS)[0]  # ckpt= (or model= pretrained=) first


def sampling(ckpt, *overrides):
    cfg = options(f"ckpt={ckpt}", "progress=false", *overrides)
    task, model, data, info = sampler.load_model(cfg, torch.device("cpu"))
    return cfg, task, model, data, info


def test_cli_writes_adm_npz_grid_labels_and_digits_metrics(checkpoint, tmp_path):
    run_entry("tools/sample.py", f"ckpt={checkpoint}", "num_samples=23", "steps=3", "cfg_scale=2", "batch_size=8",
              f"out={tmp_path}", "progress=false")
    with np.load(tmp_path / "samples.npz") as npz:
        assert npz.files == ["arr_0"]
        arr = npz["arr_0"]
    assert arr.dtype == np.uint8 and arr.shape == (23, 16, 16, 3)  # grayscale digits repeated to RGB
    assert (arr[..., 0] == arr[..., 2]).all() and arr.std() > 0
    labels = np.load(tmp_path / "labels.npy")  # DiT's: drawn at random per batch of 8
    assert labels.tolist() == sampler.random_labels(23, NUM_CLASSES, 8, seed=0).tolist()
    assert (tmp_path / "samples.png").is_file() and not list(tmp_path.glob(".parts-*"))
    info = json.loads((tmp_path / "sample.json").read_text())
    assert info["weights"] == "model_ema" and info["step"] == 7 and info["model"] == "dit_tiny_2"
    assert (info["cfg_scale"], info["steps"], info["sampler"], info["num_samples"]) == (2, 3, "ddim", 23)  # task's
    assert info["labels"] == "random"
    assert info["guidance_channels"] is None and info["space"] == "pixel"
    assert 0 <= info["metrics"]["sample/class_acc"] <= 100 and info["metrics"]["sample/fd_digits"] > 0


def test_compile_samples_what_eager_samples(checkpoint, tmp_path, monkeypatch):
    """``compile=true`` compiles the model once and draws the eager samples (graph capture only here:
    inductor's code generation takes minutes on this CPU; on the digits it gave the same uint8 images but
    for one level in 2e-5 of the pixels)."""
    real_compile, compiled = torch.compile, []

    def capture(model, mode="default"):
        compiled.append((type(model).__name__, mode))
        return real_compile(model, backend="eager")

    draws = {}
    for flag in ("false", "true"):
        monkeypatch.setattr(torch, "compile", capture)
        torch._dynamo.reset()
        summary = sampler.sample(options(f"ckpt={checkpoint}", "progress=false", "num_samples=10", "steps=2",
                                         "batch_size=5", f"out={tmp_path / flag}", f"compile={flag}"))
        draws[flag] = np.load(summary["files"]["npz"])["arr_0"]
    assert compiled == [("DiT", "default")]
    assert np.array_equal(draws["false"], draws["true"])


def test_guidance_weights_and_seed_decide_the_samples(checkpoint, tmp_path):
    def draw(*overrides):
        cfg, task, model, _, _ = sampling(checkpoint, "steps=2", *overrides)
        labels = sampler.balanced_labels(10, task.null_class)
        return task.sample(model, labels, torch.device("cpu"), seed=int(cfg.seed))

    plain = draw("cfg_scale=1")
    assert torch.equal(plain, draw("cfg_scale=1")), "same seed, same samples"
    assert not torch.allclose(plain, draw("cfg_scale=2")), "guidance changes the samples"
    assert not torch.allclose(plain, draw("cfg_scale=1", "seed=1"))
    assert not torch.allclose(plain, draw("cfg_scale=1", "ema=false")), "EMA weights by default"


def test_ranks_split_batches_without_changing_the_samples(checkpoint, tmp_path):
    cfg, task, model, _, _ = sampling(checkpoint, "steps=2", "batch_size=4", "cfg_scale=2")
    cpu = torch.device("cpu")
    labels = sampler.random_labels(10, NUM_CLASSES, 4, seed=0)
    single = sampler.sample_images(task, model, labels, 0, cpu, tmp_path / "one", DistInfo(), progress=False)
    for rank in (1, 0):  # batches 0..2 of 4, 4, 2 samples; rank 0 takes 0 and 2, rank 1 takes 1
        sampler.sample_batches(task, model, labels, range(rank, 3, 2), 0, cpu, _mkdir(tmp_path / "two"))
    images, merged_labels = sampler.merge_parts(tmp_path / "two", 3)
    assert np.array_equal(images, single[0]) and np.array_equal(merged_labels, single[1])


def test_random_labels_are_uniform_drawn_per_batch_and_seeded():
    labels = sampler.random_labels(20_000, NUM_CLASSES, 250, seed=0)
    counts = np.bincount(labels.numpy(), minlength=NUM_CLASSES)
    assert np.abs(counts - 2000).max() < 5 * np.sqrt(20_000 * 0.1 * 0.9)  # each class 2000 +- 5 sd
    assert torch.equal(sampler.random_labels(250, NUM_CLASSES, 250, seed=0), labels[:250]), \
        "a batch's labels depend on the seed and the batch only (not on the total, the ranks or a resumed run)"
    assert not torch.equal(labels[:250], labels[250:500]) and not torch.equal(
        labels, sampler.random_labels(20_000, NUM_CLASSES, 250, seed=1))
    balanced = sampler.draw_labels("balanced", 23, NUM_CLASSES, 8, seed=0)
    assert balanced.tolist() == sorted(balanced.tolist()) and np.bincount(balanced).tolist() == [3, 3, 3] + [2] * 7
    with pytest.raises(ConfigError, match="per_class= asks for balanced classes"):
        sampler.label_mode(options("ckpt=x", "per_class=2", "labels=random"))
    assert sampler.label_mode(options("ckpt=x", "per_class=2")) == "balanced"
    assert sampler.label_mode(options("ckpt=x", "num_samples=20")) == "random"
    assert sampler.label_mode(options("ckpt=x", "num_samples=20", "labels=balanced")) == "balanced"


def test_released_weights_sample_with_dits_protocol(tmp_path):
    """``model=<preset> pretrained=<file>``: DiT's release format (the EMA state dict), loaded strictly, sampled with
    sample_ddp.py's defaults (250 DDPM steps, guidance 1.5 on 3 channels) unless overridden."""
    import timm

    torch.manual_seed(0)
    source = timm.create_model("dit_tiny_2")
    with torch.no_grad():
        for p in source.parameters():
            p.normal_(0, 0.05)
    torch.save(source.state_dict(), tmp_path / "DiT-tiny.pt")
    weights = f"pretrained={tmp_path / 'DiT-tiny.pt'}"
    task, model, data, info = sampler.load_released_model(options("model=dit_tiny_2", weights), torch.device("cpu"))
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    assert (data.num_classes, data.in_chans, data.img_size) == (10, 1, 16) and info["weights"] == "released"
    assert {k: task.sample_cfg[k] for k in sampler.RELEASED_SAMPLE} == {"steps": "250", "sampler": "ddpm",
                                                                        "cfg_scale": 1.5, "guidance_channels": None}
    # (DiT's 4-channel latents: guidance on the first 3, as sample_ddp.py does; one pixel channel: on it)
    summary = sampler.sample(options("model=dit_tiny_2", weights, "num_samples=6", "steps=2", "batch_size=3",
                                     f"out={tmp_path / 'out'}", "progress=false"))
    assert np.load(summary["files"]["npz"])["arr_0"].shape == (6, 16, 16, 3)
    assert (summary["steps"], summary["sampler"], summary["labels"]) == (2, "ddpm", "random")
    # what cannot be sampled says so in one line
    torch.save(timm.create_model("dit_tiny_2", in_channels=4).state_dict(), tmp_path / "latent.pt")
    with pytest.raises(ConfigError, match="4-channel latents: give vae="):
        sampler.load_released_model(options("model=dit_tiny_2", f"pretrained={tmp_path / 'latent.pt'}"), "cpu")
    torch.save({**source.state_dict(), "extra.weight": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="does not fit the model as built"):
        sampler.load_released_model(options("model=dit_tiny_2", f"pretrained={tmp_path / 'other.pt'}"), "cpu")
    with pytest.raises(ConfigError, match="needs pretrained="):
        sampler.load_released_model(options("model=dit_tiny_2"), "cpu")
    with pytest.raises(ConfigError, match="not both"):
        sampler.load_released_model(options("model=dit_tiny_2", weights, "ckpt=x.pt"), "cpu")
    with pytest.raises(ConfigError, match="ckpt= is required"):
        sampler.load_model(options(), "cpu")


def test_fid_ref_adds_adms_numbers_to_sample_json(checkpoint, tmp_path, tiny_inception):
    np.savez(tmp_path / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    summary = sampler.sample(options(f"ckpt={checkpoint}", "progress=false", "num_samples=8", "steps=2",
                                     "batch_size=4", f"out={tmp_path / 'out'}", f"fid_ref={tmp_path / 'ref.npz'}",
                                     f"inception_weights={tiny_inception}"))
    from moh_vision.analysis import generative_metrics as adm
    from moh_vision.analysis.inception import InceptionActivations

    # the same numbers from the written samples.npz (the 2048-d FID, seconds on a CPU, is not computed twice)
    inception = InceptionActivations(tiny_inception)
    fake, real = inception(np.load(summary["files"]["npz"])["arr_0"]), inception(np.load(tmp_path / "ref.npz")["arr_0"])
    found = {k[len("sample/"):]: v for k, v in summary["metrics"].items() if k.startswith("sample/")}
    assert set(found) >= {"fid", "sfid", "inception_score", "precision", "recall"} and found["fid"] > 0
    assert found["sfid"] == pytest.approx(adm.adm_metrics({"spatial": fake["spatial"]}, real)["sfid"], rel=1e-6)
    assert found["inception_score"] == pytest.approx(adm.inception_score(fake["probs"]), rel=1e-6)
    assert (found["precision"], found["recall"]) == adm.precision_recall(real["pool"], fake["pool"])
    with pytest.raises(ConfigError, match="fid_ref=.*has no arr_0"):
        np.savez(tmp_path / "bad.npz", images=np.zeros((2, 16, 16, 3), np.uint8))
        sampler.check_metric_inputs(options("ckpt=x", f"fid_ref={tmp_path / 'bad.npz'}",
                                            f"inception_weights={tiny_inception}"))


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_shape_from_weights_matches_the_data(checkpoint):
    _, task, model, data, _ = sampling(checkpoint)
    shape = sampler.shape_from_weights(model.state_dict(), task.class_dropout_prob)
    assert (shape.num_classes, shape.in_chans, shape.img_size) == (data.num_classes, data.in_chans, data.img_size)


def test_bad_requests_fail_before_sampling(checkpoint, tmp_path):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    del state["model_ema"]
    torch.save(state, tmp_path / "no_ema.pt")
    with pytest.raises(ConfigError, match="no EMA weights.*ema=false"):
        sampling(tmp_path / "no_ema.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        sampling(tmp_path / "missing.pt")
    with pytest.raises(ConfigError, match="need Inception weights"):
        sampler.check_metric_inputs(options("ckpt=x", f"fid_ref={tmp_path}"))
    with pytest.raises(ConfigError, match="not both"):
        sampler.sample_count(options("ckpt=x", "num_samples=4", "per_class=2"), 10)
    _, task, _, _, _ = sampling(checkpoint, f"vae={tmp_path / 'no_vae'}")
    with pytest.raises(ConfigError, match="VAE path .* does not exist"):
        task.decode(torch.zeros(1, 1, 16, 16))


def test_frechet_distance_matches_closed_forms_and_scipy():
    from scipy import linalg

    from moh_vision.analysis.metrics import frechet_distance

    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    d1, d2 = rng.uniform(0.5, 2, 6), rng.uniform(0.5, 2, 6)
    # diagonal covariances commute: tr (S1 S2)^(1/2) = sum sqrt(d1 d2)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(d1) - np.sqrt(d2)) ** 2).sum()
    assert frechet_distance(mu1, np.diag(d1), mu2, np.diag(d2)) == pytest.approx(expected, rel=1e-10)
    a = rng.normal(size=(400, 6))
    s1 = np.cov(a, rowvar=False)
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0, abs=1e-9)
    # general (non-commuting) covariances against scipy's matrix square root
    s2 = np.cov(a @ rng.normal(size=(6, 6)), rowvar=False)
    reference = ((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2) - 2 * np.trace(linalg.sqrtm(s1 @ s2).real)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(reference, rel=1e-9)
    # rank-deficient (fewer samples than dimensions, as with few digits samples): finite, and ~0 against itself
    # (the square roots of round-off eigenvalues, ~1e-16, leave ~1e-7)
    few = np.cov(rng.normal(size=(4, 6)), rowvar=False)
    assert np.isfinite(frechet_distance(mu1, few, mu2, s2))
    assert frechet_distance(mu1, few, mu1, few) == pytest.approx(0, abs=1e-6)


def test_eval_of_a_diffusion_run_samples_and_reports_the_sample_metrics(checkpoint, tmp_path, monkeypatch,
                                                                        eval_in_process):
    """eval.py on a diffusion checkpoint: losses, a sample grid, the digits sample metrics, and which weights."""
    from moh_vision.analysis import metrics

    monkeypatch.setenv("MOH_VISION_CACHE_DIR", str(tmp_path / "cache"))  # a cached proxy classifier: no training
    metrics.classifier_cache_path(16).parent.mkdir(parents=True)
    torch.save({"model": DigitsClassifier().state_dict(), "img_size": 16, "key": metrics.classifier_key(16)},
               metrics.classifier_cache_path(16))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["config"]["task"]["sample"].update(steps="ddim2", eval_per_class=2, per_class=1)  # tiny sampling
    path = tmp_path / "last.pt"
    torch.save(state, path)
    out = tmp_path / "eval"
    code, err = eval_in_process(f"ckpt={path}", "eval.use_ema=true", "eval.num_workers=0", f"hydra.run.dir={out}")
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["weights"] == "ema" and summary["ema_available"] and "val/loss" in summary
    assert 0 <= summary["sample/class_acc"] <= 100 and summary["sample/fd_digits"] >= 0
    assert len(list((out / "samples").glob("*.png"))) == 1
    assert "evaluating the EMA weights" in (out / "eval.log").read_text()
    # the raw weights: said so, and that EMA ones are there (no sampling this time: only the statement is new)
    state["config"]["task"]["sample"].update(eval_per_class=0, per_class=0)
    torch.save(state, path)
    code, err = eval_in_process(f"ckpt={path}", "eval.num_workers=0", f"hydra.run.dir={tmp_path / 'raw'}")
    assert code == 0 and json.loads((tmp_path / "raw" / "summary.json").read_text())["weights"] == "model"
    assert "raw (non-EMA) weights" in (tmp_path / "raw" / "eval.log").read_text()
    assert "the checkpoint also holds EMA weights: eval.use_ema=true" in (tmp_path / "raw" / "eval.log").read_text()
