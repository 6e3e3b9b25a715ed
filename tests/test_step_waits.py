"""A training step never makes the host wait (issue 53's targets), counted on the default run: no host read of a
tensor and at most one Python collective per optimizer step outside log intervals, that one asynchronous and
waited on at a later step; in one process and with two gloo ranks. ``tests/step_waits.py`` counts; the first
tests show it sees every kind of read and would fail the loop of the code before this one (22 reads a step).
"""
import collections
import json
import sys
import warnings

import pytest
import torch
import torch.distributed as tdist

from helpers import ATTENTION_PRESET, REPO, model_config, read_summary, run_entry, trainer_config
from step_waits import StepWaits, counting_trainer, waits_outside
from moh_vision.config import ConstantSched, OptimConfig
from moh_vision.data.digits import DigitsData
from moh_vision.apps import run as run_module
from moh_vision.engine.distributed import DistInfo
from moh_vision.engine.loggers import Loggers
from moh_vision.engine.trainer import Trainer
from moh_vision.tasks.classification import ClassificationTask

pytestmark = pytest.mark.usefixtures("one_thread")

LOG_EVERY, STEPS = 5, 12
# The default run (python train.py: MoH TransNeXt-nano on the digits), shrunk to 12 steps logged every 5.
SHRUNK = (f"trainer.max_steps={STEPS}", f"trainer.log_every={LOG_EVERY}", "trainer.epochs=1", "trainer.progress=false",
          "trainer.count_flops=false")


def test_the_counter_sees_every_kind_of_read():
    step = [0]
    waits = StepWaits(lambda: step[0])
    t, item = torch.tensor([1.5]), torch.Tensor.item
    with waits.counting():
        float(t), int(t), bool(t), t.item(), t.tolist(), t.cpu(), t.numpy(), f"{t[0]:.1f}"
        step[0] = 1
        torch.ones(3).sum() * 2  # arithmetic is no read
        list(torch.utils.data.DataLoader([t, t], batch_size=2))  # input loading is left out
    assert dict(waits.reads[0]) == {"__float__": 1, "__int__": 1, "__bool__": 1, "item": 2, "tolist": 1, "cpu": 1,
                                    "numpy": 1, "__format__": 1}  # format reads through item
    assert 1 not in waits.reads
    assert torch.Tensor.item is item, "the methods are back"


def test_the_counter_sees_collectives_and_when_they_are_waited_on(tmp_path):
    step = [1]
    waits = StepWaits(lambda: step[0])
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with waits.counting():
            tdist.all_reduce(torch.ones(1))
            work = tdist.all_reduce(torch.ones(1), async_op=True)
            step[0] = 2
            work.wait()
    finally:
        tdist.destroy_process_group()
    table = waits.table()
    assert table["1"]["collectives"] == [{"name": "all_reduce", "async": False, "waited_at": None},
                                         {"name": "all_reduce", "async": True, "waited_at": 2}]
    assert waits_outside(table, 1, 1, every=LOG_EVERY) == ["step 1: 2 collectives ['all_reduce', 'all_reduce']",
                                                           "step 1: all_reduce blocks (not async_op)"]


class ReadsTheNorm(Trainer):
    """A trainer that reads its gradient norm every step, as the loop before this one did (one of its 22 reads)."""

    def _optimizer_step(self, loss_ok):
        norm, skipped = super()._optimizer_step(loss_ok)
        float(norm)
        return norm, skipped


def test_a_step_that_reads_fails_the_check(tmp_path):
    tables = []
    cfg = trainer_config(epochs=1, max_steps=4, batch_size=32, log_every=LOG_EVERY)
    task = ClassificationTask(model_config("plain_vit_nano"), ATTENTION_PRESET)
    trainer = counting_trainer(ReadsTheNorm, tables)(
        cfg, tmp_path, DistInfo(), Loggers(tmp_path), optim=OptimConfig(), sched=ConstantSched(),
        config={"attention": dict(ATTENTION_PRESET), "model": dict(task.model_cfg)})
    trainer.fit(task, DigitsData(img_size=16))
    problems = waits_outside(tables[0], 1, 3, every=LOG_EVERY)
    assert problems == [f"step {s}: host reads {{'__float__': 1}}" for s in (1, 2, 3)]


class NaNLossAt(ClassificationTask):
    """Classification whose loss is NaN at the given training calls (micro-batches), by a constant term: the
    gradients stay finite, and only the skip decision keeps the step out."""

    def __init__(self, calls):
        super().__init__(model_config("plain_vit_nano"), ATTENTION_PRESET)
        self.nan_calls, self.calls = set(calls), 0

    def training_step(self, model, batch, device):
        out = super().training_step(model, batch, device)
        self.calls += 1
        if self.calls in self.nan_calls:
            out["loss"] = out["loss"] + float("nan")
        return out


