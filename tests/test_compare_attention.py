"""experiment=compare_attention: the arms, MoA's matched compute, a shrunk multirun and its report."""
import csv
import json
import logging

import pytest
import yaml
from hydra import compose, initialize_config_dir

from helpers import REPO, load_tool
from moh_vision.apps import sweep_report

ARMS = ("mha", "moh_50", "moh_75", "moh_90", "moa_matched")
DIGITS = dict(num_classes=10, in_chans=1)  # what the classification task passes for the digits (and img_size)


def arm_config(arm):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=["experiment=compare_attention", f"+experiment/compare={arm}"])


def test_experiment_is_one_multirun_over_arms_and_seeds():
    text = yaml.safe_load((REPO / "configs" / "experiment" / "compare_attention.yaml").read_text())
    assert text["hydra"]["mode"] == "MULTIRUN"
    params = text["hydra"]["sweeper"]["params"]
    assert params["+experiment/compare"].split(",") == list(ARMS)
    assert params["seed"].split(",") == [str(seed) for seed in range(10)]
    assert sorted(p.stem for p in (REPO / "configs" / "experiment" / "compare").glob("*.yaml")) == sorted(ARMS)


def test_arms_share_backbone_data_and_recipe_and_differ_in_attention():
    cfgs = {arm: arm_config(arm) for arm in ARMS}
    for arm, cfg in cfgs.items():
        assert cfg.model.name == "plain_vit_nano" and cfg.model.kwargs.num_heads == 8 and cfg.model.kwargs.depth == 4
        assert cfg.model.kwargs.embed_dim == 64, arm
        assert cfg.data.name == "digits" and cfg.data.img_size == 16 and cfg.trainer == cfgs["mha"].trainer, arm
        assert cfg.optim == cfgs["mha"].optim and cfg.sched == cfgs["mha"].sched, arm
    assert [cfgs[a].attention.name for a in ARMS] == ["mha", "moh", "moh", "moh", "moa"]
    assert [cfgs[a].attention.get("activation_ratio") for a in ARMS[1:4]] == [0.5, 0.75, 0.9]
    assert cfgs["moa_matched"].attention.topk == 4 and cfgs["moa_matched"].model.kwargs.head_dim == 17


def active_gflops(cfg):
    from moh_vision.analysis.flop_count import count_flops
    from moh_vision.models import build_model

    size = cfg.data.img_size
    model = build_model(cfg.model.name, attention=dict(cfg.attention), **dict(cfg.model.kwargs), **DIGITS,
                        img_size=size)
    return count_flops(model, (1, size, size))["active_gflops"]


def test_moa_matches_the_active_compute_of_moh_50(caplog):
    caplog.set_level(logging.ERROR)
    flops = {arm: active_gflops(arm_config(arm)) for arm in ("mha", "moh_50", "moh_75", "moa_matched")}
    assert flops["moa_matched"] == pytest.approx(flops["moh_50"], rel=7e-3)   # 0.003226 vs 0.003247
    assert flops["moh_50"] < flops["moh_75"] < flops["mha"]


def test_shrunk_multirun_and_report(tmp_path, capsys, train_in_process):
    """2 arms x 1 seed, two steps each, through the real experiment; then the report."""
    arms = 'hydra.sweeper.params={+experiment/compare:"moh_50,moa_matched",seed:"0"}'
    assert train_in_process("experiment=compare_attention", arms, "trainer.epochs=1", "trainer.max_steps=2",
                            "trainer.batch_size=32", "trainer.progress=false", f"hydra.sweep.dir={tmp_path}")[0] == 0
    # one flat directory per job, named by its arm and seed (the group's '/' does not nest it)
    assert sorted(p.parent.name for p in tmp_path.glob("*/summary.json")) == \
        ["0_compare=moh_50,seed=0", "1_compare=moa_matched,seed=0"]
    assert load_tool("sweep_report").main([f"dir={tmp_path}"]) == 0  # in-process: no second package import
    printed = capsys.readouterr().out
    rows = {r["arm"]: r for r in csv.DictReader(open(tmp_path / "sweep_report.csv"))}
    assert sorted(rows) == ["moa_matched", "moh_50"]
    assert rows["moh_50"]["attention"] == "moh" and rows["moa_matched"]["attention"] == "moa"
    assert all(r["seeds"] == "1" and float(r["active_gflops mean"]) > 0 for r in rows.values())
    assert float(rows["moa_matched"]["active_gflops mean"]) == pytest.approx(
        float(rows["moh_50"]["active_gflops mean"]), rel=7e-3)
    assert all(float(r["images_per_sec mean"]) > 0 for r in rows.values())
    assert (tmp_path / "sweep_report.png").is_file() and "| moa_matched | plain_vit_nano | moa |" in printed


