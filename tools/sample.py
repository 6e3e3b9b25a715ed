#!/usr/bin/env python
"""Class-conditional samples from a trained DiT / MoH-DiT checkpoint, for grids and FID.

    python tools/sample.py ckpt=outputs/train/.../checkpoints/last.pt per_class=8
    torchrun --nproc_per_node=8 tools/sample.py ckpt=last.pt num_samples=50000 cfg_scale=1.5 steps=250 \\
        guidance_channels=3 out=samples/xl_90 [fid_ref=VIRTUAL_imagenet256_labeled.npz inception_weights=...]
    python tools/sample.py ckpt=last.pt num_samples=10000 sampler=dpm++ steps=25    # DPM-Solver++, 10x fewer steps

Seeds and labels as DiT's sample_ddp.py: rank r of W draws its labels (uniform) and noise from one stream seeded
seed * W + r, so the samples of a seed depend on the number of ranks and the batch size (per_class= or
labels=balanced: every class equally often, shuffled). Writes ``samples.npz`` (ADM's evaluator input), ``labels.npy``,
``samples.png`` and ``sample.json`` into ``out`` (:mod:`moh_vision.apps.sampling`); the metric inputs are checked
before the first sample, the metrics computed in float32.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from moh_vision.cli import Option, boolean, integer, number, run_tool, yaml_value
from moh_vision.diffusion.samplers import SAMPLERS
from moh_vision.apps.sampling import sample

KEEP = "(default: the checkpoint's task.sample setting)"
OPTIONS = (
    Option("ckpt", help="a diffusion checkpoint written by train.py (or model= and pretrained=)"),
    Option("model", help="released weights: the preset they belong to, e.g. dit_xl_2"),
    Option("pretrained", help="with model=: a local weights file (e.g. DiT-XL-2-256x256.pt), a Hugging Face hub id "
           "or true (where the preset's cfg says)"),
    Option("out", help="output directory (default: outputs/sample/<date>/<time>)"),
    Option("num_samples", type=integer, minimum=1, help="total (50000 for FID-50K)"),
    Option("per_class", type=integer, minimum=1, help="or this many of every class (balanced labels; "
           "8 x classes samples when neither is set)"),
    Option("labels", choices=("random", "balanced"), help="random: uniform, as DiT's sample_ddp.py draws them (the "
           "default) | balanced: every class equally, in a seeded shuffle (the default with per_class=)"),
    Option("ema", True, boolean, "sample the EMA weights (false: the raw training weights)"),
    Option("seed", 0, integer, "rank r of W draws from one stream seeded seed * W + r (DiT's sample_ddp.py)"),
    Option("batch_size", type=integer, minimum=1, help=f"samples per model call and rank {KEEP}"),
    Option("decode_batch_size", 32, integer, "latents per VAE decoder call", minimum=1),
    Option("steps", type=yaml_value,
           help=f"respaced steps: 250, ddim50, ...; sampler=dpm++(sde): solver steps, 25 {KEEP}"),
    Option("sampler", choices=SAMPLERS,
           help=f"ddpm | ddim | dpm++ (DPM-Solver++, diffusers' multistep) | dpm++sde (its SDE form) {KEEP}"),
    Option("cfg_scale", type=number, minimum=1, help=f"classifier-free guidance scale; 1 = no guidance {KEEP}"),
    Option("guidance_channels", help=f"3: guide the first 3 latent channels (DiT's sample.py) | all {KEEP}"),
    Option("clip_denoised", type=boolean, help=f"pixel space: true; latents: false {KEEP}"),
    Option("vae", help="local AutoencoderKL dir to decode latents (default: the checkpoint's task.vae.path)"),
    Option("device", "auto", help="auto | cuda | cpu (cuda:LOCAL_RANK under torchrun)"),
    Option("tf32", True, boolean, "TF32 matmuls and convolutions on Ampere+ for sampling (DiT's sample_ddp.py "
           "default); the metrics are float32 either way"),
    Option("compile", False, boolean, "torch.compile the model (its first call compiles; the rest reuse the graph)"),
    Option("progress", True, boolean, "show a progress bar"),
    Option("grid_classes", 10, integer, "rows of samples.png: classes evenly spaced over all classes", minimum=1),
    Option("grid_per_class", 8, integer, "samples per row of samples.png", minimum=1),
    Option("fid_ref", help="ADM reference batch .npz or a folder of real images: ADM's FID, sFID, IS, precision, "
           "recall (tools/evaluate_samples.py)"),
    Option("inception_weights", help="LOCAL torch-fidelity Inception weights "
           "(weights-inception-2015-12-05-6726825d.pth)"),
    Option("metrics_batch_size", 64, integer, "images per Inception call", minimum=1),
    Option("digits_classifier", help="digits: the proxy-metric classifier (default: <run dir>/digits_classifier.pt)"),
)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_tool(sample, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
