"""Parameters, dense-equivalent and active GFLOPs of registered models as one table (``tools/flops.py``).

Counting convention and what "active" means: :mod:`moh_vision.analysis.flop_count`. A model is counted at its native
resolution and input channels unless ``img_size`` (pixels) or ``in_chans`` say otherwise, or exactly as a training run
built it (``run=``: its config decides model, attention, ``in_chans``, ``img_size`` and ``model.kwargs``, so the numbers
are the ones its ``summary.json`` reports). ``published`` is the authors' figure where there is one (TransNeXt README,
DiT paper Table 4, DeiT for the plain ViTs), shown only for a dense model at its native input."""
from __future__ import annotations

import csv
import io
import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from moh_vision.attention import active_head_fraction, find_attention
from moh_vision.checkpoints import run_config
from moh_vision.errors import ConfigError
from moh_vision.models import build_model, list_models, model_family
from moh_vision.analysis.flop_count import flop_report

log = logging.getLogger(__name__)

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


def is_dit(name: str) -> bool:
    return model_family(name) == "dit"


def run_settings(path: str) -> Dict[str, Any]:
    """What decides a run's FLOPs: ``model``, ``attention``, and the model kwargs its task passed (input channels and
    size, ``model.kwargs``), as ``model_kwargs``."""
    cfg = run_config(path)
    model = (cfg.get("model") or {}).get("name")
    if not model:
        raise ConfigError(f"run={path}: its config names no model (model.name)")
    data = cfg.get("data") or {}
    kwargs: Dict[str, Any] = dict((cfg.get("model") or {}).get("kwargs") or {})
    channels, size = ("in_channels", "input_size") if is_dit(model) else ("in_chans", "img_size")
    if data.get("in_chans") is not None:
        kwargs[channels] = int(data["in_chans"])
    if data.get("img_size") is not None:  # in the model's own units (latent pixels for latent DiTs)
        kwargs[size] = int(data["img_size"])
    task = cfg.get("task") or {}
    if is_dit(model) and task.get("learn_sigma") is not None:
        kwargs["learn_sigma"] = bool(task["learn_sigma"])
    return {"model": [model], "attention": cfg.get("attention") or None, "model_kwargs": kwargs}


def build(name: str, attention: Optional[Dict[str, Any]], img_size: Optional[int], device: str,
          in_chans: Optional[int] = None, model_kwargs: Optional[Dict[str, Any]] = None):
    """(model, input shape, forward kwargs, input label) at ``img_size`` (pixels; None = native) with ``in_chans`` input
    channels (None = the model's own); a run's ``model_kwargs`` go to the model as they are."""
    from moh_vision.models.dit import DIT_PRESETS
    kwargs: Dict[str, Any] = dict(model_kwargs or {})
    channels, size = ("in_channels", "input_size") if is_dit(name) else ("in_chans", "img_size")
    if in_chans is not None:
        kwargs[channels] = in_chans
    if img_size is not None:
        latent = is_dit(name) and kwargs.get("in_channels", DIT_PRESETS[name].get("in_channels", 4)) == 4
        kwargs[size] = img_size // VAE_DOWNSAMPLE if latent else img_size
    with torch.device(device):
        model = build_model(name, attention=attention, **kwargs)
    if is_dit(name):
        side = model.input_size
        label = f"{side[0] * VAE_DOWNSAMPLE}px (latent {side[0]})" if model.in_channels == 4 else f"{side[0]}px"
        forward_kwargs = {"t": torch.zeros(1, dtype=torch.long), "y": torch.zeros(1, dtype=torch.long)}
        return model, (model.in_channels, *side), forward_kwargs, label
    shape = tuple(model.pretrained_cfg["input_size"])
    if "in_chans" in kwargs or "img_size" in kwargs:  # pretrained_cfg keeps the registered defaults
        side = int(kwargs.get("img_size", shape[-1]))
        shape = (int(kwargs.get("in_chans", shape[0])), side, side)
    label = f"{shape[-1]}px" + (f" x{shape[0]}ch" if shape[0] != 3 else "")
    return model, shape, None, label


