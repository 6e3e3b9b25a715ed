"""This codebase's backbones against timm peers of similar FLOPs, in one interleaved run.

    python tools/bench_backbones.py                                  # TransNeXt-Micro/PVTv2-b1, TransNeXt-T/Swin-T
    python tools/bench_backbones.py pairs=big device=cuda batch=64 dtype=bfloat16 compile=false,true
    python tools/bench_backbones.py pairs=transnext_micro:pvt_v2_b1 threads=1 batch=4 rounds=5 out=b.md
    python tools/bench_backbones.py quick=true                       # tiny models at 64 px (CI smoke test)

Each ``ours:peer`` pair is built at one image size and timed interleaved, round by round: a training step
(forward, loss, backward, AdamW) and inference (eval, no gradients). Per pair: GFLOPs per image of both (the
project's fvcore count), ms per step, "x peer" (ours/peer in the same round) as median [quartiles], that
ratio per GFLOP (x peer over the GFLOPs ratio: 1.0 means ours costs what its FLOPs predict), images/s, the
MiB per image that autograd saves for backward (``saved``; parameters excluded, machine-independent) and,
on CUDA, the training peak memory. ``pairs=big`` adds TransNeXt-S/Swin-S and TransNeXt-B/Swin-B to the
default two. ``compile=false,true`` times each pair eager and compiled. ``profile=true`` adds where a
training step's time goes: each model's operators (CUDA: kernels) by self time. ``components=true`` times
our models' pieces alone, per stage, under every implementation that runs on the device (the depthwise
convolution, the aggregated attention). ``kernels.<key>=<value>`` sets our models' kernels config (as ``train.py``
takes it). ``out=t.md`` also writes ``t.json`` (every number, torch and timm versions, the machine, the options).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from moh_vision.analysis.backbone_bench import bench_backbones
from moh_vision.analysis.benchmark import TIMING_OPTIONS
from moh_vision.cli import Option, boolean, integer, list_of, run_tool, text

OPTIONS = (
    Option("pairs", type=list_of(text), help="ours:peer pairs, or a set: default | big | quick "
           "(default: transnext_micro:pvt_v2_b1,transnext_tiny:swin_tiny_patch4_window7_224)"),
    Option("batch", type=integer, minimum=1, help="images per step (default 2; quick: 1)"),
    Option("img_size", type=integer, minimum=32, help="image side in pixels (default 224; quick: 64)"),
    Option("rounds", type=integer, minimum=1, help="timed rounds, each runs both models once (default 15; quick: 2)"),
    Option("warmup", type=integer, minimum=0, help="untimed steps per model first (default 2; quick: 1)"),
    *TIMING_OPTIONS,
    Option("compile", [False], list_of(boolean), "torch.compile both models (compilation untimed); "
           "false,true: each pair both ways"),
    Option("compile_mode", "default", help="torch.compile's mode (reduce-overhead: CUDA graphs)",
           choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
    Option("saved", type=boolean, help="measure the bytes saved for backward per image (default: on the CPU)"),
    Option("quick", False, boolean, "tiny models at 64 px, batch 1, 2 rounds (smoke test)"),
    Option("profile", False, boolean, "also each model's top operators (CUDA: kernels) by self time in one step"),
    Option("components", False, boolean, "also time each of our models' pieces alone (the depthwise convolution, "
           "the aggregated attention, each implementation) per stage"),
    Option("kernels.*", type=text, help="one entry of our models' kernels config, e.g. kernels.depthwise=triton"),
    Option("out", help="also write the markdown table here, and every number as JSON beside it (.json)"),
)


def bench(opts) -> List[Dict]:
    return bench_backbones(opts.pairs, opts.batch, opts.img_size, opts.rounds, opts.warmup, opts.min_seconds,
                           opts.device, opts.dtype, opts.threads, opts.compile, opts.compile_mode, opts.saved,
                           opts.quick, opts.out, opts.profile, opts.components, opts.kernels_options)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
