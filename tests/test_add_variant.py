"""Adding a variant is one file plus one YAML (issue 13's "done when").

A copy of ``moh.py`` registered under another name, with a copy of its YAML and no other edit, must
give what ``moh`` gives in every workflow: a continue-tuned training run (``model.init_from``), the
routing statistics it logs, a multirun sweep and its report, the FLOPs tool and the routing analysis.
The shipped example ``random_heads`` goes through the same workflows.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import FAST_TRAIN, REPO, load_tool, read_summary, run_entry
from moh_vision.engine.bookkeeping import MEASURED

COPY = "zz_test_moh_copy"  # discovered like any module of the package
RATIO = 0.5


@pytest.fixture(scope="module")
def project_copy(tmp_path_factory):
    """The project's code and configs copied to a temporary directory, where the subprocesses of this
    module run (the package on their path first, ahead of the installed one). The variant files are
    added there, never to the working tree: tests on other workers import the package meanwhile."""
    root = tmp_path_factory.mktemp("project")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("moh_vision", "configs", "tools"):
        shutil.copytree(REPO / folder, root / folder, ignore=ignore)
    for script in ("train.py", "eval.py"):
        shutil.copy2(REPO / script, root / script)
    return root


@pytest.fixture(scope="module")
def copied_variant(project_copy):
    """``cp moh.py zz_test_moh_copy.py`` + ``cp moh.yaml zz_test_moh_copy.yaml`` in the project copy, the
    registered name changed in both; registered in this process too (from the copied file, under its
    package name) for the in-process tools, and unregistered afterwards."""
    target = project_copy / "moh_vision" / "attention" / f"{COPY}.py"
    code = (REPO / "moh_vision" / "attention" / "moh.py").read_text()
    assert code.count('@register_attention("moh")') == 1
    target.write_text(code.replace('@register_attention("moh")', f'@register_attention("{COPY}")'))
    (project_copy / "configs" / "attention" / f"{COPY}.yaml").write_text(
        (REPO / "configs" / "attention" / "moh.yaml").read_text().replace("name: moh\n", f"name: {COPY}\n"))
    from moh_vision.attention import registry
    module_name = f"moh_vision.attention.{COPY}"
    try:
        spec = importlib.util.spec_from_file_location(module_name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        assert registry.variant_class(COPY).__module__ == module_name
        yield COPY
    finally:
        registry._VARIANTS.pop(COPY, None)
        sys.modules.pop(module_name, None)


@pytest.fixture(scope="module")
def sweep(project_copy, copied_variant, tmp_path_factory):
    """One multirun: moh, its copy and random_heads at ratio 0.5, each continue-tuned from the same
    dense checkpoint (a state dict of the dense transnext_nano, as released checkpoints are)."""
    import timm
    root = tmp_path_factory.mktemp("add_variant")
    torch.manual_seed(0)
    dense = timm.create_model("transnext_nano", attention="mha", in_chans=1, img_size=32, num_classes=10)
    torch.save(dense.state_dict(), root / "dense.pt")
    run_entry("train.py", "-m", f"attention=moh,{copied_variant},random_heads",
              f"attention.activation_ratio={RATIO}", f"model.init_from={root / 'dense.pt'}", *FAST_TRAIN,
              f"hydra.sweep.dir={root / 'sweep'}",
              timeout=900, root=project_copy)
    jobs = {}
    for job in (root / "sweep").iterdir():
        if (job / "summary.json").is_file():
            jobs[read_summary(job)["attention"]] = job
    assert set(jobs) == {"moh", copied_variant, "random_heads"}, sorted(jobs)
    return root, jobs


VARIANT_FREE = ("attention", "activation_ratio", "checkpoint", "wall_time_s", "train_time_s", "compile_time_s",
                *MEASURED)


def test_copy_trains_exactly_like_moh(sweep, copied_variant):
    _, jobs = sweep
    moh, copy = read_summary(jobs["moh"]), read_summary(jobs[copied_variant])
    for key in sorted(set(moh) | set(copy)):
        if key not in VARIANT_FREE:
            assert moh.get(key) == copy.get(key), key
    assert "start/val/acc1" in moh, "init_from validates the converted weights at step 0"
    assert moh["active_head_fraction"] == pytest.approx(RATIO, abs=0.1)
    # the routing statistics logged during training: metrics.csv columns and routing.json
    rows = [list(csv.DictReader(open(jobs[name] / "metrics.csv"))) for name in ("moh", copied_variant)]
    routing_cols = [k for k in rows[0][0] if k.startswith("routing/")]
    assert routing_cols, "routing statistics are logged"
    for a, b in zip(*rows):
        assert {k: a[k] for k in routing_cols} == {k: b.get(k) for k in routing_cols}
    assert json.loads((jobs["moh"] / "routing.json").read_text()) == \
        json.loads((jobs[copied_variant] / "routing.json").read_text())


def test_sweep_report_treats_the_copy_as_moh(sweep, copied_variant, tmp_path):
    root, _ = sweep
    report = load_tool("sweep_report")
    assert report.main([f"dir={root / 'sweep'}", f"out={tmp_path / 'report'}"]) == 0
    rows = {r["attention"]: r for r in csv.DictReader(open(tmp_path / "report" / "sweep_report.csv"))}
    assert set(rows) == {"moh", copied_variant, "random_heads"}
    assert float(rows[copied_variant]["activation_ratio"]) == float(rows["moh"]["activation_ratio"]) == RATIO
    assert float(rows["random_heads"]["activation_ratio"]) == RATIO
    metric_cols = [k for k in rows["moh"] if k.endswith(" mean")]
    assert metric_cols and all(rows["moh"][k] == rows[copied_variant][k] for k in metric_cols
                               if "images_per_sec" not in k and "time" not in k)


def test_flops_tool_counts_the_copy_as_moh(sweep, copied_variant):
    _, jobs = sweep
    flops = load_tool("flops")
    counted = {name: flops.main([f"run={jobs[name]}"])[0] for name in jobs}
    for key in ("gflops", "active_gflops", "params_M"):
        assert counted["moh"][key] == counted[copied_variant][key], key
    assert counted["moh"]["active_gflops"] < counted["moh"]["gflops"]
    assert counted["random_heads"]["active_gflops"] < counted["random_heads"]["gflops"]
    # and what summary.json reported during training agrees with the tool
    assert read_summary(jobs["moh"])["active_gflops"] == pytest.approx(counted["moh"]["active_gflops"])


def test_routing_analysis_of_the_copy_equals_moh(sweep, copied_variant, tmp_path):
    _, jobs = sweep
    analyze = load_tool("analyze_routing")
    results = {}
    for name in jobs:
        out = tmp_path / name
        results[name] = analyze.main([f"ckpt={jobs[name] / 'checkpoints' / 'last.pt'}", "num_images=8",
                                      "map_images=2", f"out={out}", "logger=none"])
    assert results["moh"]["layers"] == results[copied_variant]["layers"]
    assert json.loads((tmp_path / "moh" / "routing_analysis.json").read_text())["layers"] == \
        json.loads((tmp_path / copied_variant / "routing_analysis.json").read_text())["layers"]
    assert results["random_heads"]["layers"], "the example variant is analysed too"
