"""The trainer in-process: its collaborators' interfaces (Task, Data, EpochContext), what a fit
writes, and the rule that no attribute is created outside ``__init__``."""
import ast
import collections
import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ATTENTION_PRESET, model_config, read_summary, trainer_config
from moh_vision.config import ConstantSched, OptimConfig
from moh_vision.data.digits import DigitsData
from moh_vision.data.sampler import EpochSampler, SeededItems
from moh_vision.engine import bookkeeping, distributed, fit_setup, step_on_device, trainer as trainer_module
from moh_vision.engine.distributed import DistInfo
from moh_vision.engine.loggers import Loggers
from moh_vision.tasks.protocols import DATA_CAPABILITIES, Data, EpochContext, Task, capability
from moh_vision.engine.trainer import Trainer
from moh_vision.tasks.classification import ClassificationTask
from moh_vision.tasks.diffusion import DiffusionTask

ENGINE_MODULES = (trainer_module, bookkeeping, distributed, fit_setup, step_on_device)


def _self_assignments(function: ast.AST):
    """(attribute, line) of every ``self.<attribute> = / += / : T =`` in ``function``, nested functions
    included (``self.a.b = ...`` sets an attribute of ``self.a``, not of ``self``)."""
    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                yield from targets(element)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            yield node.attr, node.lineno

    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                yield from targets(target)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            yield from targets(node.target)


def test_no_attribute_is_created_outside_init():
    """Trainer and its collaborators: every attribute a method sets was set in ``__init__`` first (a
    dataclass's ``__init__`` sets its fields)."""
    found = []
    for module in ENGINE_MODULES:
        for cls in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(cls, ast.ClassDef):
                continue
            methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            declared = {a for f in methods if f.name == "__init__" for a, _ in _self_assignments(f)}
            if any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
                declared |= {f.target.id for f in cls.body if isinstance(f, ast.AnnAssign)}
            found += [f"{module.__name__}.{cls.name}.{f.name} sets self.{attr} (line {line})"
                      for f in methods if f.name != "__init__"
                      for attr, line in _self_assignments(f) if attr not in declared]
    assert not found, "attributes first set outside __init__:\n" + "\n".join(found)


def test_the_ast_check_sees_an_attribute_created_late():
    late = ast.parse("class A:\n    def m(self):\n        self.a, self.b = 2, 3\n        self.c += 1\n"
                     "        self.a.x = 4\n        def f():\n            self.d: int = 5\n")
    assert [attr for attr, _ in _self_assignments(late.body[0].body[0])] == ["a", "b", "c", "d"]


def test_tasks_and_data_conform_to_the_protocols():
    data = DigitsData(img_size=16)
    assert isinstance(data, Data)
    for task in (ClassificationTask(model_config("plain_vit_nano"), ATTENTION_PRESET),
                 DiffusionTask(model_config("dit_tiny_2"), ATTENTION_PRESET)):
        assert isinstance(task, Task), type(task).__name__


def test_seeded_batches_equal_seeded_items():
    """The DataLoader's batched fetch gives each digit the augmentation it gets alone (seeded by seed, epoch and
    index), so batching changes the time of an epoch and not one value; datasets without a batched draw are
    fetched item by item."""
    items = SeededItems(DigitsData(img_size=16, in_chans=3).train, seed=3)
    items.epoch = 5
    indices = [0, 7, 7, 1000, 42]
    batch = items.__getitems__(indices)
    for index, (img, label) in zip(indices, batch):
        alone_img, alone_label = items[index]
        assert torch.equal(img, alone_img) and label == alone_label
    assert not torch.equal(batch[0][0], items.dataset[0][0])  # the augmentation ran
    plain = SeededItems(torch.utils.data.TensorDataset(torch.arange(6.0)), seed=0)
    assert [x for (x,) in plain.__getitems__([4, 1])] == [4.0, 1.0]


