"""Each comparison end to end on tiny settings, in this process: the multirun (two seeds, one epoch of one
step), run the way the configs' comments say (seeds on the command line, as one lane), then the report:
its verdict against the dense arm and its convergence flags."""
import csv
import json

import pytest
import torch

from helpers import load_tool, save_untrained_classifier
from moh_vision.apps.sweep_report import load_jobs

TINY = ("trainer.epochs=1", "trainer.max_steps=1", "trainer.batch_size=16", "trainer.progress=false",
        "trainer.log_every=1", "data.val_fraction=0.05")  # 90 validation digits


def report(root, *words):
    assert load_tool("sweep_report").main([f"dir={root}", *words]) == 0
    rows = {r["arm"]: r for r in csv.DictReader(open(root / "sweep_report.csv"))}
    return rows, json.loads((root / "sweep_report.json").read_text()), (root / "sweep_report.md").read_text()


def test_classification_comparison_through_the_report(train_in_process, tmp_path):
    arms = ["mha", "moh_50", "moa_matched"]  # dense, MoH, MoA (the other MoH arms differ by their ratio alone)
    code, err = train_in_process("experiment=compare_attention", f"+experiment/compare={','.join(arms)}", "seed=0,1",
                                 *TINY, f"hydra.sweep.dir={tmp_path}")
    assert code == 0, err[-3000:]
    # the command line's arms and seeds replace the config's
    assert sorted(p.parent.name.split("_", 1)[1] for p in tmp_path.glob("*/summary.json")) == \
        sorted(f"compare={arm},seed={seed}" for arm in arms for seed in (0, 1))
    rows, data, table = report(tmp_path)
    assert sorted(rows) == sorted(arms) and all(r["seeds"] == "2" for r in rows.values())
    assert data["metric"] == "val_ema/acc1" and data["reference"] == "mha" and rows["mha"]["verdict"] == "reference"
    for arm in arms[1:]:  # one step from a random init: chance-level arms, differences wide of a 0.5 margin
        assert rows[arm]["verdict"] in ("inconclusive", "within margin") or \
            rows[arm]["verdict"].startswith(("worse by", "better by")), rows[arm]
        assert rows[arm]["vs_ref dof"] != "" and float(rows[arm]["vs_ref low"]) <= float(rows[arm]["vs_ref high"])
    # one evaluation per run: no history to judge convergence by (the report's own tests flag stalled runs)
    assert all(r["converged"] == "" for r in rows.values()) and "NOT CONVERGED" not in table
    assert all(j["convergence"] is None for j in data["jobs"])
    assert float(rows["moa_matched"]["active_gflops mean"]) == pytest.approx(
        float(rows["moh_50"]["active_gflops mean"]), rel=7e-3)
    assert (tmp_path / "sweep_report.png").is_file()


@pytest.fixture
def untrained_digits_classifier(monkeypatch, tmp_path):
    """A cached (random) digits classifier for 8x8 (the runs' size), so that the sample metrics do not train one."""
    from moh_vision.analysis.metrics import classifier_cache_path
    monkeypatch.setenv("MOH_VISION_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(1)
    return save_untrained_classifier(classifier_cache_path(8), 8)


def test_diffusion_comparison_through_the_report(train_in_process, untrained_digits_classifier, tmp_path):
    arms = ["mha", "moh_90"]  # the dense DiT and one MoH-DiT (moh_75 differs by its ratio alone)
    out = tmp_path / "sweep"
    sampling = ("data.img_size=8", "task.sample.steps=ddim2", "task.sample.eval_per_class=2", "task.sample.per_class=1",
                "task.sample.batch_size=20")
    code, err = train_in_process("experiment=compare_diffusion", f"+experiment/compare={','.join(arms)}",
                                 "seed=0,1", *TINY, *sampling, f"hydra.sweep.dir={out}")
    assert code == 0, err[-3000:]
    assert sorted(p.parent.name.split("_", 1)[1] for p in out.glob("*/summary.json")) == \
        sorted(f"compare={arm},seed={seed}" for arm in arms for seed in (0, 1))
    rows, data, table = report(out)  # sample/class_acc, and sample/fd_digits without asking
    assert sorted(rows) == sorted(arms) and all(r["seeds"] == "2" for r in rows.values())
    assert data["metric"] == "sample/class_acc" and data["reference"] == "mha" and data["higher_is_better"]
    assert all(r["verdict"] for r in rows.values()) and rows["mha"]["verdict"] == "reference"
    assert all(0 <= float(r["sample/class_acc mean"]) <= 100 for r in rows.values())
    assert all(float(r["sample/fd_digits mean"]) > 0 for r in rows.values())
    # MoH-DiT 0.9 with 8 heads in every block: 7 of 8 active (with the preset's 4 it would be all 4)
    assert float(rows["moh_90"]["active_gflops mean"]) < float(rows["mha"]["active_gflops mean"])
    assert {j["summary"].get("active_head_fraction") for j in load_jobs(out) if j["arm"] == "moh_90"} == {0.875}
    # the sample metrics are computed once, at the end: no convergence history, no flag
    assert all(r["converged"] == "" for r in rows.values()) and "NOT CONVERGED" not in table
    # Frechet distance: lower is better, and the report knows it
    _, fd, _ = report(out, "metric=sample/fd_digits", "extra=active_gflops")
    assert fd["higher_is_better"] is False