# ---------------------------------------------------------------------------------------------
# sweep_report's grouping, on hand-made job directories (no training)
# ---------------------------------------------------------------------------------------------
def fake_job(root, name, attention, acc, seed, overrides=None, gflops=0.08):
    job = root / name
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"val/acc1": acc, "active_gflops": gflops, "gflops": 0.084,
                                                  "params": 1000, "images_per_sec": 100.0 + seed}))
    (job / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "plain_vit_nano", "kwargs": {}},
                                                     "attention": attention, "seed": seed}))
    if overrides is not None:
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


def report_rows(root):
    assert load_tool("sweep_report").main([f"dir={root}"]) == 0
    return {r["arm"]: r for r in csv.DictReader(open(root / "sweep_report.csv"))}


def test_report_groups_seeds_into_arms_and_never_merges_two_moh_arms(tmp_path):
    moh = {"name": "moh", "activation_ratio": 0.5}
    for seed in (0, 1):
        fake_job(tmp_path / "sweep", f"a{seed}", moh, 90.0 + seed, seed, ["+experiment/compare=moh_50", f"seed={seed}"])
        fake_job(tmp_path / "sweep", f"b{seed}", {**moh, "activation_ratio": 0.75}, 95.0 + seed, seed,
                 ["+experiment/compare=moh_75", f"seed={seed}"])
        fake_job(tmp_path / "sweep", f"c{seed}", {"name": "mha"}, 97.0, seed, ["+experiment/compare=mha", f"seed={seed}"])
    rows = report_rows(tmp_path / "sweep")
    assert sorted(rows) == ["mha", "moh_50", "moh_75"]
    assert [rows[a]["seeds"] for a in sorted(rows)] == ["2", "2", "2"]
    assert float(rows["moh_50"]["val/acc1 mean"]) == 90.5 and float(rows["moh_75"]["val/acc1 mean"]) == 95.5
    assert float(rows["moh_50"]["val/acc1 std"]) == pytest.approx(0.7071, abs=1e-4)
    # 95% interval of the mean, Student's t with 1 degree of freedom: 12.706 * 0.7071 / sqrt(2)
    assert float(rows["moh_50"]["val/acc1 ci95"]) == pytest.approx(6.353, abs=1e-3)
    assert rows["moh_50"]["val/acc1 per_seed"] == "90 / 91" and float(rows["mha"]["val/acc1 ci95"]) == 0.0
    table = (tmp_path / "sweep" / "sweep_report.md").read_text()
    assert "| 90.5 ± 0.7071 | [84.15, 96.85] | 90 / 91 |" in table

    # no Hydra records: two MoH configs with explicit heads (no ratio) are still two arms
    for seed in (0, 1):
        fake_job(tmp_path / "plain", f"x{seed}", {"name": "moh", "shared_heads": 2, "topk": 2}, 90.0, seed)
        fake_job(tmp_path / "plain", f"y{seed}", {"name": "moh", "shared_heads": 1, "topk": 3}, 80.0, seed)
    rows = report_rows(tmp_path / "plain")
    assert len(rows) == 2 and all(r["seeds"] == "2" for r in rows.values())
    assert sorted(float(r["val/acc1 mean"]) for r in rows.values()) == [80.0, 90.0]


def test_report_plot_has_one_colour_per_attention_and_readable_ticks(tmp_path):
    """A family without points in one panel (moa: no images/s) must not shift the others' colours, and
    long x values (active GFLOPs 0.0039626...) must not print their tick labels over each other."""
    for i, (name, ratio) in enumerate([("mha", None), ("moa", 0.5), ("moh", 0.5), ("moh", 0.75), ("moh", 0.9)]):
        attention = {"name": name, **({"activation_ratio": ratio} if ratio else {})}
        overrides = [f"attention={name}"] + ([f"attention.activation_ratio={ratio}"] if ratio else [])
        fake_job(tmp_path, f"j{i}", attention, 85.0 + i, 0, overrides, gflops=0.0039626 + 0.000015 * i)
        if name == "moa":
            summary = json.loads((tmp_path / f"j{i}" / "summary.json").read_text())
            (tmp_path / f"j{i}" / "summary.json").write_text(json.dumps({**summary, "images_per_sec": float("nan")}))
    jobs = sweep_report.load_jobs(tmp_path)
    rows = sweep_report.aggregate(jobs, ["val/acc1", "active_gflops", "images_per_sec"])
    fig = sweep_report.make_figure(rows, "val/acc1")
    fig.canvas.draw()
    from matplotlib.colors import to_hex
    colours = {}
    axes = [ax for ax in fig.axes if ax.get_xlabel()]
    assert len(axes) == 3
    for ax in axes:
        for container in ax.containers:
            attention = container.get_label().split(" / ")[-1]
            colours.setdefault(attention, set()).add(to_hex(container.lines[0].get_color()))
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert len(labels) >= 2
        boxes = sorted((t.get_window_extent() for t in labels), key=lambda b: b.x0)
        for left, right in zip(boxes, boxes[1:]):
            assert not left.overlaps(right), (ax.get_xlabel(), [t.get_text() for t in labels])
    assert sorted(colours) == ["mha", "moa", "moh"]
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == 3
    import matplotlib.pyplot as plt
    plt.close(fig)
