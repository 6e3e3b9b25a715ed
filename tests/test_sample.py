"""tools/sample.py: class-conditional sampling from a trainer checkpoint or released weights, DiT's random labels,
the ADM .npz, guidance, rank sharding, ADM's metrics and the digits proxy metrics."""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import REPO, load_tool, run_entry, save_untrained_classifier
from moh_vision.cli import parse_options
from moh_vision.apps import sampling as sampler
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
    save_untrained_classifier(run / "digits_classifier.pt", 16)
    return path


def options(*words):
    return parse_options(words, load_tool("sample").OPTIONS)[0]  # ckpt= (or model= pretrained=) first


def sampling(ckpt, *overrides):
    cfg = options(f"ckpt={ckpt}", "progress=false", *overrides)
    task, model, data, info = sampler.load_model(cfg, torch.device("cpu"))
    return cfg, task, model, data, info


def test_cli_writes_adm_npz_grid_labels_and_digits_metrics(checkpoint, tmp_path):
    load_tool("sample").main([f"ckpt={checkpoint}", "num_samples=23", "steps=3", "cfg_scale=2", "batch_size=8",
                              f"out={tmp_path}", "progress=false"])
    with np.load(tmp_path / "samples.npz") as npz:
        assert npz.files == ["arr_0"]
        arr = npz["arr_0"]
    assert arr.dtype == np.uint8 and arr.shape == (23, 16, 16, 3)  # grayscale digits repeated to RGB
    assert (arr[..., 0] == arr[..., 2]).all() and arr.std() > 0
    labels = np.load(tmp_path / "labels.npy")  # DiT's: drawn at random with the noise
    assert labels.shape == (23,) and labels.dtype == np.int64 and 0 <= labels.min() and labels.max() < NUM_CLASSES
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
        labels = sampler.balanced_labels(10, task.null_class, seed=0)
        return task.sample(model, labels, torch.device("cpu"), seed=int(cfg.seed))

    plain = draw("cfg_scale=1")
    assert torch.equal(plain, draw("cfg_scale=1")), "same seed, same samples"
    assert not torch.allclose(plain, draw("cfg_scale=2")), "guidance changes the samples"
    assert not torch.allclose(plain, draw("cfg_scale=1", "seed=1"))
    assert not torch.allclose(plain, draw("cfg_scale=1", "ema=false")), "EMA weights by default"


