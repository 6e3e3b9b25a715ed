"""Parameters, dense-equivalent and active GFLOPs of registered models, as one table.

    python tools/flops.py model=transnext_tiny,moh_transnext_small_80
    python tools/flops.py model=dit_xl_2 attention=moh attention.activation_ratio=0.5
    python tools/flops.py model=plain_vit_base img_size=384 format=csv out=flops.csv
    python tools/flops.py model=all            # every registered model, native resolution

Arguments are ``key=value`` like the Hydra entry points:

* ``model``: one or more registered names, comma-separated, or ``all``.
* ``attention``: ``mha`` | ``moh`` | ``moa`` (options from ``configs/attention/<name>.yaml``);
  ``attention.<option>=<value>`` overrides one of them. Without ``attention`` a model keeps its
  own (the MoH presets their official per-layer heads, the others dense ``mha``).
* ``img_size``: image side in pixels (default: the model's native resolution: TransNeXt and ViT
  224, DiT 256 px, i.e. a 32 x 32 latent of the Stable Diffusion VAE; the CPU-sized models 32 or 16).
* ``device`` (``cpu``), ``format`` (``md`` | ``csv``), ``out`` (also write the table there).

Counting convention (fvcore's: one multiply-add = one flop, forward pass, one image) and what
"active" means: :mod:`moh_vision.analysis.flops`. ``published`` is the number from the paper /
official README where there is one (TransNeXt README, DiT paper Table 4, DeiT for the plain ViTs).
"""
from __future__ import annotations

import csv
import io
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moh_vision.analysis.flops import flop_report  # noqa: E402
from moh_vision.errors import ConfigError  # noqa: E402

# GFLOPs published for the dense models at their native resolution (fvcore convention).
PUBLISHED_GFLOPS = {
    # TransNeXt README (ImageNet-1K, 224)
    "transnext_micro": 2.7, "transnext_tiny": 5.7, "transnext_small": 10.3, "transnext_base": 18.4,
    # DiT paper, Table 4 (256 x 256 images, 32 x 32 latents)
    "dit_s_8": 0.36, "dit_s_4": 1.41, "dit_s_2": 6.06, "dit_b_8": 1.42, "dit_b_4": 5.56, "dit_b_2": 23.01,
    "dit_l_8": 5.01, "dit_l_4": 19.70, "dit_l_2": 80.71, "dit_xl_8": 7.39, "dit_xl_4": 29.05, "dit_xl_2": 118.64,
    # DeiT-Ti / S / B (the same architectures as plain_vit_{tiny,small,base} with mha), 224
    "plain_vit_tiny": 1.3, "plain_vit_small": 4.6, "plain_vit_base": 17.6,
}

VAE_DOWNSAMPLE = 8  # Stable Diffusion VAE: a 256 px image is a 32 x 32 x 4 latent
COLUMNS = ("model", "attention", "input", "params_M", "gflops", "active_gflops", "active_ratio", "pointwise_gflops",
           "published_gflops")


def parse_args(argv: Sequence[str]) -> Dict[str, Any]:
    """``key=value`` words -> dict (values parsed as YAML scalars/lists); ``attention.x`` keys are grouped."""
    args: Dict[str, Any] = {"attention_options": {}}
    for word in argv:
        if word in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ConfigError(f"arguments are key=value (e.g. model=dit_b_2); got '{word}'")
        if key == "model":
            args["model"] = [m.strip() for m in value.split(",") if m.strip()]
        elif key.startswith("attention."):
            args["attention_options"][key[len("attention."):]] = yaml.safe_load(value)
        elif key in ("attention", "img_size", "device", "format", "out"):
            args[key] = yaml.safe_load(value) if key == "img_size" else value
        else:
            raise ConfigError(f"unknown argument '{key}'; known: model, attention, attention.<option>, img_size, device, "
                              "format, out")
    if not args.get("model"):
        raise ConfigError("give model=<name>[,<name>...] (or model=all)")
    if args["attention_options"] and not args.get("attention"):
        raise ConfigError("attention.<option> needs attention=<mha|moh|moa>")
    if args.get("format", "md") not in ("md", "csv"):
        raise ConfigError(f"format={args['format']} is unknown; use md or csv")
    return args


def all_models() -> List[str]:
    import timm

    import moh_vision.models  # noqa: F401
    return sorted(m for m in timm.list_models() if "transnext" in m or "dit_" in m or m.startswith("plain_vit"))