def test_repeated_copies_get_their_own_augmentation_seed():
    """Repeated augmentation x3 over two ranks puts two copies of some images on one rank: every (rank, position)
    holds a distinct (index, copy) key, and each copy's seed differs; without repeats every copy number is 0 and the
    seeds are those of (seed, epoch, index), as before copy numbers."""
    ranks = [EpochSampler(10, seed=1, rank=r, world_size=2, repeats=3) for r in (0, 1)]
    keys = [k for sampler in ranks for k in sampler.keyed()]
    assert len(keys) == len(set(keys)) == 10 and [i for i, _ in ranks[0].keyed()] == ranks[0].indices()
    on_rank0 = collections.Counter(i for i, _ in ranks[0].keyed())
    assert max(on_rank0.values()) >= 2, "the scenario: two copies of an image on one rank"
    items = SeededItems(torch.utils.data.TensorDataset(torch.arange(10.0)), seed=1)
    assert len({items.item_seed((0, i, c)) for i, c in keys}) == len(keys)
    assert items.item_seed((0, 4, 0)) == items.item_seed((0, 4)) == items.item_seed(4)
    assert {c for _, c in EpochSampler(10, rank=1, world_size=2, drop_last=True).keyed()} == {0}


def test_digit_metrics_is_a_declared_capability():
    """The diffusion task scores samples with the digits classifier because the data say so, not
    because of their class; data that declare nothing get the documented default."""
    task = DiffusionTask(model_config("dit_tiny_2"), ATTENTION_PRESET)
    task.build_model(DigitsData(img_size=8))
    assert task.is_digits
    shape_only = SimpleNamespace(num_classes=10, in_chans=1, img_size=8)  # what sampling builds without data
    task.build_model(shape_only)
    assert not task.is_digits
    assert capability(shape_only, "digit_metrics") is DATA_CAPABILITIES["digit_metrics"] is False
    assert capability(shape_only, "scale_factor") is None  # pixel data


def _fit(tmp_path: Path, task, data, **trainer_overrides):
    cfg = trainer_config(**{"epochs": 1, "max_steps": 2, "batch_size": 16, "log_every": 1, **trainer_overrides})
    config = {"attention": dict(ATTENTION_PRESET), "model": dict(task.model_cfg)}
    trainer = Trainer(cfg, tmp_path, DistInfo(), Loggers(tmp_path), optim=OptimConfig(lr=1e-3),
                      sched=ConstantSched(warmup_epochs=0), config=config, seed=0)
    return trainer, trainer.fit(task, data)


class RecordingTask(ClassificationTask):
    """Classification that keeps the context of every end-of-epoch call."""

    def __init__(self):
        super().__init__(model_config("plain_vit_nano"), ATTENTION_PRESET)
        self.contexts = []

    def on_epoch_end(self, ctx):
        self.contexts.append(ctx)
        return {"val/extra": 1.0}


