"""FID during training (task.sample.fid_every_steps, fid_at_checkpoints; moh_vision.tasks.diffusion_fid): real train.py
runs on the digits with a random Inception at 75 px (tests/small_inception.py) and a made-up reference batch; the rows
with their steps in metrics.csv and summary.json; every metric input checked before the first step."""
import csv
import math
import sys

import numpy as np
import pytest

from helpers import REPO, read_summary, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ("experiment=diffusion", "trainer.epochs=1", "trainer.batch_size=16", "trainer.progress=false",
        "trainer.num_workers=0", "trainer.log_every=1", "data.img_size=8", "task.sample.per_class=0",
        "task.sample.eval_per_class=0", "task.sample.every_epochs=0", "trainer.count_flops=false")
WRAPPER = "tests/small_inception.py"


@pytest.fixture
def reference(tmp_path):
    path = tmp_path / "ref.npz"
    np.savez(path, arr_0=np.random.default_rng(0).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8))
    return path


def fid_options(reference, weights, *more):
    return (f"task.sample.fid_ref={reference}", f"task.sample.inception_weights={weights}",
            "task.sample.fid_samples=4", "task.sample.batch_size=2", "task.sample.fid_steps=2", *more)


def fid_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("fid/fid")]


def test_a_run_logs_fid_with_its_steps_every_n_steps_and_at_numbered_checkpoints(tmp_path, reference, tiny_inception,
                                                                                   train_in_process):
    run = tmp_path / "run"
    code, err = train_in_process(*TINY, "trainer.max_steps=3", f"hydra.run.dir={run}",
                                 *fid_options(reference, tiny_inception, "task.sample.fid_every_steps=3",
                                              "task.sample.fid_at_checkpoints=true",
                                              "trainer.ckpt_history_every_steps=2"))
    assert code == 0, err
    rows = fid_rows(run)
    assert [int(row["step"]) for row in rows] == [2, 3]  # 2: a numbered checkpoint; 3: every 3 steps
    for row in rows:
        for key in ("fid/fid", "fid/sfid", "fid/inception_score", "fid/precision", "fid/recall", "fid/seconds"):
            assert math.isfinite(float(row[key])), key
        assert float(row["fid/seconds"]) > 0 and float(row["fid/num_samples"]) == 4
    summary = read_summary(run)
    assert [entry["step"] for entry in summary["step_metrics"]] == [2, 3]
    assert summary["fid/fid"] == pytest.approx(float(rows[-1]["fid/fid"])) and summary["step_metrics_step"] == 3
    assert summary["step_metrics"][0]["fid/fid"] == pytest.approx(float(rows[0]["fid/fid"]))
    log = (run / "train.log").read_text()
    assert "FID at step 3: sampling 4 images (dpm++, 2 steps, guidance 2) on 1 rank(s)" in log
    assert not list((run / "fid").glob(".parts-*"))  # the shared samples are removed once scored


@pytest.mark.parametrize("case,words,message", [
    ("no_ref", ("task.sample.fid_every_steps=1",), "FID during training needs task.sample.fid_ref and "
                                                   "task.sample.inception_weights"),
    ("missing_ref", ("task.sample.fid_every_steps=1", "task.sample.fid_ref=missing.npz",
                     "task.sample.inception_weights=WEIGHTS"), "task.sample.fid_ref="),
    ("bad_steps", ("task.sample.fid_at_checkpoints=true", "task.sample.fid_ref=missing.npz",
                   "task.sample.inception_weights=WEIGHTS", "task.sample.fid_steps=ddim50"),
     "sampler=dpm++ takes steps=<number of solver steps>"),
])
def test_what_the_fid_needs_is_one_error_line_before_the_first_step(case, words, message, tmp_path, train_in_process,
                                                                     random_inception_weights):
    run = tmp_path / "run"
    words = [w.replace("WEIGHTS", str(random_inception_weights)) for w in words]
    code, err = train_in_process(*TINY, "trainer.max_steps=2", f"hydra.run.dir={run}", *words)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert not (run / "checkpoints" / "last.pt").exists()


@pytest.mark.slow
def test_two_ranks_share_the_samples_and_log_one_fid_row(tmp_path, reference, random_inception_weights):
    run = tmp_path / "run"
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    run_entry(WRAPPER, str(REPO / "train.py"), *TINY, "trainer.max_steps=2", f"hydra.run.dir={run}",
              *fid_options(reference, random_inception_weights, "task.sample.fid_every_steps=2"),
              launcher=(*launcher, str(REPO / WRAPPER)), timeout=600)
    rows = fid_rows(run)
    assert [int(row["step"]) for row in rows] == [2]
    assert math.isfinite(float(rows[0]["fid/fid"])) and float(rows[0]["fid/num_samples"]) == 4
    assert read_summary(run)["step_metrics"][0]["step"] == 2
