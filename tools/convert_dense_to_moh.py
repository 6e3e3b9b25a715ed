#!/usr/bin/env python
"""Turn a dense TransNeXt / DiT / plain-ViT checkpoint into a MoH model of the same backbone, and measure it.

    python tools/convert_dense_to_moh.py --dense <ckpt> --model <name> --out <file>
        [--attention moh] [--activation-ratio 0.5 | --shared-heads 4,4 --topk 2,2 | --routing-like <MoH preset>]
        [--model-arg KEY=VALUE ...] [--weights auto|ema|model] [--router-std 1e-3]
        [--eval data=<name> [data.root=...] ...] [--eval-limit N] [--device auto]

Every dense tensor is copied unchanged and the MoH routers start so that every active head has gate 1
(``moh_vision.models.continue_tuning``): a model that keeps every head computes the dense function at
step 0, and one that keeps fewer heads starts with those heads dropped. ``--eval`` composes the
training configs with the given overrides (``data=digits``, ``data=imagenet data.root=...``), builds the
dense model and the converted one exactly as ``train.py model.init_from=<ckpt>`` would, evaluates both
on the validation split and reports the step-0 drop (classification: top-1/top-5 and loss; diffusion:
the validation loss at fixed timesteps and noise).

Writes ``--out`` (the converted model's state dict: load it with ``model.checkpoint_path=`` and the same
model/attention, or train from the dense file directly with ``model.init_from=``) and ``<out>.json``
(what was copied, which layers start exactly dense, the evaluation). Exit status: 0 written; 1 the
checkpoint does not fit the model (nothing written); 2 bad arguments or unreadable input.

Examples::

    # TransNeXt-Base -> MoH-ViT-B 75% (same heads per stage: the official preset)
    python tools/convert_dense_to_moh.py --dense transnext_base_224_1k.pth --model moh_transnext_base_75 \\
        --out moh_b75_init.pt --eval data=imagenet data.root=/data/imagenet --eval-limit 10000
    # DiT-XL/2 -> the MoH-DiT-XL/2-90 budget on DiT-XL's 16 heads per block
    python tools/convert_dense_to_moh.py --dense DiT-XL-2-256x256.pt --model dit_xl_2 \\
        --routing-like moh_dit_xl_2_90 --out moh_dit_xl_90_init.pt
    # a dense digits run -> MoH at activation ratio 0.5, with the step-0 drop on the digits
    python tools/convert_dense_to_moh.py --dense outputs/.../checkpoints/last.pt --model transnext_nano \\
        --activation-ratio 0.5 --out nano_moh50.pt --eval data=digits
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moh_vision.errors import ConfigError  # noqa: E402
from moh_vision.models.continue_tuning import (DEFAULT_ROUTER_STD, ContinueTuningError, init_from_dense,  # noqa: E402
                                               read_dense_checkpoint, routing_like)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def int_list(text: str) -> Any:
    """``"4"`` -> 4, ``"4,4,2"`` -> [4, 4, 2] (one value per layer / stage)."""
    values = [int(v) for v in text.split(",") if v.strip()]
    return values[0] if len(values) == 1 else values


def parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def model_args(items: Sequence[str]) -> Dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-arg expects KEY=VALUE, got {item!r}")
        out[key] = parse_value(value)
    return out


def is_moh_preset(name: str) -> bool:
    return name.startswith("moh_")


def attention_config(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``attention`` config group the target is built with (as train.py would pass it)."""
    routing = {k: v for k, v in (("activation_ratio", args.activation_ratio), ("shared_heads", args.shared_heads),
                                 ("topk", args.topk)) if v is not None}
    if args.routing_like:
        if routing:
            raise ConfigError("--routing-like sets shared heads and top-k itself; drop --activation-ratio/"
                              "--shared-heads/--topk")
        routing = routing_like(args.routing_like, args.model, **model_args(args.model_arg))
    name = args.attention or ("preset" if is_moh_preset(args.model) and not routing else "moh")
    if name == "preset":
        if routing:
            raise ConfigError("--attention preset keeps the preset's routing; drop the routing options")
        return {"name": None}
    if name == "moh":
        if not routing:
            routing = {"activation_ratio": 0.75}  # configs/attention/moh.yaml's default
            print("no routing given: MoH at activation ratio 0.75 (configs/attention/moh.yaml)")
        if "topk" in routing and "activation_ratio" not in routing:
            routing["activation_ratio"] = None
        return {"name": "moh", "impl": "auto", **routing}
    if name == "mha":
        return {"name": "mha"}
    return {"name": name, **routing}  # refused by the converter with its reason (e.g. moa)


