"""train.py / eval.py / sweeps / DDP, composed from the real configs and shrunk."""
import csv
import logging
import math

import pytest
import torch
import yaml
from PIL import Image

from helpers import FAST_TRAIN, load_tool, read_summary, run_entry


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One shrunk default run shared by the tests that only read its outputs."""
    out = tmp_path_factory.mktemp("default_run")
    proc = run_entry("train.py", *FAST_TRAIN, f"hydra.run.dir={out}")
    (out / "stderr.txt").write_text(proc.stderr)
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
    assert cfg["attention"]["name"] == "moh" and cfg["attention"]["activation_ratio"] is None  # the 0.75 policy
    assert cfg["data"]["name"] == "digits"
    # the kernels config as composed, and what each op ran on this device (the CPU's recorded winners)
    assert cfg["kernels"] == summary["kernels"] == {"aggregated": "auto", "routing": "auto", "depthwise": "auto",
                                                    "recompute": "auto"}
    assert summary["kernels_in_use"]["aggregated_attention"] == "fused"
    assert summary["kernels_in_use"]["moh_routing"] == "reference"
    assert summary["kernels_in_use"]["depthwise_conv"] == "channels_last"
    rows = list(csv.DictReader(open(trained / "metrics.csv")))
    assert [r["train/loss"] != "" for r in rows[:3]] == [True, True, True]
    # per-step rows carry the loss's parts, the gradient norm and the routers' entropy (issue 15, item 16)
    step = rows[0]
    assert float(step["train/loss"]) == pytest.approx(float(step["train/ce"]) + float(step["train/aux"]), rel=1e-5)
    assert float(step["train/aux"]) > 0 and float(step["train/grad_norm"]) > 0
    assert 0 < float(step["train/router_entropy"]) <= math.log(8)  # transnext_nano's widest routed pool
    assert rows[-1]["val/acc1"] != ""
    # fvcore's import-time torch.jit.script call used to print a FutureWarning in every run
    assert "FutureWarning" not in (trained / "stderr.txt").read_text()


def test_checkpoint_is_plain_and_carries_what_resume_needs(trained):
    state = torch.load(trained / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    for key in ("model", "optimizer", "step", "epoch", "rng", "config", "model_name", "best", "meters"):
        assert key in state, key
    assert state["step"] == 3 and state["config"]["model"]["name"] == "transnext_nano"


def test_eval_reproduces_training_validation(trained, tmp_path, eval_in_process):
    assert eval_in_process(f"ckpt={trained / 'checkpoints' / 'last.pt'}", f"hydra.run.dir={tmp_path}")[0] == 0
    assert read_summary(tmp_path)["val/acc1"] == pytest.approx(read_summary(trained)["val/acc1"], abs=1e-9)
    code, err = eval_in_process(f"ckpt={trained / 'checkpoints' / 'last.pt'}", "eval.use_ema=true",
                                f"hydra.run.dir={tmp_path / 'ema'}")
    assert code == 2 and "no EMA weights" in err


@pytest.mark.slow  # CI covers resume with the SIGKILL tests of test_reliability.py
def test_auto_resume_continues_the_run(tmp_path):
    args = ("trainer.epochs=2", "trainer.batch_size=256", "trainer.progress=false", f"hydra.run.dir={tmp_path}")
    run_entry("train.py", *args, "trainer.max_steps=5")  # stops after the first epoch (5 steps of 256)
    first = read_summary(tmp_path)
    assert first["steps"] == 5 and first["epochs"] == 1
    proc = run_entry("train.py", *args, "trainer.extend=true")  # past max_steps
    assert "resumed from" in proc.stderr + proc.stdout
    second = read_summary(tmp_path)
    assert second["steps"] == 10 and second["epochs"] == 2
    epochs = [r["epoch"] for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("val/acc1")]
    assert epochs == ["0", "1"], "each epoch is validated and logged exactly once"


def test_multirun_sweep_and_report(tmp_path, capsys):
    run_entry("train.py", "-m", "attention.activation_ratio=0.5,1.0", *FAST_TRAIN, "trainer.max_steps=2",
              f"hydra.sweep.dir={tmp_path}", fork=True)
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert len(summaries) == 2
    assert load_tool("sweep_report").main([f"dir={tmp_path}"]) == 0  # in-process: no second package import
    printed = capsys.readouterr().out
    for name in ("sweep_report.md", "sweep_report.csv", "sweep_report.png"):
        assert (tmp_path / name).is_file()
    rows = list(csv.DictReader(open(tmp_path / "sweep_report.csv")))
    assert sorted(float(r["activation_ratio"]) for r in rows) == [0.5, 1.0]
    assert "| moh |" in printed.replace("transnext_nano | ", "")


@pytest.mark.slow  # CI covers sweeps with test_multirun_sweep_and_report
def test_optuna_sweep_two_trials(tmp_path):
    run_entry("train.py", "sweep=optuna", "hydra.sweeper.n_trials=2", *FAST_TRAIN, "trainer.max_steps=2",
              f"hydra.sweep.dir={tmp_path}")
    assert len(list(tmp_path.rglob("summary.json"))) == 2
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert "best_params" in results and "attention.activation_ratio" in results["best_params"]


def _image_tree(root, classes=3, per_class=6, size=(40, 36)):
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(per_class):
                color = (40 * c + 20, 200 - 30 * c, (17 * i) % 255)
                Image.new("RGB", size, color).save(d / f"img{i}.png")
    (root / "train" / "class0" / "broken.jpg").write_bytes(b"not a jpeg")


def test_imagenet_recipe_on_a_tiny_image_folder(tmp_path, train_in_process):
    data = tmp_path / "data"
    _image_tree(data)
    out = tmp_path / "run"
    assert train_in_process("data=imagefolder", f"data.root={data}", "data.img_size=32", *FAST_TRAIN,
                            "data.repeated_aug=1", "trainer.batch_size=19", "trainer.epochs=2", "trainer.max_steps=null",
                            "+model.kwargs.drop_path_rate=0.1", f"hydra.run.dir={out}")[0] == 0
    summary = read_summary(out)
    assert summary["steps"] == 2 and summary["val/count"] == 18
    assert summary["skipped_images"] == 1, "the unreadable file is counted once, though met in both epochs"
    assert summary["train/skipped_images"] == 1 and summary["val/skipped_images"] == 0
    assert "broken.jpg" in (out / "train.log").read_text(), "train.log names the skipped file"
    code, err = train_in_process("data=imagenet", f"data.root={data}", "data.img_size=32", *FAST_TRAIN,
                                 f"hydra.run.dir={tmp_path / 'in1k'}")
    assert code == 2 and "1000" in err


def test_wandb_logger_works_offline(tmp_path):
    run_entry("train.py", *FAST_TRAIN, "trainer.max_steps=1", "logger=wandb", f"hydra.run.dir={tmp_path}",
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}, fork=True)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["wandb_run_id"] and state["wandb_run_id"] in runs[0].name


@pytest.mark.parametrize("override,fragment", [
    ("model=resnet_moh", "options: dit_b_2, dit_b_4,"),  # the options are listed
    ("model=dit", "did you mean dit_s_8"),        # a family file is not an option: it names no model
    ("model=vit_tiny_patch16_224", "its checkpoints load into model=plain_vit_tiny"),  # a timm name
    ("model.name=transnext_nanoo", "did you mean transnext_nano"),
    ("attention=moh attention.activation_ratio=1.5", "outside (0, 1]"),
    ("attention=nonexistent", "attention=nonexistent is unknown; options: mha, moa, moh"),
    ("data.img_size=40", "multiple of 32"),
    ("trainer.val_at_start=sometimes", "trainer.val_at_start=sometimes: must be one of auto, true, false"),
])
def test_bad_config_fails_with_one_line(tmp_path, override, fragment, train_in_process):
    code, stderr = train_in_process(*override.split(), *FAST_TRAIN, f"hydra.run.dir={tmp_path}")
    assert code == 2
    err = stderr.strip().splitlines()
    assert err and fragment in err[-1], stderr[-2000:]


def test_ema_warmup_decay_forgets_the_init_and_counts_updates():
    from torch import nn

    from moh_vision.engine.fit_setup import EMA
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


# ---------------------------------------------------------------------------------------------
# In-process runs (no subprocess): the trainer's summary, throughput, skipped images, artifacts
# ---------------------------------------------------------------------------------------------
def train_here(out_dir, monkeypatch, *overrides):
    """train.py's ``train(cfg)`` in this process, writing into ``out_dir`` (the real configs, shrunk)."""
    from hydra import compose, initialize_config_dir

    from helpers import REPO
    from moh_vision.apps.run import train
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*FAST_TRAIN, "trainer.count_flops=false", "trainer.batch_size=8",
                                          "trainer.val_batch_size=128", *overrides])
    out_dir.mkdir(parents=True, exist_ok=True)
    from hydra.core.hydra_config import HydraConfig
    with monkeypatch.context() as m:
        m.chdir(out_dir)  # outside @hydra.main the run directory is the working directory
        m.setattr(HydraConfig.instance(), "cfg", None)  # (and no Hydra run's config is there)
        m.delenv("WORLD_SIZE", raising=False)
        return train(cfg)


