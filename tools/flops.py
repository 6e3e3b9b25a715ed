"""Parameters, dense-equivalent and active GFLOPs of registered models, as one table.

    python tools/flops.py model=transnext_tiny,moh_transnext_small_80
    python tools/flops.py model=dit_xl_2 attention=moh attention.activation_ratio=0.5
    python tools/flops.py model=plain_vit_base img_size=384 format=csv out=flops.csv
    python tools/flops.py model=all            # every registered model, native resolution
    python tools/flops.py model=transnext_nano in_chans=1
    python tools/flops.py run=outputs/train/2025-01-01/12-00-00   # the model exactly as that run built it

Without ``attention`` a model keeps its own (the MoH presets their official per-layer heads, the others
dense ``mha``). What is counted: :mod:`moh_vision.apps.flops_table`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from moh_vision.apps.flops_table import flops_table
from moh_vision.cli import Option, attention_config, integer, list_of, run_tool, text, yaml_value

OPTIONS = (
    Option("model", type=list_of(text), help="registered model names, or all"),
    Option("attention", help="mha | moh | moa | ... (options from configs/attention/<name>.yaml)"),
    Option("attention.*", type=yaml_value, help="one option of that attention, e.g. attention.activation_ratio=0.5"),
    Option("img_size", type=integer, minimum=1, aliases=("data.img_size",),
           help="image side in pixels (default: the model's native resolution; DiT: pixels, latent = 1/8)"),
    Option("in_chans", type=integer, minimum=1, aliases=("data.in_chans",),
           help="input channels (default: the model's own; digits runs: 1)"),
    Option("run", help="a run directory or train.py checkpoint: count the model as that run built it"),
    Option("device", "cpu", help="device the models are built on"),
    Option("format", "md", choices=("md", "csv"), help="table format"),
    Option("out", help="also write the table to this file"),
)


def count(opts) -> List[Dict[str, Any]]:
    return flops_table(opts.model or (), attention_config(opts.attention, opts.attention_options), opts.img_size,
                       opts.in_chans, opts.run, opts.device, opts.format, opts.out)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    return run_tool(count, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