# ---------------------------------------------------------------------------------------------
# Building: without data (constructor args only) or through the training configs (--eval)
# ---------------------------------------------------------------------------------------------
def _hydra_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return "null" if value is None else str(value)


def compose(args: argparse.Namespace, attention: Dict[str, Any]):
    """The training config (configs/train.yaml) for this model and attention, plus the --eval overrides."""
    from hydra import compose as hydra_compose, initialize_config_dir

    overrides: List[str] = []
    if "dit" in args.model:
        overrides.append("task=diffusion")
    if (REPO / "configs" / "model" / f"{args.model}.yaml").is_file():
        overrides.append(f"model={args.model}")
    else:
        overrides.append(f"model.name={args.model}")
    overrides.append(f"attention={attention['name'] or 'preset'}")
    overrides += [f"attention.{k}={_hydra_value(v)}" for k, v in attention.items() if k != "name"]
    overrides += [f"++model.kwargs.{k}={_hydra_value(v)}" for k, v in model_args(args.model_arg).items()]
    overrides += list(args.eval)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def build_pair(args: argparse.Namespace, attention: Dict[str, Any]):
    """(dense model, target model, task or None, data or None); neither has weights loaded yet."""
    from moh_vision.models import build_model

    if not args.eval:
        kwargs = model_args(args.model_arg)
        target = build_model(args.model, attention=attention, **kwargs)
        dense = build_model(args.model, attention={"name": "mha"}, **kwargs) if args.compare_outputs else None
        return dense, target, None, None
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose(args, attention)
    data = instantiate(cfg.data)
    config = OmegaConf.to_container(cfg, resolve=True)
    config["model"].update(checkpoint_path=None, init_from=None)
    task = instantiate(cfg.task, model=config["model"], attention=config["attention"], _recursive_=False)
    target = task.build_model(data)
    dense_task = instantiate(cfg.task, model=config["model"], attention={"name": "mha", "aux_loss_weight": 0.0},
                             _recursive_=False)
    dense = dense_task.build_model(data)
    return dense, target, task, data


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
def evaluate(task, data, model: torch.nn.Module, device: torch.device, batch_size: int,
             limit: Optional[int]) -> Dict[str, float]:
    from torch.utils.data import DataLoader, Subset

    val = data.val if not limit else Subset(data.val, range(min(int(limit), len(data.val))))
    loader = DataLoader(val, batch_size=batch_size, shuffle=False, collate_fn=data.collate_fn)
    model = model.to(device).eval()
    sums = task.evaluate(model, loader, device, amp=contextlib.nullcontext)
    return {k: v for k, v in task.finalize(sums, prefix="val").items()}


def drop(dense: Dict[str, float], converted: Dict[str, float]) -> Dict[str, float]:
    """Dense minus converted for accuracies (points lost), converted minus dense for losses (rise)."""
    out = {}
    for key, value in dense.items():
        if key not in converted or key.endswith("count"):
            continue
        out[key] = value - converted[key] if "acc" in key else converted[key] - value
    return out