def attention_label(model, attention: Optional[Dict[str, Any]]) -> str:
    """``<attention> @<realised>`` for every variant: the number after ``@`` is always the realised share of active
    heads (what the layers declare they activate, summed over layers); a requested ``activation_ratio`` that rounds to
    another share follows as ``(requested <r>)``; ``(preset)``: the model's own routing. Dense models get no ``@``."""
    label = "/".join(sorted({getattr(m, "attention_name", "?") for _, m in find_attention(model)}))
    fraction = active_head_fraction(model)
    realised = 1.0 if fraction is None else fraction
    requested = (attention or {}).get("activation_ratio")
    if realised < 1.0 or requested is not None:
        label += f" @{realised:.3g}"
        if requested is not None and f"{realised:.3g}" != f"{float(requested):.3g}":
            label += f" (requested {float(requested):g})"
        if attention is None:
            label += " (preset)"
    return label


def count_row(name: str, attention: Optional[Dict[str, Any]], img_size: Optional[int], device: str,
              in_chans: Optional[int] = None, build_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    model, shape, forward_kwargs, label = build(name, attention, img_size, device, in_chans, build_kwargs)
    report = flop_report(model, shape, forward_kwargs).as_dict()
    if report.get("uncounted_ops"):
        log.warning("%s: uncounted ops %s", name, report["uncounted_ops"])
    native = img_size is None and in_chans is None and not build_kwargs
    return {"model": name, "attention": attention_label(model, attention), "input": label,
            "params_M": report["params"] / 1e6, "gflops": report["gflops"], "active_gflops": report["active_gflops"],
            "active_ratio": report["active_gflops"] / report["gflops"], "pointwise_gflops": report["pointwise_gflops"],
            "published_gflops": PUBLISHED_GFLOPS.get(name) if native and attention is None else None}


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
    lines += ["| " + " | ".join(cell(k, row[k]) for k in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def flops_table(models: Sequence[str] = (), attention: Optional[Dict[str, Any]] = None, img_size: Optional[int] = None,
                in_chans: Optional[int] = None, run: Optional[str] = None, device: str = "cpu", fmt: str = "md",
                out: Optional[str] = None) -> List[Dict[str, Any]]:
    """Count ``models`` (``["all"]``: every registered model) or the model of ``run``, print the table (and write it to
    ``out``) and return its rows. ``attention`` (a config group) replaces the models' own; ``img_size`` and ``in_chans``
    given beside ``run`` override the run's values."""
    settings = run_settings(run) if run else {}
    models = list(models or settings.get("model") or [])
    if not models:
        raise ConfigError("give model=<name>[,<name>...] (or model=all), or run=<run directory>")
    models = list_models() if models == ["all"] else models
    if attention is None and (settings.get("attention") or {}).get("name") is not None:
        attention = settings["attention"]  # the run's (a preset run keeps the model's own: None)
    build_kwargs = dict(settings.get("model_kwargs") or {})
    if img_size is not None:  # given beside run=: pixels, as without it
        for key in ("img_size", "input_size"):
            build_kwargs.pop(key, None)
    if in_chans is not None:
        for key in ("in_chans", "in_channels"):
            build_kwargs.pop(key, None)
    rows = []
    begin = time.time()
    with torch.no_grad():
        for name in models:
            start = time.time()
            rows.append(count_row(name, attention, img_size, device, in_chans, build_kwargs))
            log.info("counted %s in %.1fs", name, time.time() - start)
    table = format_table(rows, fmt)
    print(table, end="")
    if out:  # the table, and beside it the rows as a JSON record (what docs quote: docs/bench/README.md)
        Path(out).write_text(table)
        record = {"what": "parameters, dense-equivalent, active and pointwise GFLOPs (fvcore convention: one fused "
                          "multiply-add = one flop, forward, one image)", "models": models, "attention": attention,
                  "img_size": img_size, "in_chans": in_chans, "run": run, "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - begin, 1), "rows": rows}
        Path(out).with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    return rows
