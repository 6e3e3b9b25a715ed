"""Where a run's time goes (issue 44): the device peaks, the rates, the step clock, and loader workers kept
across epochs that still draw each epoch's augmentation."""
import time

import pytest
import torch

from helpers import trainer_config
from moh_vision.analysis.device_peaks import (PRECISIONS, match_device, peak_tflops, run_precision,
                                              training_gflops_per_image)
from moh_vision.data.digits import DigitsData
from moh_vision.engine.bookkeeping import RunCosts, StepClock, StepTimes, peak_memory_mb
from moh_vision.engine.distributed import DistInfo
from moh_vision.engine.fit_setup import build_loaders


@pytest.mark.parametrize("name, table_entry, bf16, tf32", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 494.7),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5),
    ("NVIDIA GH200 480GB", "H100 SXM", 989.4, 494.7),
    ("NVIDIA H200", "H200 SXM", 989.4, 494.7),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0, 156.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0, 156.0),
    ("NVIDIA L40S", "L40S", 362.05, 183.0),
    ("NVIDIA L40", "L40", 181.05, 90.5),
    ("NVIDIA L4", "L4", 121.0, 60.0),
    ("NVIDIA A10", "A10", 125.0, 62.5),
    ("NVIDIA A40", "A40", 149.7, 74.8),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2, 82.6),
    ("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0, 35.6),
    ("NVIDIA RTX A6000", "RTX A6000", 154.8, 77.4),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", None, 15.7),  # no bf16 units; tf32 runs as fp32
    ("Tesla V100-PCIE-32GB", "V100 PCIe", None, 14.0),
    ("Tesla T4", "T4", None, 8.1),
])
def test_peaks_are_matched_by_the_name_torch_reports(name, table_entry, bf16, tf32):
    assert match_device(name).name == table_entry
    assert peak_tflops(name, "bf16") == bf16 and peak_tflops(name, "tf32") == tf32
    assert peak_tflops(name, "fp32") <= (tf32 or 1e9)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GeForce GTX 1080", "cpu (AMD EPYC)", ""])
def test_a_device_missing_from_the_table_has_no_peak(name):
    """Absent, not a neighbour's: A10G is not an A10, a CPU has no peak."""
    assert match_device(name) is None
    assert all(peak_tflops(name, precision) is None for precision in PRECISIONS)


def test_precision_and_training_flops_follow_the_conventions():
    assert run_precision("bf16") == "bf16" and run_precision("fp16") == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert run_precision("none") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert run_precision("none") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert training_gflops_per_image({"gflops": 1.0, "active_gflops": 0.5}) == 3.0  # 2 FLOPs per MAC, 3 passes
    assert training_gflops_per_image({}) is None
    with pytest.raises(ValueError, match="precision"):
        peak_tflops("NVIDIA H100 PCIe", "fp8")


def test_rates_are_consistent_and_absent_when_unknown():
    times = StepTimes(seconds=2.0, data_wait=0.5, steps=4, samples=256)
    costs = RunCosts({"active_gflops": 0.5}, torch.device("cpu"), "none", world_size=1)
    row = costs.rates(times, "train/")
    assert row["train/step_ms"] == 500.0 and row["train/data_wait_ms"] == 125.0
    assert row["train/data_wait_share"] == 0.25 and row["train/images_per_sec"] == 128.0
    assert row["train/tflops"] == pytest.approx(3.0 * 128 / 1e3)
    assert "train/utilisation" not in row, "a CPU has no peak"
    costs.peak_tflops = 100.0  # as a GPU of the table with 2 processes
    costs.world_size = 2
    assert costs.rates(times, "")["utilisation"] == pytest.approx(0.384 / 200)
    assert costs.rates(StepTimes(), "") == {}
    unflopped = RunCosts({}, torch.device("cpu"), "none", world_size=1)
    assert set(unflopped.rates(times, "")) == {"step_ms", "data_wait_ms", "data_wait_share", "images_per_sec"}
    assert "TFLOP/s not reported" in unflopped.text(unflopped.rates(times, ""), "")
    assert "25.0%: input-bound" in costs.text(costs.rates(times, ""), "")
    assert "128 images/s" in costs.text(costs.rates(times, ""), "")
    slow = StepTimes(seconds=6.8, data_wait=0.1, steps=2, samples=8)  # a CPU's 1.18 images/s is not "1"
    assert "1.18 images/s" in costs.text(costs.rates(slow, ""), "")
    assert peak_memory_mb(torch.device("cpu")) > 10  # this process's resident peak


def test_step_clock_times_the_wait_for_batches_inside_the_step():
    def slow_batches():
        for i in range(3):
            time.sleep(0.03)
            yield i

    clock = StepClock(torch.device("cpu"))
    laps = []
    for _ in clock.batches(slow_batches()):
        time.sleep(0.01)  # the step's own work
        laps.append(clock.lap(sync=True))
    assert len(laps) == 3
    for seconds, waited in laps:
        assert 0.03 <= waited <= seconds and seconds >= 0.04


@pytest.mark.parametrize("start_batch", [0, 3])
def test_persistent_workers_draw_each_epochs_augmentation(start_batch):
    """Workers kept across epochs (forked once) give every epoch, and an epoch resumed mid-way, the batches
    the main process computes alone: the epoch travels with each index, not in the workers' copy."""
    data = DigitsData(img_size=8)
    kept = build_loaders(trainer_config(batch_size=64, num_workers=2), data, DistInfo(), seed=1)
    alone = build_loaders(trainer_config(batch_size=64, num_workers=0), data, DistInfo(), seed=1)
    assert kept.train.persistent_workers and kept.val.persistent_workers
    kept.start_workers()  # validation's workers forked up front, with nothing to fetch
    for epoch in (0, 1, 2):
        batches = []
        for loaders in (kept, alone):
            loaders.start_epoch(epoch, start_batch)
            batches.append([x for x, _ in loaders.train][:4])
        assert all(torch.equal(a, b) for a, b in zip(*batches)), f"epoch {epoch}"
    assert sum(len(y) for _, y in kept.val) == len(data.val)