def attention_config(name: Optional[str], options: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``attention`` config group as train.py composes it: the YAML, then the overrides."""
    if name is None:
        return None
    path = REPO / "configs" / "attention" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"attention={name} is unknown; known: {', '.join(known)}")
    cfg = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(options) - set(cfg))
    if unknown:
        raise ConfigError(f"attention={name} has no option(s) {', '.join(unknown)}; it has: {', '.join(sorted(cfg))}")
    return {**cfg, **options}


def is_dit(name: str) -> bool:
    return "dit_" in name


def build(name: str, attention: Optional[Dict[str, Any]], img_size: Optional[int], device: str):
    """The model at ``img_size`` (pixels; None = native) and its FLOP-count inputs."""
    from moh_vision.models import build_model
    from moh_vision.models.dit import DIT_PRESETS

    kwargs: Dict[str, Any] = {}
    if is_dit(name):
        latent = DIT_PRESETS[name].get("in_channels", 4) == 4
        if img_size is not None:
            kwargs["input_size"] = img_size // VAE_DOWNSAMPLE if latent else img_size
    elif img_size is not None:
        kwargs["img_size"] = img_size
    with torch.device(device):
        model = build_model(name, attention=attention, **kwargs)
    if is_dit(name):
        side = model.input_size
        latent = model.in_channels == 4
        shape = (model.in_channels, *side)
        label = f"{side[0] * VAE_DOWNSAMPLE}px (latent {side[0]})" if latent else f"{side[0]}px"
        model_kwargs = {"t": torch.zeros(1, dtype=torch.long), "y": torch.zeros(1, dtype=torch.long)}
        return model, shape, model_kwargs, label
    shape = tuple(model.pretrained_cfg["input_size"])
    return model, shape, None, f"{shape[-1]}px"


def attention_label(model, attention: Optional[Dict[str, Any]]) -> str:
    from moh_vision.attention import find_attention
    names = sorted({getattr(m, "attention_name", "?") for _, m in find_attention(model)})
    label = "/".join(names)
    if attention and attention.get("activation_ratio") is not None and attention.get("name") != "mha":
        label += f" @{attention['activation_ratio']}"
    elif attention is None and "moh" in names:
        label += " (preset)"
    return label


def count_row(name: str, attention: Optional[Dict[str, Any]], img_size: Optional[int], device: str) -> Dict[str, Any]:
    model, shape, model_kwargs, label = build(name, attention, img_size, device)
    report = flop_report(model, shape, model_kwargs).as_dict()
    if report.get("uncounted_ops"):
        print(f"warning: {name}: uncounted ops {report['uncounted_ops']}", file=sys.stderr)
    published = PUBLISHED_GFLOPS.get(name) if img_size is None and attention in (None,) else None
    row = {
        "model": name, "attention": attention_label(model, attention), "input": label,
        "params_M": report["params"] / 1e6, "gflops": report["gflops"], "active_gflops": report["active_gflops"],
        "active_ratio": report["active_gflops"] / report["gflops"], "pointwise_gflops": report["pointwise_gflops"],
        "published_gflops": published,
    }
    del model
    return row


def format_table(rows: List[Dict[str, Any]], fmt: str = "md") -> str:
    def cell(key: str, value: Any) -> str:
        if value is None:
            return ""
        if key == "params_M":
            return f"{value:.2f}"
        if key == "active_ratio":
            return f"{value:.3f}"
        if isinstance(value, float):
            return f"{value:.4g}" if value < 100 else f"{value:.2f}"
        return str(value)

    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()
    header = ("model", "attention", "input", "params (M)", "GFLOPs", "active GFLOPs", "active/dense",
              "pointwise GFLOPs", "published GFLOPs")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(cell(k, row[k]) for k in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    models = all_models() if args["model"] == ["all"] else args["model"]
    attention = attention_config(args.get("attention"), args["attention_options"])
    rows = []
    with torch.no_grad():
        for name in models:
            start = time.time()
            rows.append(count_row(name, attention, args.get("img_size"), args.get("device", "cpu")))
            print(f"counted {name} in {time.time() - start:.1f}s", file=sys.stderr)
    table = format_table(rows, args.get("format", "md"))
    print(table, end="")
    if args.get("out"):
        Path(args["out"]).write_text(table)
    return rows


if __name__ == "__main__":
    from moh_vision.cli import user_error_in

    try:
        main()
    except Exception as err:  # one line for a user error, a traceback otherwise
        if user_error_in(err) is None:
            raise
        print(f"error: {user_error_in(err)}", file=sys.stderr)
        sys.exit(2)
