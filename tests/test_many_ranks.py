"""What a cluster run relies on, checked with real processes and gloo ranks on the CPU (issue 57): every rank holds
the same model and EMA; the copies of a repeated-augmentation image are augmented differently; a rank whose batch held
only unreadable images neither hangs the others nor changes the weights; an epoch's leftover micro-batches are not
trained; validation reads the device once, not per batch; a SLURM log gets no progress bar; DDP's options are
configuration, recorded in summary.json. ``tests/rank_probe.py`` records what each process saw. The first run is a
torchrun job (its agent forked: ``helpers.torchrun``); the others' ranks are forked with the variables torchrun gives
its workers (``helpers.run_ranks``), sparing each rank the 5-7 s a fresh interpreter spends importing."""
import collections
import csv

import pytest
import torch

from helpers import REPO, TORCHRUN, read_summary, run_entry, run_ranks
from test_data_imagefolder import add_bad_files, make_tree

pytestmark = pytest.mark.usefixtures("one_thread")

PROBE = str(REPO / "tests" / "rank_probe.py")


def probe(tmp_path, ranks, *args, timeout=300, under_torchrun=False):
    """``train.py <args>`` on ``ranks`` gloo ranks, observed; (each rank's record, the run's output)."""
    out = tmp_path / "probe"
    argv = (str(out), str(REPO / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}")
    if under_torchrun:
        proc = run_entry(PROBE, *argv, launcher=(*TORCHRUN, f"--nproc_per_node={ranks}"), timeout=timeout, fork=True)
        output = proc.stdout + proc.stderr
    else:
        output = "\n".join(rank.output() for rank in run_ranks(ranks, PROBE, *argv, timeout=timeout))
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(ranks)], output


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_keep_one_model_and_one_ema(tmp_path):  # two processes: ~15 s on 2 quiet cores
    """Each rank initialises its model from its own seed; DDP broadcasts rank 0's weights when it is built and the EMA
    must start from those (the EMA built before DDP started from each rank's own weights: rank 1's differed). With
    ``grad_accum=2`` and an odd number of batches per rank the last micro-batch of an epoch is not trained (it carried
    its gradient into the next epoch's first step). Validation reads the device once per set (it read three scalars a
    batch), and the log of a run without a terminal has no progress bar. DDP's options are configuration: buffers
    broadcast only where training changes them (none here), gradients as bucket views, and torch's bf16 compression
    hook, recorded in summary.json; the validation metrics and the step times are reduced over both ranks."""
    records, output = probe(tmp_path, 2, "model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16",
                            "trainer.epochs=2", "trainer.batch_size=256", "trainer.grad_accum=2", "trainer.val_batch_size=16",
                            "trainer.ema.enabled=true", "trainer.ema.decay=0.99", "trainer.count_flops=false",
                            "trainer.ddp.comm_hook=bf16", "trainer.log_every=1", under_torchrun=True)
    first, second = records
    assert same_weights(first["model"], second["model"])
    assert same_weights(first["ema"], second["ema"]), "rank 1's EMA is not rank 0's"
    assert not same_weights(first["ema"], first["model"]), "the EMA averages: it is not the last weights"
    for record in records:
        batches = len(record["keys"][0]) // record["per_rank_batch"]
        trained = record["steps_per_epoch"] * record["accum"]
        assert batches > trained, "the scenario: a micro-batch short of a whole step at the epoch's end"
        assert record["forwards"] == {0: trained, 1: trained}
        assert record["val_batches"] >= 10 and max(record["val_reads"]) <= 4, record["val_reads"]
    assert "it/s]" not in output and "s/it]" not in output, "no progress bar in a log"
    summary = read_summary(tmp_path / "run")
    assert summary["ddp"] == {"broadcast_buffers": False, "gradient_as_bucket_view": True, "comm_hook": "bf16",
                              "bucket_cap_mb": None}
    assert summary["val/count"] == 359, "validation metrics are all-reduced over both ranks"
    # the slowest rank's times (one all-reduce per window, per epoch and for the summary)
    assert 0 <= summary["data_wait_ms"] <= summary["step_ms"] and summary["peak_memory_mb"] > 0
    windows = [r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r.get("train/loss")]
    assert len(windows) == summary["steps"] >= 2
    assert all(0 <= float(r["train/data_wait_ms"]) <= float(r["train/step_ms"]) for r in windows)