def test_fit_writes_summary_checkpoint_and_gives_tasks_an_epoch_context(tmp_path):
    torch.set_num_threads(1)
    task = RecordingTask()
    trainer, summary = _fit(tmp_path, task, DigitsData(img_size=16), epochs=2, max_steps=None, batch_size=256,
                            ema={"enabled": True, "warmup": True})
    assert summary["steps"] == trainer.step == 2 * trainer.parts.loaders.steps_per_epoch
    assert summary["epochs"] == 2 and summary["val/extra"] == 1.0
    for key in ("model", "params", "wall_time_s", "train_time_s", "images_per_sec", "compile_time_s",
                "throughput_warmup_steps", "nonfinite_skipped", "skipped_images", "routing_warnings",
                "val/acc1", "val_ema/acc1", "best/val/acc1", "best/epoch", "attention", "checkpoint"):
        assert key in summary, key
    assert summary["attention"] == "preset" and "train/skipped_images" not in summary  # digits never skip

    contexts = task.contexts
    assert [c.epoch for c in contexts] == [0, 1] and [c.last_epoch for c in contexts] == [False, True]
    ctx = contexts[-1]
    assert isinstance(ctx, EpochContext) and ctx.is_main and ctx.out_dir == tmp_path
    assert ctx.model_for_eval is trainer.parts.ema.module, "the EMA model when the run keeps one"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.epoch = 5

    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert set(state) == {"format", "model", "optimizer", "scaler", "step", "epoch", "batch_in_epoch", "rng",
                          "world_size", "best", "counters", "skipped_files", "throughput", "meters", "config",
                          "model_name", "wandb_run_id", "model_ema", "ema_updates", "step_metrics"}
    assert state["step"] == summary["steps"] and state["epoch"] == 2 and state["batch_in_epoch"] == 0
    assert state["ema_updates"] == summary["steps"]
    assert set(state["throughput"]) == {"time", "samples", "steps", "data_wait", "warmup_time", "warmup_samples",
                                        "warmup_steps", "warmup_data_wait", "peak_memory_mb"}
    assert state["skipped_files"] == {"train": {}, "val": {}}
    assert (tmp_path / "checkpoints" / "best.pt").is_file() and (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "metrics.csv").read_text().count("\n") > 2

    # a rerun in the same directory resumes at the end: nothing to train, the summary is kept
    rerun_task = RecordingTask()
    rerun, again = _fit(tmp_path, rerun_task, DigitsData(img_size=16), epochs=2, max_steps=None, batch_size=256,
                        ema={"enabled": True, "warmup": True})
    assert rerun.steps_at_start == rerun.step == summary["steps"] and rerun_task.contexts == []
    assert again == read_summary(tmp_path)


def test_a_fit_says_where_its_time_goes(tmp_path, caplog):
    """Data wait, step time, TFLOP/s and peak memory in every window, epoch, summary.json and the console;
    consistent (data wait <= step time, TFLOP/s = training FLOPs x images/s); utilisation absent on a CPU."""
    import csv
    import logging

    torch.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="moh_vision.engine.trainer"):
        _, summary = _fit(tmp_path, ClassificationTask(model_config("plain_vit_nano"), ATTENTION_PRESET),
                          DigitsData(img_size=16), max_steps=3, count_flops=True)
    assert summary["train_gflops_per_image"] == pytest.approx(6 * summary["active_gflops"])
    assert 0 <= summary["data_wait_ms"] <= summary["step_ms"]
    assert summary["data_wait_share"] == pytest.approx(summary["data_wait_ms"] / summary["step_ms"])
    assert summary["tflops"] == pytest.approx(summary["train_gflops_per_image"] * summary["images_per_sec"] / 1e3)
    assert summary["peak_memory_mb"] > 0 and "ru_maxrss" in summary["peak_memory_source"]
    assert summary["device"].startswith("cpu") and summary["precision"] == "fp32"
    assert "utilisation" not in summary and "device_peak_tflops" not in summary, "no peak is known for a CPU"

    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    windows = [r for r in rows if r.get("train/loss")]
    assert len(windows) == 3
    for r in windows:
        assert 0 <= float(r["train/data_wait_ms"]) <= float(r["train/step_ms"])
        assert float(r["train/tflops"]) == pytest.approx(
            summary["train_gflops_per_image"] * float(r["train/images_per_sec"]) / 1e3)
    epoch = next(r for r in rows if r.get("val/acc1"))
    assert float(epoch["epoch/peak_memory_mb"]) > 0 and float(epoch["epoch/step_ms"]) > 0
    assert float(epoch["epoch/tflops"]) > 0

    console = caplog.text
    assert "epoch 0 time: step" in console and "where the time went: step" in console
    for words in ("data wait", "TFLOP/s (no device peak: utilisation not reported)", "peak memory", "costs: "):
        assert words in console, words


def test_without_a_flop_count_the_rates_have_no_tflops(tmp_path):
    torch.set_num_threads(1)
    _, summary = _fit(tmp_path, ClassificationTask(model_config("plain_vit_nano"), ATTENTION_PRESET),
                      DigitsData(img_size=16), max_steps=1)
    assert summary["step_ms"] > 0 and "peak_memory_mb" in summary
    assert not any("tflops" in key or "utilisation" in key or "gflops" in key for key in summary)
