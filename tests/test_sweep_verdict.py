"""The sweep report's verdict: Welch's difference of means against the dense arm, the margin, and the
convergence of every run (moh_vision.apps.comparison), checked against values worked out by hand."""
import csv
import json
import math

import pytest
import yaml

from helpers import load_tool
from moh_vision.apps import comparison, sweep_report


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def test_welch_difference_with_equal_spread_uses_2n_minus_2_degrees_of_freedom():
    # arm 0, 2 (mean 1, variance 2); reference 1, 3 (mean 2, variance 2): se = sqrt(2/2 + 2/2) = sqrt(2),
    # dof = (1 + 1)^2 / (1/1 + 1/1) = 2, t(0.975, 2) = 4.3027 (tables): 95% interval -1 -+ 6.0849
    d = comparison.welch_difference([0.0, 2.0], [1.0, 3.0])
    assert d["diff"] == -1.0 and d["se"] == pytest.approx(math.sqrt(2)) and d["dof"] == pytest.approx(2.0)
    assert (d["low"], d["high"]) == (pytest.approx(-7.0849, abs=1e-4), pytest.approx(5.0849, abs=1e-4))


def test_welch_difference_with_unequal_spread_and_sizes():
    # arm 1, 2, 3, 4: mean 2.5, s^2 = 5/3, s^2/n = 0.41667; reference 2, 4, 6: mean 4, s^2 = 4, s^2/n = 1.33333
    # se = sqrt(1.75) = 1.32288; dof = 1.75^2 / (0.41667^2 / 3 + 1.33333^2 / 2) = 3.0625 / 0.94676 = 3.2347
    d = comparison.welch_difference([1, 2, 3, 4], [2, 4, 6])
    assert d["diff"] == pytest.approx(-1.5) and d["se"] == pytest.approx(1.32288, abs=1e-5)
    assert d["dof"] == pytest.approx(3.2347, abs=1e-4)
    half = (d["high"] - d["low"]) / 2
    assert d["low"] + half == pytest.approx(-1.5)
    # t(0.975, dof) lies between the tables' t(0.975, 4) = 2.776 and t(0.975, 3) = 3.182
    assert 2.776 * 1.32288 < half < 3.182 * 1.32288
    # the pooled (Student) interval would use 5 degrees of freedom: Welch's is wider here
    assert half > 2.571 * 1.32288


def test_welch_difference_edge_cases():
    one = comparison.welch_difference([98.0], [97.0, 99.0])
    assert one["diff"] == 0.0 and math.isnan(one["low"]) and math.isnan(one["high"])  # one seed: no interval
    flat = comparison.welch_difference([98.0, 98.0], [97.0, 97.0, float("nan")])
    assert (flat["diff"], flat["low"], flat["high"], flat["n_ref"]) == (1.0, 1.0, 1.0, 2)  # no spread: a point


@pytest.mark.parametrize("diff, low, high, higher_better, expected", [
    (0.1, -0.3, 0.4, True, "within margin"),
    (-0.5, -0.5, -0.5, True, "within margin"),        # the margin's edge counts as inside
    (-3.34, -4.9, -1.8, True, "worse by 3.34"),
    (1.2, 0.7, 1.7, True, "better by 1.2"),
    (-0.4, -1.1, 0.3, True, "inconclusive"),          # straddles -0.5
    (0.0, -0.6, 0.6, True, "inconclusive"),           # wider than the margin on both sides
    (0.2, 0.1, 0.7, True, "inconclusive"),            # straddles +0.5
    (-2.0, -3.0, -1.0, False, "better by 2"),         # lower-better metric (a loss, a Frechet distance)
    (2.0, 1.0, 3.0, False, "worse by 2"),
    (1.0, float("nan"), float("nan"), True, "n/a"),
])
def test_verdict_reads_the_interval_against_the_margin(diff, low, high, higher_better, expected):
    assert comparison.verdict(diff, low, high, 0.5, higher_better) == expected


def test_metric_direction():
    assert comparison.higher_is_better("val/acc1") and comparison.higher_is_better("sample/class_acc")
    assert not comparison.higher_is_better("val/loss") and not comparison.higher_is_better("sample/fd_digits")


