"""Time a training checkpoint's save (what blocks the loop: at once, or in the background) and load (mmap or not).

    python tools/bench_checkpoint.py                                   # the default model (transnext_nano)
    python tools/bench_checkpoint.py models=transnext_nano,dit_b_2 rounds=5 out=docs/bench/<folder>/checkpoint.json
    python tools/bench_checkpoint.py models=dit_s_2 rounds=1            # a few seconds

For each model (timm's defaults), a state as the trainer saves it (weights, EMA weights, AdamW's moments, progress):
the file's size; the seconds a save blocks the loop with ``trainer.ckpt_async=false`` (``last.pt`` with a linked
``step_N.pt``: one serialisation; beside it the two serialisations of earlier releases) and ``true`` (the host copy);
the background write's whole time; a fixed amount of work on the training thread alone and during a background
write; and a resume's load (the file read and the weights copied in) with and without ``mmap``. Median and
quartiles over the rounds. The files go to a temporary folder (``root``: under that folder). How it times:
:mod:`moh_vision.analysis.checkpoint_bench`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from moh_vision.analysis.checkpoint_bench import bench_checkpoint
from moh_vision.cli import Option, integer, list_of, run_tool, text

OPTIONS = (
    Option("models", ["transnext_nano"], list_of(text), "model names (timm's registry, this project's included)"),
    Option("rounds", 3, integer, "timed rounds", minimum=1),
    Option("root", help="write the files under this folder (default: the system's temporary folder)"),
    Option("out", help="write the record (JSON) here"),
)


def bench(opts) -> dict:
    return bench_checkpoint(opts.models, opts.rounds, opts.root, opts.out)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