IMAGES = ("data=imagefolder", "model=plain_vit_nano", "+model.kwargs.depth=2", "data.img_size=16", "data.mixup=0",
          "data.cutmix=0", "trainer.count_flops=false", "trainer.num_workers=0")


def test_the_copies_of_a_repeated_image_are_augmented_differently(tmp_path):  # three processes: ~20 s
    """DeiT's repeated augmentation x3 on three ranks: each image of the epoch is on every rank (a third of the set per
    epoch, as DeiT's sampler), and no two ranks trained on the same augmented image (each copy's augmentation seed had
    no copy number: all three were byte-identical)."""
    root = make_tree(tmp_path / "data", n_train=8)
    records, _ = probe(tmp_path, 3, *IMAGES, f"data.root={root}", "data.repeated_aug=3", "trainer.epochs=1",
                       "trainer.batch_size=12")
    copies = collections.Counter(index for record in records for index, _ in record["keys"][0])
    assert set(copies.values()) == {3} and len(copies) == 8, "the scenario: every image on three ranks"
    seen = [{h for _, hashes in record["images"] for h in hashes} for record in records]
    assert all(len(s) == 8 for s in seen), "each rank trained on 8 distinct images"
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def test_a_rank_whose_batch_is_all_unreadable_keeps_in_step(tmp_path):  # two processes: ~15 s (it hung before)
    """One image per rank and a quarter of the files unreadable: a rank whose batch lost its only image runs a zero
    step through the DDP model, so the other rank's gradient all-reduce completes; the ranks stay identical."""
    root = make_tree(tmp_path / "data", n_train=3)
    add_bad_files(root)  # 3 of the 12 training files
    records, _ = probe(tmp_path, 2, *IMAGES, f"data.root={root}", "data.repeated_aug=1", "trainer.epochs=3",
                       "trainer.batch_size=2", timeout=240)
    empty = [epoch for record in records for epoch, hashes in record["images"] if not hashes]
    assert empty, "the scenario: some rank met a batch of unreadable images only"
    assert same_weights(records[0]["model"], records[1]["model"])
    summary = read_summary(tmp_path / "run")
    assert summary["steps"] == 3 * 6 and summary["skipped_images"] == 3  # the unreadable files, each named once


def test_streamed_shards_give_every_rank_the_same_steps(tmp_path):  # two processes: ~20 s
    """``data.source=wds`` on two ranks whose shards hold different numbers of images (3 shards of 9 images: rank 0
    reads two, rank 1 one): every rank takes the same number of steps each epoch (a rank that ran out first would leave
    the other in its gradient all-reduce) and the ranks stay identical. (On so small a set every rank's shuffle buffer
holds copies of every shard, so the ranks' images are not disjoint here, only in a different order.)"""
    import fixtures_sources as fx
    root = fx.wds_shards(fx.make_tree(tmp_path / "tree"), tmp_path / "wds", shards=(3, 1))
    records, _ = probe(tmp_path, 2, *IMAGES, f"data.root={root}", "data.source=wds",
                       "data.repeated_aug=1", "trainer.epochs=2", "trainer.batch_size=4", "data.index_cache=null",
                       timeout=240)
    assert records[0]["forwards"] == records[1]["forwards"] == {0: 2, 1: 2}, "9 images, 2 ranks of 2: 2 steps each"
    assert same_weights(records[0]["model"], records[1]["model"])
    for epoch in range(2):
        seen = [[h for e, hashes in record["images"] if e == epoch for h in hashes] for record in records]
        assert len(seen[0]) == len(seen[1]) == 4 and seen[0] != seen[1], seen
    assert read_summary(tmp_path / "run")["steps"] == 4