def test_convergence_of_one_run():
    climbing = comparison.convergence([50, 80, 90, 91, 92, 93, 94, 95])
    # last five 91..95: slope 1 per evaluation, trend 4; best = final
    assert climbing["trend"] == pytest.approx(4.0) and climbing["gap"] == 0.0 and not climbing["converged"]
    plateau = comparison.convergence([50, 90, 98.1, 98.3, 98.1, 98.3, 98.1])
    # last five 98.1 98.3 98.1 98.3 98.1: slope 0; best 98.3 vs final 98.1: gap 0.2
    assert plateau["trend"] == pytest.approx(0.0, abs=1e-9) and plateau["gap"] == pytest.approx(0.2)
    assert plateau["converged"]
    peaked = comparison.convergence([90, 99.0, 98.6, 98.6, 98.6, 98.6, 98.6])  # flat, but 0.4 below its best
    assert peaked["gap"] == pytest.approx(0.4) and not peaked["converged"]
    short = comparison.convergence([97.0, 98.0])  # fewer evaluations than the window: no trend, not converged
    assert math.isnan(short["trend"]) and not short["converged"]
    loss = comparison.convergence([1.0, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4], higher_better=False)
    assert loss["best"] == 0.4 and loss["converged"]


def test_history_from_metrics_csv_rows_skips_other_rows_and_the_start():
    rows = [{"step": "0", "epoch": "-1", "val/acc1": "10"}, {"step": "10", "epoch": "0", "val/acc1": ""},
            {"step": "22", "epoch": "0", "val/acc1": "50"}, {"step": "44", "epoch": "1", "val/acc1": "70.5"}]
    assert comparison.history_from_rows(rows, "val/acc1") == [50.0, 70.5]


def test_reference_is_the_one_dense_arm_or_the_requested_one():
    assert comparison.reference_arm({"mha": 1.0, "moh_50": 0.5, "moa_matched": 0.5}) == "mha"
    assert comparison.reference_arm({"a": 1.0, "b": 1.0}) is None  # two dense arms: ambiguous
    assert comparison.reference_arm({"a": 1.0, "b": 0.5}, "b") == "b"


# ---------------------------------------------------------------------------------------------
# the report, on hand-made job directories
# ---------------------------------------------------------------------------------------------
def fake_job(root, name, attention, arm, seed, history):
    job = root / name
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"val/acc1": history[-1], "active_gflops": 0.08, "gflops": 0.084,
                                                  "params": 1000, "images_per_sec": 100.0}))
    (job / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "plain_vit_nano", "kwargs": {}},
                                                     "attention": attention, "seed": seed}))
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+experiment/compare={arm}", f"seed={seed}"]))
    with open(job / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "epoch", "train/loss", "val/acc1"])
        for epoch, value in enumerate(history):
            w.writerow([10 * epoch + 5, epoch, 1.0, ""])
            w.writerow([10 * epoch + 10, epoch, "", value])


def flat(final):
    """A run at its plateau: two epochs of climbing, then five at its final value."""
    return [60, 90] + [final] * 5


