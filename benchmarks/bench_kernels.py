"""One model under several ``kernels`` configs: does an implementation pay on the whole model's step, and what does
it save?

    python benchmarks/bench_kernels.py model=transnext_tiny batch=4 threads=1 variants=auto,aggregated=reference
    python benchmarks/bench_kernels.py model=transnext_nano attention=moh batch=64 variants=auto,routing=reference
    python benchmarks/bench_kernels.py model=transnext_tiny variants=auto,recompute=reference rounds=3   # saved bytes
    python benchmarks/bench_kernels.py model=transnext_tiny device=cuda dtype=bfloat16 batch=64 \
        variants=auto,depthwise=triton

Each variant is ``auto``, ``reference`` (every op's formula) or ``key=value`` entries of the ``kernels`` config joined
by ``+`` (``routing=reference+aggregated=reference``). The model is built once per variant with the same weights;
their inference calls (eval, no gradients) and training steps (forward, backward, AdamW) run interleaved, round by
round, and each is reported as ms and as the per-round ratio to the first variant, median [quartiles], with the
training peak memory and the MiB per image autograd keeps for backward (``saved``; machine-independent). A default
(``auto``) implementation is kept where such a record shows its device's whole step at least 5% faster or at
least 20% lighter than the reference (``docs/performance.md``). ``out=t.md`` also writes ``t.json``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from harness import (DTYPES, TIMING_OPTIONS, attention_label, build_for_bench, make_step, resolve_device,
                     saved_tensor_bytes, spread_text, time_candidates, where_measured, write_record)
from moh_vision.cli import Option, attention_config, boolean, integer, list_of, run_tool, text, yaml_value
from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels, resolved

OPTIONS = (
    Option("model", required=True, help="a registered model"),
    Option("variants", ["auto", "reference"], list_of(text), "kernels configs, the first the baseline"),
    Option("batch", 4, integer, "images per step", minimum=1),
    Option("img_size", type=integer, minimum=8, help="image side (default: the model's; DiT: 256px)"),
    Option("rounds", 15, integer, "timed rounds (each runs every variant once)", minimum=1),
    Option("warmup", 2, integer, "untimed steps per variant first", minimum=0),
    *TIMING_OPTIONS,
    Option("saved", True, boolean, "measure the bytes saved for backward per image"),
    Option("out", help="also write the markdown table here, and every number as JSON beside it (.json)"),
    Option("attention", help="the model's attention in every layer: mha | moh | moa | ... (default: as registered)"),
    Option("attention.*", type=yaml_value, help="one option of that attention, e.g. attention.activation_ratio=0.5"),
)


def parse_kernels(text: str) -> Kernels:
    """``auto``, ``reference`` (every entry), or ``key=value`` entries joined by ``+`` (the rest ``auto``)."""
    if text in ("auto", "reference"):
        return Kernels(**{key: text for key in Kernels().as_dict()})
    entries = dict(part.split("=", 1) if "=" in part else (part, "") for part in text.split("+"))
    if any(not value for value in entries.values()):
        raise ConfigError(f"kernels variant '{text}': give auto, reference or key=value entries joined by '+'")
    return Kernels.of(entries)


def bench_kernels(model: str, variants: Sequence[str] = ("auto", "reference"), batch: int = 4,
                  img_size: Optional[int] = None, rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0,
                  device: str = "auto", dtype: str = "float32", threads: Optional[int] = None,
                  attention: Optional[Dict] = None, saved: bool = True, out: Optional[str] = None) -> List[Dict]:
    """``model`` (with ``attention``, if given) under each ``kernels`` variant (:func:`parse_kernels`), the same
    weights, its inference and training steps interleaved round by round: ms, the per-round ratio to the first variant
    (``x first``), the training peak memory and (``saved``) the MiB per image autograd keeps for backward
    (:func:`saved_tensor_bytes`)."""
    from moh_vision.models import build_model, model_family
    if threads:
        torch.set_num_threads(threads)
    where, torch_dtype = resolve_device(device), DTYPES[dtype]
    if img_size is None and model_family(model) != "dit":  # the model's own size (DiT: 256px, 32x32 latents)
        with torch.device("meta"):
            img_size = build_model(model, attention=attention).pretrained_cfg["input_size"][-1]
    size = img_size or 256
    models = {variant: build_for_bench(model, size, where, attention, parse_kernels(variant)) for variant in variants}
    first = models[variants[0]]
    for m in models.values():
        m.load_state_dict(first.state_dict())
    timed = time_candidates(models, variants[0], batch, rounds, warmup, min_seconds, where, torch_dtype,
                            f"{model}, kernels {' / '.join(variants)}")
    rows = []
    for variant, row in timed.items():
        kernels = parse_kernels(variant)
        row = {"model": model, "kernels": variant, "resolved": kernels.as_dict(), "in_use": resolved(kernels, where),
               "batch": batch, "img_size": size, **row}
        if saved:
            step = make_step(models[variant], batch, where, True, torch_dtype)
            row["saved_mib_per_image"] = saved_tensor_bytes(step, models[variant].parameters()) / batch / 2 ** 20
        rows.append(row)
    label = model if attention is None else f"{model} ({attention_label(attention)})"
    header = (f"{label} at {size} px, {where_measured(where)}, {dtype}, batch {batch}; the kernels variants "
              f"interleaved, {rounds}+ rounds: median ms per step, and the per-round ratio to the first variant "
              f"({variants[0]}) as median [quartiles]")
    lines = [header, "", "| kernels | inference ms | x first | training ms | x first | training peak MB | saved MiB/img |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.0f}"
        kept = f"{r['saved_mib_per_image']:.1f}" if "saved_mib_per_image" in r else "-"
        lines.append(f"| {r['kernels']} | {r['infer_ms']['median']:.1f} | {spread_text(r['infer_x_base'])} | "
                     f"{r['train_ms']['median']:.1f} | {spread_text(r['train_x_base'])} | {peak} | {kept} |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_record(out, table, {"header": header, "torch": torch.__version__, "machine": where_measured(where),
                        "rows": rows})
    return rows


def bench(opts) -> List[Dict]:
    return bench_kernels(opts.model, opts.variants, opts.batch, opts.img_size, opts.rounds, opts.warmup,
                         opts.min_seconds, opts.device, opts.dtype, opts.threads,
                         attention_config(opts.attention, opts.attention_options), opts.saved, opts.out)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
