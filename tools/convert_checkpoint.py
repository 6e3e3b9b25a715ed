#!/usr/bin/env python
"""Convert a released or training checkpoint into a plain tensor state dict.

    python tools/convert_checkpoint.py src=DiT-XL-2-256x256.pt dst=dit_xl_2.pt model=dit_xl_2
    python tools/convert_checkpoint.py src=results/000/checkpoints/0400000.pt dst=moh.pt model=moh_dit_xl_2_90
    python tools/convert_checkpoint.py src=DiT-XL-2-512x512.pt dst=dit_xl_2_512.pt model=dit_xl_2 model.input_size=64

Our models load the output strictly with ``weights_only=True`` (``timm.create_model(name,
checkpoint_path=...)``); formats understood: :mod:`moh_vision.models.conversion`. Exit status: 0 written,
1 it does not fit ``model`` (nothing written), 2 unreadable input or bad arguments.
"""
from __future__ import annotations

from typing import Optional, Sequence

from moh_vision.cli import Option, boolean, run_tool, yaml_value
from moh_vision.models.conversion import convert_checkpoint

OPTIONS = (
    Option("src", required=True, help="input checkpoint (.pt/.pth/.bin or .safetensors)"),
    Option("dst", required=True, help="output .pt file (written atomically)"),
    Option("model", help="registered model to validate against, e.g. dit_xl_2 or moh_dit_xl_2_90"),
    Option("model.*", type=yaml_value, help="an argument of that model, e.g. model.input_size=64 for 512px DiT"),
    Option("ema", True, boolean, "take the EMA weights when there are some (false: the raw model weights)"),
    Option("trust_pickle", False, boolean, "allow unpickling any object (runs code from the file)"),
    Option("force", False, boolean, "write even if the validation against model fails"),
)


def convert(opts) -> int:
    convert_checkpoint(opts.src, opts.dst, opts.model, opts.model_options, opts.ema, opts.trust_pickle, opts.force)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(convert, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
