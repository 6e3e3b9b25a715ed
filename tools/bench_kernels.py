"""One model under several ``kernels`` configs: does an implementation pay on the whole model's step, and what does
it save?

    python tools/bench_kernels.py model=transnext_tiny batch=4 threads=1 variants=auto,aggregated=reference
    python tools/bench_kernels.py model=transnext_nano attention=moh batch=64 variants=auto,routing=reference
    python tools/bench_kernels.py model=transnext_tiny variants=auto,recompute=reference rounds=3   # saved bytes
    python tools/bench_kernels.py model=transnext_tiny device=cuda dtype=bfloat16 batch=64 variants=auto,depthwise=triton

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

from moh_vision.analysis.benchmark import TIMING_OPTIONS, bench_kernels
from moh_vision.cli import Option, attention_config, boolean, integer, list_of, run_tool, text, yaml_value

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


def bench(opts) -> List[Dict]:
    return bench_kernels(opts.model, opts.variants, opts.batch, opts.img_size, opts.rounds, opts.warmup,
                         opts.min_seconds, opts.device, opts.dtype, opts.threads,
                         attention_config(opts.attention, opts.attention_options), opts.saved, opts.out)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