def test_rerun_of_a_finished_run_keeps_every_result(tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = train_here(run, monkeypatch, "logger=none", "trainer.max_steps=1")
    recorded = (run / "summary.json").read_text()
    assert "val/acc1" in first and first["images_per_sec"] > 0
    assert (run / "routing_head_load.png").is_file(), "routing PNGs are written with logger=none too"
    rows = (run / "metrics.csv").read_text()

    again = train_here(run, monkeypatch, "logger=none", "trainer.max_steps=1")  # trainer.resume=auto: the finished run
    assert (run / "summary.json").read_text() == recorded, "a rerun of a finished run changes nothing"
    assert again["val/acc1"] == first["val/acc1"] and again["images_per_sec"] == first["images_per_sec"]
    assert (run / "metrics.csv").read_text() == rows

    (run / "summary.json").unlink()  # lost: the final weights are evaluated again, throughput comes from last.pt
    rebuilt = train_here(run, monkeypatch, "logger=none", "trainer.max_steps=1")
    for key in ("val/acc1", "val/loss", "val/count", "best/val/acc1", "images_per_sec", "train_time_s", "steps"):
        assert rebuilt[key] == pytest.approx(first[key], rel=1e-9), key
    assert read_summary(run)["val/acc1"] == pytest.approx(first["val/acc1"])


class _SlowFirstCall(torch.nn.Module):
    """Stands in for torch.compile: the first forward costs 10 (fake-clock) seconds, like a compilation."""

    def __init__(self, model, clock):
        super().__init__()
        self._orig_mod, self.clock, self.calls = model, clock, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            self.clock.now += 10.0
        return self._orig_mod(*args, **kwargs)


def test_cuda_graphs_are_marked_only_where_compiled_graphs_replay():
    from moh_vision.engine.fit_setup import uses_cuda_graphs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_cuda_graphs(True, "reduce-overhead", cuda) and uses_cuda_graphs(True, "max-autotune", cuda)
    assert not uses_cuda_graphs(True, "default", cuda) and not uses_cuda_graphs(True, "max-autotune-no-cudagraphs", cuda)
    assert not uses_cuda_graphs(False, "reduce-overhead", cuda) and not uses_cuda_graphs(True, "reduce-overhead", cpu)


def test_images_per_sec_leaves_out_compilation(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from moh_vision.engine import bookkeeping as costs, fit_setup
    from moh_vision.engine import trainer as trainer_module

    class Clock:  # every reading advances 1 ms: the result does not depend on how busy the machine is
        now = 1000.0

        def time(self):
            self.now += 0.001
            return self.now

    clock = Clock()
    monkeypatch.setattr(costs, "time", SimpleNamespace(perf_counter=clock.time))
    modes, marks = [], []
    monkeypatch.setattr(torch, "compile", lambda model, mode="default", **_: modes.append(mode) or
                        _SlowFirstCall(model, clock))
    # as on a GPU, where reduce-overhead replays CUDA graphs: every training step is marked as a new one
    monkeypatch.setattr(trainer_module, "uses_cuda_graphs",
                        lambda compiled, mode, device: fit_setup.uses_cuda_graphs(compiled, mode, torch.device("cuda")))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    summary = train_here(tmp_path / "run", monkeypatch, "trainer.compile=true", "trainer.max_steps=4",
                         "trainer.compile_mode=reduce-overhead")
    assert modes == ["reduce-overhead"]  # trainer.compile_mode reaches torch.compile (CUDA graphs on a GPU)
    assert len(marks) == 4
    assert summary["steps"] == 4 and summary["throughput_warmup_steps"] == 1
    assert summary["compile_time_s"] == pytest.approx(10.0, abs=0.5)
    assert summary["train_time_s"] >= 10.0
    everything = 4 * 8 / summary["train_time_s"]  # what images_per_sec was: compilation included
    assert summary["images_per_sec"] > 20 * everything
    assert (tmp_path / "run" / "routing_head_load.png").is_file(), "routing PNGs are written with logger=csv"


def test_unreadable_images_are_counted_as_files_and_named(tmp_path, monkeypatch, caplog):
    data = tmp_path / "data"
    _image_tree(data, per_class=4)  # train/class0/broken.jpg
    (data / "train" / "class2" / "empty.png").write_bytes(b"")
    (data / "val" / "class1" / "cut.png").write_bytes(b"\x89PNG\r\n")
    with caplog.at_level(logging.WARNING, logger="moh_vision.engine.trainer"):
        summary = train_here(tmp_path / "run", monkeypatch, "data=imagefolder", f"data.root={data}",
                             "data.img_size=32", "data.repeated_aug=1", "trainer.batch_size=7", "trainer.epochs=2",
                             "trainer.max_steps=null")
    assert summary["epochs"] == 2 and summary["steps"] == 4  # 14 train items -> 2 steps of 7 per epoch
    assert (summary["train/skipped_images"], summary["val/skipped_images"], summary["skipped_images"]) == (2, 1, 3)
    epochs = [r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r.get("val/acc1")]
    assert [(r["train/skipped_images"], r["val/skipped_images"]) for r in epochs] == [("2", "1"), ("2", "1")]
    named = [r.getMessage() for r in caplog.records if "skipped unreadable" in r.getMessage()]
    for name in ("broken.jpg", "empty.png", "cut.png"):
        assert sum(name in m for m in named) == 1, (name, named)  # once per file, not once per epoch