@torch.no_grad()
def output_difference(dense: torch.nn.Module, target: torch.nn.Module) -> Optional[float]:
    """Max |dense - converted| on a random classification input (no data needed); None for DiT."""
    cfg = getattr(target, "pretrained_cfg", None) or {}
    shape = cfg.get("input_size")
    if not shape or not hasattr(target, "forward_head"):
        return None
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    return float((dense.eval()(x) - target.eval()(x)).abs().max())


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit status: 0 written, 1 the checkpoint does not fit (nothing written), "
                                       "2 bad arguments or unreadable input.")
    p.add_argument("--dense", required=True, help="dense checkpoint: official state dict or our trainer's last.pt")
    p.add_argument("--model", required=True, help="target: a dense name (dit_xl_2, transnext_base, plain_vit_nano) "
                                                  "plus routing options, or a MoH preset (moh_transnext_base_75)")
    p.add_argument("--out", required=True, type=Path, help="converted state dict (.pt); a .json report beside it")
    p.add_argument("--attention", choices=("moh", "mha", "moa", "preset"), default=None,
                   help="default: preset for moh_* names, else moh")
    p.add_argument("--activation-ratio", type=float, default=None)
    p.add_argument("--shared-heads", type=int_list, default=None, help="int or comma list (per layer / stage)")
    p.add_argument("--topk", type=int_list, default=None, help="int or comma list (per layer / stage)")
    p.add_argument("--routing-like", default=None, metavar="MOH_PRESET",
                   help="give a dense DiT/ViT backbone the routing of a MoH preset on its own heads "
                        "(e.g. dit_xl_2 like moh_dit_xl_2_90)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="constructor argument (repeatable), e.g. num_classes=10 img_size=32 in_chans=1")
    p.add_argument("--weights", choices=("auto", "ema", "model"), default="auto",
                   help="which weights of a checkpoint with EMA (auto: EMA when present)")
    p.add_argument("--router-std", type=float, default=DEFAULT_ROUTER_STD,
                   help="std of the routed-head router in layers that drop heads (0: zero)")
    p.add_argument("--seed", type=int, default=0, help="seed of that router init")
    p.add_argument("--eval", nargs="+", default=[], metavar="OVERRIDE",
                   help="evaluate dense and converted on the validation split of these training-config overrides, "
                        "e.g. data=digits or data=imagenet data.root=/data/imagenet")
    p.add_argument("--eval-limit", type=int, default=None, help="first N validation items only")
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--compare-outputs", action="store_true",
                   help="without --eval: also report max |dense - converted| on a random input (classifiers)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.time()
    try:
        attention = attention_config(args)
        ckpt = read_dense_checkpoint(args.dense, args.weights)
        dense, target, task, data = build_pair(args, attention)
    except ConfigError as err:  # bad arguments, an unreadable checkpoint, an unknown model
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        report = init_from_dense(target, ckpt, router_std=args.router_std, seed=args.seed)
    except ContinueTuningError as err:
        print(f"error: {err}\nnothing written", file=sys.stderr)
        return 1
    print(report.summary())
    result: Dict[str, Any] = {"command": " ".join(sys.argv if argv is None else ["convert_dense_to_moh.py", *argv]),
                              "model": args.model, "attention": attention, "conversion": report.as_dict()}
    if dense is not None:
        dense.load_state_dict(ckpt.state, strict=True)
    if task is not None:
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        dense_metrics = evaluate(task, data, dense, device, args.eval_batch_size, args.eval_limit)
        converted_metrics = evaluate(task, data, target, device, args.eval_batch_size, args.eval_limit)
        result["eval"] = {"overrides": list(args.eval), "limit": args.eval_limit, "dense": dense_metrics,
                          "converted": converted_metrics, "drop": drop(dense_metrics, converted_metrics)}
        keys = [k for k in dense_metrics if not k.endswith("count")]
        print(f"step-0 evaluation on {int(dense_metrics.get('val/count', 0))} validation items:")
        print(f"  {'metric':<12} {'dense':>10} {'converted':>10} {'drop':>10}")
        for key in keys:
            print(f"  {key:<12} {dense_metrics[key]:>10.4f} {converted_metrics.get(key, float('nan')):>10.4f} "
                  f"{result['eval']['drop'].get(key, float('nan')):>10.4f}")
        target = target.cpu()
    elif dense is not None:
        diff = output_difference(dense, target)
        if diff is not None:
            result["max_abs_output_difference"] = diff
            print(f"max |dense - converted| on a random input: {diff:.3g}")

    from moh_vision.engine.checkpoint import atomic_save
    atomic_save({k: v.detach().cpu().contiguous() for k, v in target.state_dict().items()}, args.out)
    report_path = args.out.with_suffix(args.out.suffix + ".json")
    report_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out} and {report_path} ({time.time() - start:.1f}s)")
    parts = ["python train.py"] + (["task=diffusion"] if "dit" in args.model else []) + [f"model={args.model}"]
    if attention["name"]:
        parts.append(f"attention={attention['name']}")
        parts += [f"attention.{k}={_hydra_value(v)}" for k, v in attention.items() if k not in ("name", "impl")]
    parts += [f"++model.kwargs.{k}={_hydra_value(v)}" for k, v in model_args(args.model_arg).items()]
    print(f"continue-tune with: {' '.join(parts)} model.init_from={args.dense}   (the same start: "
          f"model.checkpoint_path={args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
