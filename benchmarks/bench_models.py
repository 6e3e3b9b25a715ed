"""Training and inference throughput (images/s) of MoH models against their dense twins.

    python benchmarks/bench_models.py                                   # the default pairs, CPU, batch 2
    python benchmarks/bench_models.py pairs=moh_dit_s_2_75:dit_s_2 batch=8 kernels.routing=reference
    python benchmarks/bench_models.py quick=true                        # tiny models (CI smoke test)
    python benchmarks/bench_models.py pairs=transnext_micro:transnext_micro attention=moh attention.activation_ratio=0.5
    python benchmarks/bench_models.py pairs=moh_dit_s_2_75:dit_s_2 compile=true      # both models torch.compile'd
    python benchmarks/bench_models.py device=cuda batch=32 compile=true compile_mode=reduce-overhead launches=true
    python benchmarks/bench_models.py ops=true pairs=moh_dit_s_2_75:dit_s_2  # operators per call and compiled graphs
    python benchmarks/bench_models.py ops=true dtype=bfloat16 graphs=false  # the same counts under CPU autocast

Both models of a pair run with the ``kernels`` config given (``kernels.<key>=<value>``, as ``train.py`` takes it;
default all ``auto``, what training runs). Inference: eval mode, no gradients. Training: forward, backward and an
AdamW step. "x dense" is the MoH model's time over its twin's in the same round (the candidates run
interleaved, round by round), as median [quartiles]; training peak memory is measured on one extra step
(``benchmarks/harness.py``). ``launches=true`` profiles one more step per model and mode: the
kernels it launches and how long they keep the GPU busy (a step far slower than that waits on the host),
or on the CPU the ATen operators it calls. ``out=t.md`` also writes ``t.json``. ``attention=<name>`` with
``attention.<key>=...`` gives the first model of every pair that attention in every layer (as ``train.py``
composes it), so a dense model can be timed as MoH against itself. ``ops=true`` times nothing: it counts the
ATen operators each call dispatches (one attention layer and each pair, inference and training with the
routing recorder open), the host time of a layer call on a negligible input, and the graphs and breaks of
``torch.compile`` (``benchmarks/op_count.py``); with ``dtype=bfloat16`` every call runs under CPU
autocast, as GPU runs do.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from harness import (DTYPES, TIMING_OPTIONS, attention_label, build_for_bench, kernels_text, resolve_device,
                     spread_text, time_candidates, where_measured, write_record)
from moh_vision.cli import Option, attention_config, boolean, integer, list_of, run_tool, text, yaml_value
from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels
from op_count import bench_ops

OPS_PAIRS = ("moh_dit_s_2_75:dit_s_2",)  # ops=true without pairs=
DEFAULT_PAIRS = ("moh_transnext_base_50:transnext_base", "moh_dit_xl_2_75:dit_xl_2", "moh_dit_b_2_75:dit_b_2")
QUICK_PAIRS = ("moh_dit_s_2_75:dit_s_2",)

OPTIONS = (
    Option("pairs", type=list_of(text), help="moh_model:dense_model pairs (default: MoH-ViT-B/50, DiT-XL, DiT-B)"),
    Option("batch", 2, integer, "images per step", minimum=1),
    Option("img_size", type=integer, minimum=8, help="image side (default 224; DiT: 256px; quick: 64)"),
    Option("rounds", 15, integer, "timed rounds (each runs every candidate once)", minimum=1),
    Option("warmup", 2, integer, "untimed steps per candidate first", minimum=0),
    *TIMING_OPTIONS,
    Option("quick", False, boolean, "one small pair at small inputs (smoke test)"),
    Option("compile", False, boolean, "torch.compile every model, as trainer.compile=true (compilation untimed)"),
    Option("compile_mode", "default", help="torch.compile's mode (reduce-overhead: CUDA graphs)",
           choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
    Option("launches", False, boolean, "also count each step's kernel launches and GPU-busy time (CPU: ATen ops)"),
    Option("ops", False, boolean, "count operators per call and compiled graphs instead of timing (CPU; dtype: autocast)"),
    Option("graphs", True, boolean, "with ops=true: also torch._dynamo.explain each model (slow: minutes)"),
    Option("out", help="also write the markdown table here, and every number as JSON beside it (.json)"),
    Option("attention", help="the MoH side's attention in every layer: mha | moh | moa | ... (default: as registered)"),
    Option("attention.*", type=yaml_value, help="one option of that attention, e.g. attention.activation_ratio=0.5"),
    Option("kernels.*", type=text, help="one entry of the kernels config, e.g. kernels.routing=reference"),
)


def bench_pair(moh: str, dense: str, batch: int, img_size: int, rounds: int, warmup: int, min_seconds: float,
               device: torch.device, dtype: torch.dtype, attention: Optional[Dict] = None,
               kernels: Optional[Kernels] = None, compile_models: bool = False, compile_mode: str = "default",
               count_launches: bool = False) -> List[Dict]:
    """The dense twin and the MoH model (with ``attention``, if given), both with ``kernels``, interleaved round by
    round; ``compile_models``: each one ``torch.compile``d with ``compile_mode`` (as ``trainer.compile=true``), its
    first call per mode (the compilation) left out of the timings."""
    label = moh if attention is None else f"{moh} ({attention_label(attention)})"
    models = {dense: build_for_bench(dense, img_size, device, kernels=kernels),
              label: build_for_bench(moh, img_size, device, attention, kernels)}
    if compile_models:
        from moh_vision.attention.recorder import compile_model

        models = {key: compile_model(m, compile_mode) for key, m in models.items()}
        warmup = max(warmup, 1)
    timed = time_candidates(models, dense, batch, rounds, warmup, min_seconds, device, dtype, f"{label} vs {dense}",
                            count_launches)
    rows = []
    for key, row in timed.items():
        row = {"model": key, "batch": batch, "compiled": compile_models, **row}
        for mode in ("infer", "train"):
            row[f"{mode}_x_dense"] = row.pop(f"{mode}_x_base")
        rows.append(row)
    return rows


def models_table(rows: Sequence[Dict], header: str) -> str:
    def launched(d: Dict[str, float]) -> str:  # kernels (GPU-busy ms) on CUDA, ATen operators on the CPU
        return f"{d['kernels']} ({d['device_ms']:.2f} ms)" if "kernels" in d else f"{d['aten_ops']}"

    counted = "infer_launches" in rows[0]
    extra = (" inference launches | training launches |", "---|---|") if counted else ("", "")
    lines = [header, "", "| model | inference ms | x dense | training ms | x dense | training peak MB |"
             + extra[0], "|---|---|---|---|---|---|" + extra[1]]
    for r in rows:
        peak = "-" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.0f}"
        more = f" {launched(r['infer_launches'])} | {launched(r['train_launches'])} |" if counted else ""
        lines.append(f"| {r['model']} | {r['infer_ms']['median']:.1f} | {spread_text(r['infer_x_dense'])} | "
                     f"{r['train_ms']['median']:.1f} | {spread_text(r['train_x_dense'])} | {peak} |" + more)
    return "\n".join(lines) + "\n"


def bench_models(pairs: Optional[Sequence[str]] = None, batch: int = 2, img_size: Optional[int] = None,
                 rounds: int = 15, warmup: int = 2, min_seconds: float = 0.0, device: str = "auto",
                 dtype: str = "float32", threads: Optional[int] = None, quick: bool = False, out: Optional[str] = None,
                 attention: Optional[Dict] = None, kernels: Optional[Kernels] = None, compile_models: bool = False,
                 compile_mode: str = "default", count_launches: bool = False) -> List[Dict]:
    """Images/s of each ``moh:dense`` pair (inference and training), print the table and return its rows; ``out`` also
    gets the table, and every number goes to ``<out>.json``. ``quick``: one small pair at 64 px. ``attention``: the MoH
    side's attention in every layer (e.g. ``{"name": "moh", "activation_ratio": 0.5}``; None: as registered);
    ``kernels``: both models' kernels config; ``compile_models``: every model ``torch.compile``d with ``compile_mode``;
    ``count_launches``: two more columns (:func:`launches`)."""
    from moh_vision.models import model_family
    if threads:
        torch.set_num_threads(threads)
    where, torch_dtype = resolve_device(device), DTYPES[dtype]
    kernels = Kernels.of(kernels)
    rows = []
    for pair in pairs or (QUICK_PAIRS if quick else DEFAULT_PAIRS):
        moh, _, dense = pair.partition(":")
        if not dense:
            raise ConfigError(f"pairs wants moh:dense, got {pair}")
        size = img_size or (64 if quick else (256 if model_family(moh) == "dit" else 224))
        rows += bench_pair(moh, dense, batch, size, rounds, warmup, min_seconds, where, torch_dtype, attention,
                           kernels, compile_models, compile_mode, count_launches)
    mode = "" if compile_mode == "default" else f" (mode {compile_mode})"
    compiled = f", every model torch.compile'd{mode}" if compile_models else ""
    header = (f"{where_measured(where)}, {dtype}, batch {batch}{compiled}, kernels {kernels_text(kernels)}; dense and "
              f"MoH interleaved, {rounds}+ rounds: median ms per step, and the per-round ratio to the dense twin as "
              f"median [quartiles]")
    table = models_table(rows, header)
    print(table)
    write_record(out, table, {"header": header, "torch": torch.__version__, "kernels": kernels.as_dict(), "rows": rows})
    return rows


def bench(opts) -> List[Dict]:
    if opts.ops:
        return bench_ops(opts.pairs or OPS_PAIRS, opts.img_size or 64, attention_config(opts.attention,
                         opts.attention_options), opts.graphs, opts.out, opts.dtype)
    return bench_models(opts.pairs, opts.batch, opts.img_size, opts.rounds, opts.warmup, opts.min_seconds,
                        opts.device, opts.dtype, opts.threads, opts.quick, opts.out,
                        attention_config(opts.attention, opts.attention_options), opts.kernels_options, opts.compile,
                        opts.compile_mode, opts.launches)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