def test_report_states_verdicts_and_flags_runs_that_had_not_converged(tmp_path, capsys):
    # dense: 98, 99, 100 (mean 99, s^2 1); moh_90: 98.8, 99.0, 99.2 (mean 99, s^2 0.04): diff 0, but
    #   se = sqrt(1/3 + 0.04/3) = 0.5888, dof = 0.34667^2 / (0.33333^2/2 + 0.013333^2/2) = 2.1597,
    #   t(0.975, 2.16) > t(0.975, 3) = 3.18 -> half > 1.87: inconclusive (the dense arm's spread)
    # moh_50: 90, 91, 92 (mean 91): diff -8, se 0.8165, dof 4 -> -8 -+ 2.7764 * 0.8165 = [-10.27, -5.73]: worse by 8
    root = tmp_path / "sweep"
    moh = {"name": "moh", "activation_ratio": 0.5}
    for seed, (dense, moh_90, moh_50) in enumerate([(98, 98.8, 90), (99, 99.0, 91), (100, 99.2, 92)]):
        fake_job(root, f"mha{seed}", {"name": "mha"}, "mha", seed, flat(dense))
        fake_job(root, f"moh90_{seed}", {**moh, "activation_ratio": 0.9}, "moh_90", seed, flat(moh_90))
        # moh_50 seed 2 still climbs: 88, 89, 90, 91, 92 (best = final, trend 4)
        climbing = [50, 70, 88, 89, 90, 91, 92] if seed == 2 else flat(moh_50)
        fake_job(root, f"moh50_{seed}", moh, "moh_50", seed, climbing)
    assert load_tool("sweep_report").main([f"dir={root}"]) == 0
    printed = capsys.readouterr().out
    rows = {r["arm"]: r for r in csv.DictReader(open(root / "sweep_report.csv"))}
    assert rows["mha"]["verdict"] == "reference"
    assert float(rows["moh_50"]["vs_ref diff"]) == pytest.approx(-8.0)
    assert float(rows["moh_50"]["vs_ref dof"]) == pytest.approx(4.0)
    assert float(rows["moh_50"]["vs_ref low"]) == pytest.approx(-8 - 2.7764 * 0.81650, abs=1e-3)
    assert rows["moh_50"]["verdict"] == "worse by 8"
    assert float(rows["moh_90"]["vs_ref diff"]) == pytest.approx(0.0, abs=1e-9)
    assert float(rows["moh_90"]["vs_ref dof"]) == pytest.approx(2.1597, abs=1e-4)
    assert float(rows["moh_90"]["vs_ref high"]) > 3.18 * 0.5888
    assert rows["moh_90"]["verdict"] == "inconclusive"
    assert rows["moh_50"]["converged"] == "2/3" and rows["mha"]["converged"] == rows["moh_90"]["converged"] == "3/3"
    table = (root / "sweep_report.md").read_text()
    assert "| worse by 8 |" in table and "| inconclusive |" in table and "Δ vs mha" in table
    assert "NOT CONVERGED: 1 of 9 runs" in table and "moh_50 seed 2" in table and "moh_50 seed 2" in printed
    report = json.loads((root / "sweep_report.json").read_text())
    assert report["reference"] == "mha" and report["margin"] == 0.5 and report["higher_is_better"]
    assert report["by_arm"]["moh_50"]["verdict"] == "worse by 8" and " " not in "".join(report["by_arm"]["mha"])
    stalled = [j for j in report["jobs"] if not j["convergence"]["converged"]]
    assert [(j["arm"], j["seed"], j["convergence"]["trend"]) for j in stalled] == [("moh_50", 2, pytest.approx(4.0))]

    # a wider margin turns the comparison around; reference= picks another arm
    assert load_tool("sweep_report").main([f"dir={root}", "margin=11", "reference=moh_90"]) == 0
    rows = {r["arm"]: r for r in csv.DictReader(open(root / "sweep_report.csv"))}
    assert rows["moh_90"]["verdict"] == "reference" and rows["mha"]["verdict"] == "within margin"
    assert rows["moh_50"]["verdict"] == "within margin"  # -8 against moh_90: [-10.36, -5.64] inside +-11


def test_report_says_every_run_converged_and_within_margin(tmp_path):
    root = tmp_path / "sweep"
    for seed, (dense, moh) in enumerate([(98.0, 98.1), (98.2, 98.1), (98.1, 98.3)]):
        fake_job(root, f"d{seed}", {"name": "mha"}, "mha", seed, flat(dense))
        fake_job(root, f"m{seed}", {"name": "moh", "activation_ratio": 0.75}, "moh_75", seed, flat(moh))
    rows = {r["arm"]: r for r in sweep_report.write_sweep_report(root)}
    assert rows["moh_75"]["verdict"] == "within margin" and rows["moh_75"]["converged"] == "3/3"
    assert "Every run converged." in (root / "sweep_report.md").read_text()


def test_report_plot_shows_every_seed(tmp_path):
    root = tmp_path / "sweep"
    moh = [92.0, 92.0, 92.0, 92.0, 84.0]  # one stalled seed, far below mean - std (90.4 - 3.6)
    for seed in range(5):
        if seed < 3:
            fake_job(root, f"d{seed}", {"name": "mha"}, "mha", seed, flat(97.0 + seed))
        fake_job(root, f"m{seed}", {"name": "moh", "activation_ratio": 0.5}, "moh_50", seed, flat(moh[seed]))
    jobs = sweep_report.load_jobs(root)
    rows = sweep_report.aggregate(jobs, ["val/acc1", "active_gflops", "images_per_sec"])
    fig = sweep_report.make_figure(rows, "val/acc1", jobs)
    import matplotlib.pyplot as plt
    for ax in [ax for ax in fig.axes if ax.get_xlabel()]:
        seeds = sorted(float(y) for c in ax.collections if c.get_label() == "_seeds" for _, y in c.get_offsets())
        assert seeds == sorted(moh + [97.0, 98.0, 99.0]), ax.get_xlabel()
        low, high = ax.get_ylim()  # the axes widen to every seed, not only to mean ± std
        assert low < 84.0 and 99.0 < high, (ax.get_xlabel(), ax.get_ylim())
    plt.close(fig)