def dit_protocol(task, model, num_samples, seed, world_size, batch_size):
    """DiT's sample_ddp.py, written out from its description: rank r of W seeds one stream with seed * W + r and
    draws each batch's labels, then its noise, from it; sample i of its batch t is sample t * B * W + i * W + r; full
    batches, a multiple of B * W, the first N kept."""
    from moh_vision.analysis.grids import to_uint8

    images, labels = {}, {}
    for rank in range(world_size):
        stream = torch.Generator().manual_seed(seed * world_size + rank)
        for t in range(-(-num_samples // (batch_size * world_size))):
            y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=stream)
            x = task.sample(model, y, torch.device("cpu"), generator=stream)
            for i in range(batch_size):
                where = t * batch_size * world_size + i * world_size + rank
                images[where], labels[where] = x[i], int(y[i])
    return to_uint8(torch.stack([images[j] for j in range(num_samples)])), np.array([labels[j] for j in
                                                                                      range(num_samples)])


def test_each_rank_samples_from_its_own_seed_as_dits_sample_ddp(checkpoint, tmp_path):
    """Two ranks (run one after the other here; under a real torchrun below) give sample_ddp.py's samples: ten kept
    of the twelve that two ranks' two full batches of three make."""
    cfg, task, model, _, _ = sampling(checkpoint, "steps=2", "batch_size=3", "cfg_scale=2")
    cpu = torch.device("cpu")
    for rank in (1, 0):
        sampler.sample_rank(task, model, "random", 10, NUM_CLASSES, 5, cpu, _mkdir(tmp_path / "two"),
                            DistInfo(rank=rank, world_size=2))
    images, labels = sampler.merge_parts(tmp_path / "two", 10, 3, 2)
    expected_images, expected_labels = dit_protocol(task, model, 10, seed=5, world_size=2, batch_size=3)
    assert np.array_equal(labels, expected_labels) and np.array_equal(images, expected_images)
    one = sampler.sample_images(task, model, "random", 10, NUM_CLASSES, 5, cpu, tmp_path / "one", DistInfo(),
                                progress=False)
    assert not np.array_equal(one[0], images), "one rank of seed 5 draws other samples than two ranks of seed 5"


@pytest.mark.slow  # two torchrun workers and three single-process runs
def test_torchrun_ranks_sample_what_their_seeds_sample_alone(checkpoint, tmp_path):
    """Under a real torchrun (two gloo ranks), rank r of 2 with seed s draws what one process draws with seed 2s + r:
    its samples are every other sample of the output, from r on; rank 0 alone writes the outputs."""
    common = ("steps=2", "batch_size=3", "cfg_scale=2", "progress=false")
    run_entry("tools/sample.py", f"ckpt={checkpoint}", "num_samples=10", "seed=4", f"out={tmp_path / 'two'}",
              *common, launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"))
    two = np.load(tmp_path / "two" / "samples.npz")["arr_0"]
    two_labels = np.load(tmp_path / "two" / "labels.npy")
    summary = json.loads((tmp_path / "two" / "sample.json").read_text())
    assert (summary["world_size"], summary["rank_seeds"], two.shape[0]) == (2, [8, 9], 10)
    for rank in (0, 1):
        alone = sampler.sample(options(f"ckpt={checkpoint}", "num_samples=5", f"seed={8 + rank}",
                                       f"out={tmp_path / str(rank)}", *common))
        assert np.array_equal(np.load(alone["files"]["npz"])["arr_0"], two[rank::2])
        assert np.array_equal(np.load(alone["files"]["labels"]), two_labels[rank::2])
    same_seed = sampler.sample(options(f"ckpt={checkpoint}", "num_samples=10", "seed=4", f"out={tmp_path / 'one'}",
                                       *common))
    assert not np.array_equal(np.load(same_seed["files"]["npz"])["arr_0"], two), "not invariant to world size"
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["labels.npy", "sample.json", "samples.npz",
                                                                    "samples.png"]


def written(summary):
    return np.load(summary["files"]["npz"])["arr_0"], np.load(summary["files"]["labels"])


def test_a_rerun_resumes_the_stream_after_the_stored_batches(checkpoint, tmp_path, monkeypatch):
    from moh_vision.tasks.diffusion import DiffusionTask

    words = (f"ckpt={checkpoint}", "num_samples=9", "steps=2", "batch_size=3", "progress=false")
    whole = written(sampler.sample(options(*words, f"out={tmp_path / 'whole'}")))
    real, calls = DiffusionTask.sample, []

    def stops_at_the_third_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DiffusionTask, "sample", stops_at_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        sampler.sample(options(*words, f"out={tmp_path / 'again'}"))
    calls.clear()
    resumed = written(sampler.sample(options(*words, f"out={tmp_path / 'again'}")))
    assert len(calls) == 1, "the two stored batches are not sampled again"
    assert np.array_equal(resumed[0], whole[0]) and np.array_equal(resumed[1], whole[1])
    monkeypatch.undo()
    _, task, model, _, _ = sampling(checkpoint, "steps=2", "batch_size=3")
    expected = dit_protocol(task, model, 9, seed=0, world_size=1, batch_size=3)  # the stream went on after batch 2
    assert np.array_equal(resumed[0], expected[0]) and np.array_equal(resumed[1], expected[1])


def test_balanced_labels_are_balanced_shuffled_and_seeded(checkpoint, tmp_path, monkeypatch):
    balanced = sampler.balanced_labels(23, NUM_CLASSES, seed=0)
    assert np.bincount(balanced).tolist() == [3, 3, 3] + [2] * 7
    assert balanced.tolist() != sorted(balanced.tolist()), "not sorted by class"
    assert torch.equal(balanced, sampler.balanced_labels(23, NUM_CLASSES, seed=0))
    assert not torch.equal(balanced, sampler.balanced_labels(23, NUM_CLASSES, seed=1))
    with pytest.raises(ConfigError, match="per_class= asks for balanced classes"):
        sampler.label_mode(options("ckpt=x", "per_class=2", "labels=random"))
    assert sampler.label_mode(options("ckpt=x", "per_class=2")) == "balanced"
    assert sampler.label_mode(options("ckpt=x", "num_samples=20")) == "random"
    assert sampler.label_mode(options("ckpt=x", "num_samples=20", "labels=balanced")) == "balanced"
    # the tool writes them in that order; the grid still shows one class per row
    from moh_vision.analysis import grids

    rows, real_grid = [], grids.save_class_grid
    monkeypatch.setattr(grids, "save_class_grid",
                        lambda images, labels, *a, **kw: rows.append(labels.tolist()) or real_grid(images, labels,
                                                                                                   *a, **kw))
    _, labels = written(sampler.sample(options(f"ckpt={checkpoint}", "per_class=2", "steps=2", "batch_size=8",
                                               "progress=false", f"out={tmp_path}")))
    assert labels.tolist() == sampler.balanced_labels(20, NUM_CLASSES, seed=0).tolist()
    assert rows == [sorted(labels.tolist())]


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


def test_fid_ref_adds_adms_numbers_to_sample_json(checkpoint, tmp_path, tiny_inception, monkeypatch):
    """ADM's numbers in sample.json, computed in float32 while the sampling ran with TF32 (set here by hand: on the
    CPU the tool's tf32=true leaves the settings alone)."""
    from test_generative_metrics import FLOAT32, TF32_ON, precision_views, settings

    from moh_vision.analysis import generative_metrics as adm
    from moh_vision.analysis.inception import InceptionActivations

    seen, real_distances = [], adm.squared_distances
    monkeypatch.setattr(adm, "squared_distances", lambda *args: seen.append(precision_views()) or real_distances(*args))
    np.savez(tmp_path / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    with settings(*TF32_ON):
        on = precision_views()
        summary = sampler.sample(options(f"ckpt={checkpoint}", "progress=false", "num_samples=8", "steps=2",
                                         "batch_size=4", f"out={tmp_path / 'out'}", f"fid_ref={tmp_path / 'ref.npz'}",
                                         f"inception_weights={tiny_inception}"))
        assert precision_views() == on
    assert seen and all(views == FLOAT32 for views in seen)

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


@pytest.mark.parametrize("case,message", [
    ("torchvision", r"inception_weights=.*has fc.weight \[1000, 2048\] \(torchvision's ImageNet Inception, "
                    r"inception_v3_google-\*.pth\), not the 1008-class classifier .*nothing is downloaded"),
    ("missing_key", r"inception_weights=.* does not fit torch-fidelity's InceptionV3 \(.*Missing key.*Mixed_7c"),
    ("no_torch_fidelity", r"need torch-fidelity, .*: pip install torch-fidelity==0.4.0"),
    ("statistics_width", r"the reference's mu is 100-d but this Inception's pool activations are 2048-d"),
])
def test_a_wrong_metric_input_is_one_error_line_before_any_sample(case, message, checkpoint, tmp_path,
                                                                   tiny_inception, monkeypatch, capsys):
    ref, weights = tmp_path / "ref.npz", tmp_path / "weights.pth"
    np.savez(ref, arr_0=np.zeros((4, 16, 16, 3), np.uint8))
    state = torch.load(tiny_inception, weights_only=True)
    if case == "torchvision":  # torchvision's ImageNet Inception: the same module names, 1000 classes, AuxLogits
        import torchvision
        state = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False).state_dict()
    elif case == "missing_key":
        state = {k: v for k, v in state.items() if not k.startswith("Mixed_7c.")}
    elif case == "no_torch_fidelity":
        monkeypatch.setitem(sys.modules, "torch_fidelity", None)
    else:
        np.savez(ref, arr_0=np.zeros((4, 16, 16, 3), np.uint8), mu=np.zeros(100), sigma=np.eye(100))
    torch.save(state, weights)
    started = []
    monkeypatch.setattr(sampler, "load_model", lambda *args: started.append("load_model"))
    monkeypatch.setattr(sampler, "sample_images", lambda *args: started.append("sample_images"))
    with pytest.raises(SystemExit) as exited:
        load_tool("sample").main([f"ckpt={checkpoint}", "num_samples=4", f"out={tmp_path / 'out'}", f"fid_ref={ref}",
                                  f"inception_weights={weights}", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert started == [], "refused before the checkpoint is read, let alone sampled"


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
    save_untrained_classifier(metrics.classifier_cache_path(16), 16)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["config"]["task"]["sample"].update(steps="ddim2", eval_per_class=2, per_class=1)  # tiny sampling
    state["config"]["data"]["val_fraction"] = 0.05  # and 90 validation digits for the losses
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