@pytest.mark.parametrize("overrides", [{"grad_accum": 2}, {"amp": "fp16"}], ids=["grad_accum", "fp16"])
def test_a_nan_micro_batch_skips_its_step_without_host_waits(tmp_path, overrides):
    """With gradient accumulation, one NaN micro-batch (the 3rd: step 1's first) skips its whole step; with fp16
    the grad scaler skips it. Either way it is counted once, the other steps train, and no step reads."""
    tables, accum = [], overrides.get("grad_accum", 1)
    task = NaNLossAt({3} if accum == 2 else {2})
    cfg = trainer_config(epochs=1, max_steps=5, batch_size=32, log_every=LOG_EVERY, **overrides)
    trainer = counting_trainer(Trainer, tables)(
        cfg, tmp_path, DistInfo(), Loggers(tmp_path), optim=OptimConfig(), sched=ConstantSched(),
        config={"attention": dict(ATTENTION_PRESET), "model": dict(task.model_cfg)})
    summary = trainer.fit(task, DigitsData(img_size=16))
    assert summary["steps"] == 5 and summary["nonfinite_skipped"] == 1 and trainer.counters["nonfinite_in_a_row"] == 0
    optimizer = trainer.parts.optimizer
    assert {float(state["step"]) for state in optimizer.state.values()} == {4.0}, "AdamW stepped the other four"
    assert all(torch.isfinite(p).all() for p in trainer.parts.model.parameters())
    assert waits_outside(tables[0], 1, 4, every=LOG_EVERY) == []


def test_the_default_run_steps_without_host_waits(tmp_path, train_in_process, monkeypatch):
    tables = []
    monkeypatch.setattr(run_module, "Trainer", counting_trainer(Trainer, tables))
    assert train_in_process(*SHRUNK, f"hydra.run.dir={tmp_path}")[0] == 0
    assert read_summary(tmp_path)["steps"] == STEPS
    assert waits_outside(tables[0], 1, STEPS - 1, every=LOG_EVERY) == []
    assert sum(tables[0][str(LOG_EVERY)]["reads"].values()) > 0, "a log step reads, and the counter sees it"


@pytest.mark.slow  # by default two gloo ranks are counted by test_run_dir.py::test_ddp_steps_do_not_wait
def test_two_gloo_ranks_step_without_host_waits(tmp_path):  # torchrun, two processes: 10 s on 2 quiet cores
    out = tmp_path / "waits.json"
    run_entry(str(REPO / "tests" / "step_waits.py"), str(out), str(REPO / "train.py"), *SHRUNK,
              "trainer.batch_size=32", f"hydra.run.dir={tmp_path / 'run'}",
              launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"))
    for rank in (0, 1):
        table = json.loads((tmp_path / f"waits.json.rank{rank}").read_text())
        assert waits_outside(table, 1, STEPS - 1, every=LOG_EVERY) == [], rank
        flags = [c for s in range(1, STEPS) if s % LOG_EVERY for c in table[str(s)]["collectives"]]
        assert [c["name"] for c in flags] == ["all_reduce"] * len(flags) and len(flags) == 9, "the preemption flag"
    assert read_summary(tmp_path / "run")["steps"] == STEPS


# The diffusion experiment shrunk as the default run is, without its sample grid and sample metrics at the end.
DIFFUSION = ("experiment=diffusion", "task.sample.per_class=0", "task.sample.eval_per_class=0")


@pytest.mark.gpu
@pytest.mark.parametrize("experiment", [(), DIFFUSION], ids=["classification", "diffusion"])
def test_cuda_steps_do_not_synchronize(tmp_path, train_in_process, monkeypatch, experiment):
    """On CUDA, torch's sync debug mode reports every operation that waits for the device, the ones no Python call
    shows too (a nonzero, a masked index, a blocking copy from pageable memory): none in a step outside log intervals,
    in either task (the diffusion step's schedules are placed on the device in the first step). The run's records say
    TF32, cuDNN benchmarking and fused AdamW."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    syncs = collections.defaultdict(list)

    class Watching(Trainer):
        def fit(self, task, data):
            def note(message, *args, **kwargs):
                if "synchroniz" in str(message):
                    syncs[self.step].append(str(message).splitlines()[0])
            previous = torch.cuda.get_sync_debug_mode()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = note
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return super().fit(task, data)
                finally:
                    torch.cuda.set_sync_debug_mode(previous)

    monkeypatch.setattr(run_module, "Trainer", Watching)
    assert train_in_process(*SHRUNK, *experiment, "trainer.device=cuda", f"hydra.run.dir={tmp_path}")[0] == 0
    assert {step: found for step, found in syncs.items() if 1 <= step < STEPS and step % LOG_EVERY} == {}
    assert syncs[LOG_EVERY], "a log step synchronises, and the debug mode sees it"
    summary = read_summary(tmp_path)
    assert (summary["tf32"], summary["cudnn_benchmark"], summary["optimizer_impl"]) == (True, True, "fused")
