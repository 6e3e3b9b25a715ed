"""How a trained MoH / MoA model routes its heads, on a few validation images.

    python tools/analyze_routing.py ckpt=outputs/<run>/checkpoints/last.pt
    python tools/analyze_routing.py ckpt=<path> num_images=32 out=routing/ map_images=4
    python tools/analyze_routing.py ckpt=<path> data=imagefolder data.root=/data/val   # other data
    python tools/analyze_routing.py ckpt=<dit run>/checkpoints/last.pt timestep=250

The checkpoint carries its config: data, task and model are rebuilt from it exactly as ``eval.py`` does
(``data=<name>`` / ``data.<key>=...`` override the data, as there). Writes head load, gate mass, router
entropy, head utility and per-token head maps (PNG), ``routing_analysis.json`` and ``selection.npz``
into ``out`` (default ``<run dir>/routing_analysis``; :mod:`moh_vision.analysis.routing_analysis`), and
logs them into the training run's own wandb run under ``routing_analysis/...``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from moh_vision.cli import Option, integer, run_tool
from moh_vision.apps.analyze_routing import analyze_checkpoint

OPTIONS = (
    Option("ckpt", required=True, help="a checkpoint written by train.py"),
    Option("num_images", 8, integer, "validation images to analyse", minimum=1),
    Option("map_images", 4, integer, "images drawn as per-token head maps", minimum=0),
    Option("batch_size", 32, integer, "images per forward", minimum=1),
    Option("device", "auto", help="auto | cpu | cuda"),
    Option("weights", "model", choices=("model", "ema"), help="which weights of the checkpoint"),
    Option("timestep", type=integer, minimum=0, help="diffusion: the noise level the DiT sees (default: half)"),
    Option("max_map_layers", 8, integer, "rows per token map, spread over depth", minimum=1),
    Option("out", help="output directory (default: <run dir>/routing_analysis)"),
    Option("logger", "auto", choices=("auto", "wandb", "none"),
           help="auto: wandb if the run logged to wandb (offline without credentials)"),
)


def analyze(opts, data_overrides) -> Dict[str, Any]:
    return analyze_checkpoint(opts.ckpt, data_overrides, opts.num_images, opts.map_images, opts.batch_size,
                              opts.device, opts.weights, opts.timestep, opts.max_map_layers, opts.out, opts.logger)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_tool(analyze, argv, OPTIONS, __doc__, passthrough=("data",))


if __name__ == "__main__":
    main()
