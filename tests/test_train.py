"""train.py / eval.py / sweeps / DDP, composed from the real configs and shrunk."""
import csv
import sys

import pytest
import torch
import yaml
from PIL import Image

from helpers import FAST_TRAIN, read_summary, run_entry


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One shrunk default run shared by the tests that only read its outputs."""
    out = tmp_path_factory.mktemp("default_run")
    run_entry("train.py", *FAST_TRAIN, f"hydra.run.dir={out}")
    return out


def test_default_run_writes_every_output(trained):
    for name in ("config.yaml", "metrics.csv", "summary.json", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (trained / name).is_file(), name
    summary = read_summary(trained)
    for key in ("val/acc1", "val/acc5", "params", "gflops", "images_per_sec", "wall_time_s"):
        assert key in summary, key
    assert summary["steps"] == 3 and summary["model"] == "transnext_nano" and summary["attention"] == "moh"
    assert 0.0 <= summary["val/acc1"] <= 100.0 and summary["val/count"] == 359
    cfg = yaml.safe_load((trained / "config.yaml").read_text())
    assert cfg["attention"]["activation_ratio"] == 0.75 and cfg["data"]["_target_"].endswith("DigitsData")
    rows = list(csv.DictReader(open(trained / "metrics.csv")))
    assert [r["train/loss"] != "" for r in rows[:3]] == [True, True, True]
    assert rows[-1]["val/acc1"] != ""


def test_checkpoint_is_plain_and_carries_what_resume_needs(trained):
    state = torch.load(trained / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    for key in ("model", "optimizer", "step", "epoch", "rng", "config", "model_name", "best", "meters"):
        assert key in state, key
    assert state["step"] == 3 and state["config"]["model"]["name"] == "transnext_nano"


def test_eval_reproduces_training_validation(trained, tmp_path):
    run_entry("eval.py", f"ckpt={trained / 'checkpoints' / 'last.pt'}", f"hydra.run.dir={tmp_path}")
    assert read_summary(tmp_path)["val/acc1"] == pytest.approx(read_summary(trained)["val/acc1"], abs=1e-9)
    proc = run_entry("eval.py", f"ckpt={trained / 'checkpoints' / 'last.pt'}", "eval.use_ema=true",
                     f"hydra.run.dir={tmp_path / 'ema'}", check=False)
    assert proc.returncode == 2 and "no EMA weights" in proc.stderr


@pytest.mark.slow  # CI covers resume with the SIGKILL tests of test_reliability.py
def test_auto_resume_continues_the_run(tmp_path):
    args = ("trainer.epochs=2", "trainer.batch_size=256", "trainer.progress=false", f"hydra.run.dir={tmp_path}")
    run_entry("train.py", *args, "trainer.max_steps=5")  # stops after the first epoch (5 steps of 256)
    first = read_summary(tmp_path)
    assert first["steps"] == 5 and first["epochs"] == 1
    proc = run_entry("train.py", *args)
    assert "resumed from" in proc.stderr + proc.stdout
    second = read_summary(tmp_path)
    assert second["steps"] == 10 and second["epochs"] == 2
    epochs = [r["epoch"] for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("val/acc1")]
    assert epochs == ["0", "1"], "each epoch is validated and logged exactly once"


def test_multirun_sweep_and_report(tmp_path):
    run_entry("train.py", "-m", "attention.activation_ratio=0.5,1.0", *FAST_TRAIN, "trainer.max_steps=2",
              f"hydra.sweep.dir={tmp_path}")
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert len(summaries) == 2
    proc = run_entry("tools/sweep_report.py", str(tmp_path))
    for name in ("sweep_report.md", "sweep_report.csv", "sweep_report.png"):
        assert (tmp_path / name).is_file()
    rows = list(csv.DictReader(open(tmp_path / "sweep_report.csv")))
    assert sorted(float(r["activation_ratio"]) for r in rows) == [0.5, 1.0]
    assert "| moh |" in proc.stdout.replace("transnext_nano | ", "")


@pytest.mark.slow  # CI covers sweeps with test_multirun_sweep_and_report
def test_optuna_sweep_two_trials(tmp_path):
    run_entry("train.py", "sweep=optuna", "hydra.sweeper.n_trials=2", *FAST_TRAIN, "trainer.max_steps=2",
              f"hydra.sweep.dir={tmp_path}")
    assert len(list(tmp_path.rglob("summary.json"))) == 2
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert "best_params" in results and "attention.activation_ratio" in results["best_params"]


def test_ddp_two_process_gloo(tmp_path):
    run_entry("train.py", *FAST_TRAIN, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}",
              launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"))
    summary = read_summary(tmp_path)
    assert summary["steps"] == 2
    assert summary["val/count"] == 359, "validation metrics are all-reduced over both ranks"
    assert (tmp_path / "checkpoints" / "last.pt").is_file()


def _image_tree(root, classes=3, per_class=6, size=(40, 36)):
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(per_class):
                color = (40 * c + 20, 200 - 30 * c, (17 * i) % 255)
                Image.new("RGB", size, color).save(d / f"img{i}.png")
    (root / "train" / "class0" / "broken.jpg").write_bytes(b"not a jpeg")


def test_imagenet_recipe_on_a_tiny_image_folder(tmp_path):
    data = tmp_path / "data"
    _image_tree(data)
    out = tmp_path / "run"
    run_entry("train.py", "data=imagefolder", f"data.root={data}", "data.img_size=32", *FAST_TRAIN,
              "data.repeated_aug=1", "trainer.batch_size=19", "trainer.epochs=2", "trainer.max_steps=null",
              "+model.kwargs.drop_path_rate=0.1", f"hydra.run.dir={out}")
    summary = read_summary(out)
    assert summary["steps"] == 2 and summary["val/count"] == 18
    assert summary["skipped_images"] == 2, "the unreadable file is skipped and counted, once per epoch"
    proc = run_entry("train.py", "data=imagenet", f"data.root={data}", "data.img_size=32", *FAST_TRAIN,
                     f"hydra.run.dir={tmp_path / 'in1k'}", check=False)
    assert proc.returncode == 2 and "1000" in proc.stderr


def test_wandb_logger_works_offline(tmp_path):
    run_entry("train.py", *FAST_TRAIN, "trainer.max_steps=1", "logger=wandb", f"hydra.run.dir={tmp_path}",
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["wandb_run_id"] and state["wandb_run_id"] in runs[0].name


@pytest.mark.parametrize("override,fragment", [
    ("model=resnet_moh", "Could not find 'model/resnet_moh'"),  # Hydra lists the options
    ("model.name=transnext_nanoo", "did you mean transnext_nano"),
    ("attention=moh attention.activation_ratio=1.5", "outside (0, 1]"),
    ("attention=nonexistent", "Could not find 'attention/nonexistent'"),
    ("data.img_size=40", "multiple of 32"),
    ("trainer.val_at_start=sometimes", "trainer.val_at_start='sometimes'; allowed: auto, true, false"),
])
def test_bad_config_fails_with_one_line(tmp_path, override, fragment):
    proc = run_entry("train.py", *override.split(), *FAST_TRAIN, f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert err and fragment in (err[-1] if proc.returncode == 2 else proc.stderr), proc.stderr[-2000:]


def test_ema_warmup_decay_forgets_the_init_and_counts_updates():
    from torch import nn

    from moh_vision.engine.ema import EMA
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    plain, warm = EMA(model, 0.999), EMA(model, 0.999, warmup=True)
    with torch.no_grad():
        model.weight.fill_(1.0)
    for ema in (plain, warm):
        ema.update(model)
    # update 0 with warm-up: d = min(0.999, 1/10) = 0.1, so the EMA moves 90% of the way at once
    assert torch.allclose(warm.module.weight, torch.full((1, 2), 0.9))
    assert torch.allclose(plain.module.weight, torch.full((1, 2), 0.001))
    assert warm.updates == 1 and abs(warm.current_decay() - 2 / 11) < 1e-12
    warm.updates = 10 ** 6
    assert warm.current_decay() == 0.999
