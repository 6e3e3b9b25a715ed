#!/usr/bin/env python
"""Turn a dense TransNeXt / DiT / plain-ViT checkpoint into a MoH model of the same backbone, and measure it.

    # TransNeXt-Base -> MoH-ViT-B 75% (same heads per stage: the official preset), step-0 drop on ImageNet
    python tools/convert_dense_to_moh.py dense=transnext_base_224_1k.pth model=moh_transnext_base_75 \\
        out=moh_b75_init.pt data=imagenet data.root=/data/imagenet eval_limit=10000
    # DiT-XL/2 -> the MoH-DiT-XL/2-90 budget on DiT-XL's 16 heads per block
    python tools/convert_dense_to_moh.py dense=DiT-XL-2-256x256.pt model=dit_xl_2 \\
        routing_like=moh_dit_xl_2_90 out=moh_dit_xl_90_init.pt
    # a dense digits run -> MoH at activation ratio 0.5, with the step-0 drop on the digits
    python tools/convert_dense_to_moh.py dense=outputs/.../checkpoints/last.pt model=transnext_nano \\
        activation_ratio=0.5 out=nano_moh50.pt data=digits

``data=...`` / ``data.<key>=...`` (and ``task.<key>=...``) evaluate dense and converted on that validation split
(:mod:`moh_vision.apps.dense_to_moh`). Exit status: 0 written; 1 the checkpoint does not fit the model
(nothing written); 2 bad arguments or unreadable input.
"""
from __future__ import annotations

from typing import Optional, Sequence

from moh_vision.cli import Option, boolean, integer, list_of, number, run_tool, yaml_value
from moh_vision.apps.dense_to_moh import convert_dense_to_moh
from moh_vision.models.continue_tuning import DEFAULT_ROUTER_STD

OPTIONS = (
    Option("dense", required=True, help="dense checkpoint: official state dict or our trainer's last.pt"),
    Option("model", required=True, help="target: a dense name plus routing options, or a MoH preset"),
    Option("out", required=True, help="converted state dict (.pt); a .json report beside it"),
    Option("attention", help="moh | ... | preset (default: preset for MoH presets, else moh)"),
    Option("activation_ratio", type=number, help="heads per token / heads"),
    Option("shared_heads", type=list_of(integer, single=True), help="shared heads: one, or one per layer / stage"),
    Option("topk", type=list_of(integer, single=True), help="routed heads per token: one, or one per layer / stage"),
    Option("routing_like", help="give a dense DiT/ViT the routing of this MoH preset on its own heads"),
    Option("model.*", type=yaml_value, help="a constructor argument, e.g. model.num_classes=10 model.in_chans=1"),
    Option("weights", "auto", choices=("auto", "ema", "model"), help="which weights (auto: EMA when present)"),
    Option("router_std", DEFAULT_ROUTER_STD, number, "std of the routed-head router where heads drop", minimum=0),
    Option("seed", 0, integer, "seed of that router init"),
    Option("eval_limit", type=integer, minimum=1, help="evaluate the first N validation items only"),
    Option("eval_batch_size", 128, integer, "evaluation batch size", minimum=1),
    Option("device", "auto", help="auto | cpu | cuda"),
    Option("compare_outputs", False, boolean, "without data: report max |dense - converted| on a random input"),
)


def convert(opts, data_overrides) -> int:
    routing = {key: opts[key] for key in ("activation_ratio", "shared_heads", "topk")}
    convert_dense_to_moh(opts.dense, opts.model, opts.out, opts.attention, routing, opts.routing_like,
                         opts.model_options, opts.weights, opts.router_std, opts.seed, data_overrides,
                         opts.eval_limit, opts.eval_batch_size, opts.device, opts.compare_outputs)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(convert, argv, OPTIONS, __doc__, passthrough=("data", "task"))


if __name__ == "__main__":
    main()
