"""Training and inference throughput (images/s) of MoH models against their dense twins.

    python tools/bench_models.py                                   # the default pairs, CPU, batch 2
    python tools/bench_models.py pairs=moh_dit_s_2_75:dit_s_2 batch=8 kernels.routing=reference
    python tools/bench_models.py quick=true                        # tiny models (CI smoke test)
    python tools/bench_models.py pairs=transnext_micro:transnext_micro attention=moh attention.activation_ratio=0.5
    python tools/bench_models.py pairs=moh_dit_s_2_75:dit_s_2 compile=true      # both models torch.compile'd
    python tools/bench_models.py device=cuda batch=32 compile=true compile_mode=reduce-overhead launches=true
    python tools/bench_models.py ops=true pairs=moh_dit_s_2_75:dit_s_2  # operators per call and compiled graphs
    python tools/bench_models.py ops=true dtype=bfloat16 graphs=false  # the same counts under CPU autocast

Both models of a pair run with the ``kernels`` config given (``kernels.<key>=<value>``, as ``train.py`` takes it;
default all ``auto``, what training runs). Inference: eval mode, no gradients. Training: forward, backward and an
AdamW step. "x dense" is the MoH model's time over its twin's in the same round (the candidates run
interleaved, round by round), as median [quartiles]; training peak memory is measured on one extra step
(:mod:`moh_vision.analysis.benchmark`). ``launches=true`` profiles one more step per model and mode: the
kernels it launches and how long they keep the GPU busy (a step far slower than that waits on the host),
or on the CPU the ATen operators it calls. ``out=t.md`` also writes ``t.json``. ``attention=<name>`` with
``attention.<key>=...`` gives the first model of every pair that attention in every layer (as ``train.py``
composes it), so a dense model can be timed as MoH against itself. ``ops=true`` times nothing: it counts the
ATen operators each call dispatches (one attention layer and each pair, inference and training with the
routing recorder open), the host time of a layer call on a negligible input, and the graphs and breaks of
``torch.compile`` (:mod:`moh_vision.analysis.op_count`); with ``dtype=bfloat16`` every call runs under CPU
autocast, as GPU runs do.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from moh_vision.analysis.benchmark import TIMING_OPTIONS, bench_models
from moh_vision.analysis.op_count import bench_ops
from moh_vision.cli import Option, attention_config, boolean, integer, list_of, run_tool, text, yaml_value

OPS_PAIRS = ("moh_dit_s_2_75:dit_s_2",)  # ops=true without pairs=

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
