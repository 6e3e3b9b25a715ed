#!/usr/bin/env python
"""Encode an image-folder tree (the train split) into VAE latent shards for ``data=latents``.

    python tools/extract_latents.py data=/data/imagenet vae=/models/sd-vae-ft-ema out=/data/in256_latents
    torchrun --nproc_per_node=8 tools/extract_latents.py data=/data/imagenet/train \\
        vae=/models/sd-vae-ft-ema out=/data/in256_latents batch_size=64 num_workers=8

``data`` is a class-folder tree: ``<data>/train/<class>/*.jpg`` or ``<data>/<class>/*.jpg``. Rerunning the
same command skips finished shards; under torchrun every rank encodes every WORLD_SIZE-th shard
(:mod:`moh_vision.data.extract_latents`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from moh_vision.cli import Option, boolean, integer, number, run_tool
from moh_vision.data.extract_latents import DTYPES, Extraction, extract_latents
from moh_vision.engine.distributed import process_info

OPTIONS = (
    Option("data", required=True, help="class-folder tree (its train/ split when there is one)"),
    Option("vae", required=True, help="local diffusers AutoencoderKL directory (never downloaded)"),
    Option("out", required=True, help="output directory (shards + index.json)"),
    Option("image_size", 256, integer, "center-crop side in pixels", minimum=8),
    Option("batch_size", 32, integer, "images per encoder call and process", minimum=1),
    Option("shard_size", 10_000, integer, "images per shard file", minimum=1),
    Option("num_workers", 4, integer, "image-decoding workers per process", minimum=0),
    Option("flip", True, boolean, "also store the horizontal-flip copies"),
    Option("device", "auto", help="auto | cuda | cpu (cuda:LOCAL_RANK under torchrun)"),
    Option("dtype", "fp32", choices=tuple(DTYPES), help="encoder precision"),
    Option("scale_factor", type=number, help="latent scale recorded in the index (default: the VAE's, 0.18215)"),
    Option("progress", True, boolean, "show a progress bar"),
)


def extract(opts) -> int:
    job = Extraction(**{k: v for k, v in opts.items() if k != "device"})
    info = process_info(opts.device)
    extract_latents(job, info.device, info.rank, info.world_size)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(extract, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
