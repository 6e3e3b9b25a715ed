"""This codebase's backbones against timm peers of similar FLOPs, in one interleaved run.

    python benchmarks/bench_backbones.py                                  # TransNeXt-Micro/PVTv2-b1, TransNeXt-T/Swin-T
    python benchmarks/bench_backbones.py pairs=big device=cuda batch=64 dtype=bfloat16 compile=false,true
    python benchmarks/bench_backbones.py pairs=transnext_micro:pvt_v2_b1 threads=1 batch=4 rounds=5 out=b.md
    python benchmarks/bench_backbones.py quick=true                       # tiny models at 64 px (CI smoke test)

Each ``ours:peer`` pair is built at one image size and timed interleaved, round by round: a training step
(forward, loss, backward, AdamW) and inference (eval, no gradients). Per pair: GFLOPs per image of both (the
project's fvcore count), ms per step, "x peer" (ours/peer in the same round) as median [quartiles], that
ratio per GFLOP (x peer over the GFLOPs ratio: 1.0 means ours costs what its FLOPs predict), images/s, the
MiB per image that autograd saves for backward (``saved``; parameters excluded, machine-independent) and,
on CUDA, the training peak memory. ``pairs=big`` adds TransNeXt-S/Swin-S and TransNeXt-B/Swin-B to the
default two. ``compile=false,true`` times each pair eager and compiled. ``profile=true`` adds where a
training step's time goes: each model's operators (CUDA: kernels) by self time. ``components=true`` times
our models' pieces alone, per stage, under every implementation that runs on the device (the depthwise
convolution, the aggregated attention). ``kernels.<key>=<value>`` sets our models' kernels config (as ``train.py``
takes it). ``out=t.md`` also writes ``t.json`` (every number, torch and timm versions, the machine, the options).

The architecture's promise is that a backbone costs what its peers of the same FLOPs cost (timm's Swin and PVTv2). Both
models of an ``ours:peer`` pair are built at the same image size (ours through
``harness.build_for_bench``) and their steps interleaved round by round
(``benchmarks/harness.py``), so "x peer" is a per-round ratio, reported as median [quartiles], of training
steps (forward, loss, backward, AdamW) and of inference (eval mode, no gradients); "per GFLOP" divides it by the GFLOPs
ratio (1.0: ours costs what its FLOPs predict). Beside them: GFLOPs per image (the project's one counter), saved MiB per
image (``harness.saved_tensor_bytes``: what autograd keeps for backward, which sets training memory on a GPU and does
not depend on the machine) and, on CUDA, the training peak memory. ``compile=[False, True]`` times each pair eager and
``torch.compile``d in one invocation (same weights, compilation left out of the timings).
"""
from __future__ import annotations

import statistics
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from harness import (DTYPES, TIMING_OPTIONS, Spread, build_for_bench, interleave, kernels_text, machine_description,
                     make_step, model_inputs, paired_ratio, peak_memory, resolve_device, rounds_bar, saved_tensor_bytes,
                     synchronizer, where_measured, write_record)
from moh_vision.analysis.profile_kinds import counted_events, own_time_us, time_by_kind
from moh_vision.cli import Option, boolean, integer, list_of, run_tool, text
from moh_vision.errors import ConfigError
from moh_vision.ops import Kernels

# Peers of about the same FLOPs (fvcore GFLOPs at 224 px: TransNeXt-Micro 2.7 vs PVTv2-b1 2.1, TransNeXt-Tiny 5.7 vs
# Swin-T 4.5, TransNeXt-Small 10.3 vs Swin-S 8.7, TransNeXt-Base 18.4 vs Swin-B 15.4).
PAIR_SETS: Dict[str, Tuple[str, ...]] = {
    "default": ("transnext_micro:pvt_v2_b1", "transnext_tiny:swin_tiny_patch4_window7_224"),
    "quick": ("transnext_nano:pvt_v2_b0",),  # tiny models for a smoke test (64 px)
}
PAIR_SETS["big"] = PAIR_SETS["default"] + ("transnext_small:swin_small_patch4_window7_224",
                                           "transnext_base:swin_base_patch4_window7_224")
# What an option left unset (None) is, in a normal run and with quick=true.
SETTINGS = {"img_size": 224, "batch": 2, "rounds": 15, "warmup": 2}
QUICK_SETTINGS = {"img_size": 64, "batch": 1, "rounds": 2, "warmup": 1}
MODES = ("train", "infer")
MIB = 2 ** 20


# -- Pairs and models --------------------------------------------------------------------------------------------------
def parse_pairs(specs: Iterable[str]) -> List[Tuple[str, str]]:
    """``["ours:peer", "big", ...]`` -> ``[(ours, peer), ...]``; a set name (:data:`PAIR_SETS`) stands for its pairs.
    Ours must be one of this package's models, the peer any timm model (a one-line ConfigError else)."""
    from moh_vision.models.families import check_model_name, model_class
    pairs = []
    for spec in specs:
        if spec in PAIR_SETS:
            pairs += parse_pairs(PAIR_SETS[spec])
            continue
        parts = spec.split(":")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"pairs wants ours:peer (e.g. {PAIR_SETS['default'][0]}) or one of "
                              f"{', '.join(PAIR_SETS)}; got '{spec}'")
        for name in parts:
            check_model_name(name)
        model_class(parts[0])  # ours must be a moh-vision model (a one-line error names them)
        pairs.append(tuple(parts))
    return pairs


def _at_size(model: nn.Module, img_size: int) -> nn.Module:
    """``model`` with its ``pretrained_cfg`` input size set to ``img_size`` (timm keeps the registered one there)."""
    channels = model.pretrained_cfg["input_size"][0]
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (channels, img_size, img_size)}
    return model


def build_peer(name: str, img_size: int, device: torch.device) -> nn.Module:
    """timm's ``name`` at ``img_size`` (passed where the model takes it: PVTv2 runs at any size without it)."""
    import timm
    try:
        model = timm.create_model(name, img_size=img_size)
    except TypeError as err:
        if "img_size" not in str(err):
            raise
        model = timm.create_model(name)
    return _at_size(model, img_size).to(device)


def build_pair(ours: str, peer: str, img_size: int, device: torch.device,
               kernels: Optional[Kernels] = None) -> Dict[str, nn.Module]:
    """``{"ours": ..., "peer": ...}`` at ``img_size``; ours with ``kernels`` (default: all ``auto``, as training)."""
    models = {"ours": _at_size(build_for_bench(ours, img_size, device, kernels=kernels), img_size),
              "peer": build_peer(peer, img_size, device)}
    for side, model in models.items():
        if len(model_inputs(model, 1, torch.device("meta"))) != 1:
            raise ConfigError(f"{ours if side == 'ours' else peer} takes more than images (a diffusion model?): "
                              f"pairs compares image backbones")
    return models


# -- What a model is: FLOPs, parameters, bytes saved for backward ------------------------------------------------------
def describe(model: nn.Module, batch: int, device: torch.device, dtype: torch.dtype, saved: bool) -> Dict[str, object]:
    """``gflops``, ``active_gflops``, ``params_m`` and (``saved``) ``saved_mib_per_image`` of ``model``."""
    from moh_vision.analysis.flop_count import count_flops
    counted = count_flops(model, model.pretrained_cfg["input_size"])
    info: Dict[str, object] = {"gflops": counted["gflops"], "active_gflops": counted["active_gflops"],
                               "params_m": counted["params"] / 1e6}
    if counted.get("uncounted_ops"):
        info["uncounted_ops"] = counted["uncounted_ops"]
    if saved:
        step = make_step(model, batch, device, True, dtype)
        info["saved_mib_per_image"] = saved_tensor_bytes(step, model.parameters()) / batch / MIB
    return info


# -- Timing ------------------------------------------------------------------------------------------------------------
def _per_gflop(ratio: Spread, gflops_ratio: float) -> Spread:
    return Spread(ratio.median / gflops_ratio, ratio.q1 / gflops_ratio, ratio.q3 / gflops_ratio, ratio.n)


def time_pair(label: str, models: Dict[str, nn.Module], gflops_ratio: float, batch: int, rounds: int, warmup: int,
              min_seconds: float, device: torch.device, dtype: torch.dtype) -> Dict[str, object]:
    """Training and inference of ``models`` (ours, peer) interleaved round by round: per side its ms per step and
    images/s, per mode the ratio ours/peer and that ratio per GFLOP; on CUDA the training peak memory."""
    row: Dict[str, object] = {"ours": {}, "peer": {}}
    for mode in MODES:
        steps = {side: make_step(m, batch, device, mode == "train", dtype) for side, m in models.items()}
        with rounds_bar(rounds, f"{label}, {'training' if mode == 'train' else 'inference'}") as progress:
            times = interleave(steps, rounds=rounds, warmup=warmup, min_seconds=min_seconds, device=device,
                               progress=progress)
        for side, t in times.items():
            row[side][f"{mode}_ms"] = Spread.of([1e3 * v for v in t]).as_dict()
            row[side][f"{mode}_img_s"] = batch / statistics.median(t)
        ratio = paired_ratio(times["ours"], times["peer"])
        row[f"{mode}_ratio"] = ratio.as_dict()
        row[f"{mode}_ratio_per_gflop"] = _per_gflop(ratio, gflops_ratio).as_dict()
        if mode == "train" and device.type == "cuda":
            for side, step in steps.items():
                row[side]["train_peak_mb"] = peak_memory(step, device) / MIB
    return row


def top_ops(step: Callable[[], None], device: torch.device, count: int = 15) -> Dict[str, object]:
    """Where one profiled ``step``'s self time goes (CUDA: the kernels' GPU time): the ``count`` operators (CUDA:
    kernels) that take most (``ops``), the time by kind (``by_kind``, ms:
    :func:`~moh_vision.analysis.profile_kinds.time_by_kind`) and in all (``total_ms``)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    with profile(activities=activities) as prof:
        step()
        synchronizer(device)()
    averages = prof.key_averages()
    events = sorted(counted_events(averages, device), key=lambda e: own_time_us(e, device), reverse=True)
    by_kind = time_by_kind(averages, device)
    return {"ops": [{"name": e.key, "ms": own_time_us(e, device) / 1e3, "calls": e.count} for e in events[:count]],
            "by_kind": by_kind, "total_ms": sum(by_kind.values())}


def top_ops_table(rows: Sequence[Dict]) -> str:
    lines = []
    for r in rows:
        for side in ("ours", "peer"):
            if "top_ops" in r[side]:
                profiled = r[side]["top_ops"]
                total = profiled["total_ms"]
                lines += [f"\nTraining step of {r[side]['model']} (compiled: {r['compiled']}): self time by kind "
                          f"(total {total:.1f} ms) and by operator", "", "| kind | ms | share |", "|---|---|---|"]
                lines += [f"| {kind} | {ms:.1f} | {100 * ms / total:.1f}% |" for kind, ms in profiled["by_kind"].items()]
                lines += ["", "| operator | ms | calls |", "|---|---|---|"]
                lines += [f"| {e['name'][:90]} | {e['ms']:.2f} | {e['calls']} |" for e in profiled["ops"]]
    return "\n".join(lines) + ("\n" if lines else "")


def arithmetic_rate(info: Dict[str, object], timings: Dict[str, object], device: torch.device,
                    dtype: torch.dtype) -> Dict[str, float]:
    """The training step's ``train_tflops`` (the trainer's convention: :mod:`~moh_vision.analysis.device_peaks`) and, on
    a GPU of the peaks table, ``train_utilisation`` against its dense peak for ``dtype``."""
    from moh_vision.analysis.device_peaks import device_name, peak_tflops, run_precision, training_gflops_per_image
    out = {"train_tflops": training_gflops_per_image(info) * timings["train_img_s"] / 1e3}
    amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "none")
    peak = peak_tflops(device_name(device), run_precision(amp)) if device.type == "cuda" else None
    if peak:
        out["train_utilisation"] = out["train_tflops"] / peak
    return out


def bench_pair(ours: str, peer: str, img_size: int, batch: int, rounds: int, warmup: int, min_seconds: float,
               device: torch.device, dtype: torch.dtype, compile_modes: Sequence[bool], compile_mode: str,
               saved: bool, profile: bool = False, kernels: Optional[Kernels] = None) -> List[Dict[str, object]]:
    """One row per entry of ``compile_modes`` (False: eager, True: ``torch.compile``d with ``compile_mode``)."""
    from moh_vision.attention.recorder import compile_model
    models = build_pair(ours, peer, img_size, device, kernels)
    info = {side: describe(m, batch, device, dtype, saved) for side, m in models.items()}
    gflops_ratio = info["ours"]["gflops"] / info["peer"]["gflops"]
    rows = []
    for compiled in compile_modes:
        timed = {side: compile_model(m, compile_mode) for side, m in models.items()} if compiled else models
        label = f"{ours} vs {peer}{' (compiled)' if compiled else ''}"
        timings = time_pair(label, timed, gflops_ratio, batch, rounds, max(warmup, 1) if compiled else warmup,
                            min_seconds, device, dtype)
        row = {"pair": f"{ours}:{peer}", "compiled": compiled, "img_size": img_size, "batch": batch,
               "gflops_ratio": gflops_ratio, **timings}
        for side, name in (("ours", ours), ("peer", peer)):
            row[side] = {"model": name, **info[side], **timings[side], **arithmetic_rate(info[side],
                                                                                        timings[side], device, dtype)}
            if profile:
                row[side]["top_ops"] = top_ops(make_step(timed[side], batch, device, True, dtype), device)
        if saved:
            row["saved_ratio"] = info["ours"]["saved_mib_per_image"] / info["peer"]["saved_mib_per_image"]
        rows.append(row)
    return rows


# -- Components: where a TransNeXt block's time may go, one piece at a time --------------------------------------------
def component_times(model_name: str, batch: int, rounds: int, device: torch.device,
                    dtype: torch.dtype) -> List[Dict[str, object]]:
    """Forward + backward ms (median [quartiles], interleaved) of each aggregated stage's pieces of ``model_name`` at
    ``batch`` on random inputs of the stage's shapes, under every implementation that runs on ``device``: the ConvGLU's
    depthwise convolution (``dwconv_<implementation>``) and the aggregated attention
    (``aggregated_<implementation>``)."""
    from moh_vision.ops import depthwise_conv, aggregated_attention
    from moh_vision.ops.aggregated import AGGREGATED
    from moh_vision.ops.depthwise import DEPTHWISE

    import timm
    with torch.device("meta"):  # only its shapes
        model = timm.create_model(model_name)
    rows = []
    for index, (H, W, C, hidden, heads, pool, window) in enumerate(_stages(model)):
        g = torch.Generator(device="cpu").manual_seed(index)

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

        half = rand(batch, H * W, hidden)  # the convolution's input: fc1's first half
        weight, bias = rand(hidden, 1, 3, 3), rand(hidden)
        d = C // heads
        q, k, v = (rand(batch, heads, H * W, d) for _ in range(3))
        k_pool, v_pool = rand(batch, heads, pool, d), rand(batch, heads, pool, d)
        extra = (rand(heads, H * W, pool), rand(heads, window ** 2), rand(batch, heads, H * W, window ** 2))
        calls, failed = {}, {}
        for op, run in ((DEPTHWISE, lambda kernel: depthwise_conv(half, weight, bias, H, W, kernel=kernel)),
                        (AGGREGATED, lambda kernel: aggregated_attention(q, k, v, k_pool, v_pool, *extra, (H, W),
                                                                         window, kernel=kernel))):
            names = ["reference"] + [n for n, impl in op.impls.items() if device.type in impl.devices]
            for name in names:
                label = f"{'dwconv' if op is DEPTHWISE else 'aggregated'}_{name}"
                call = (lambda run=run, name=name: run(name).sum().backward())
                try:
                    call()  # compiles it; one that cannot run costs this row its figure, not the run
                    calls[label] = call
                except Exception as error:
                    failed[f"{label}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        times = interleave(calls, rounds=rounds, warmup=2, device=device)
        rows.append({"stage": index + 1, "tokens": f"{H}x{W}", "dim": C, "hidden": hidden, "heads": heads,
                     **{name: Spread.of([1e3 * t for t in ts]).as_dict() for name, ts in times.items()}, **failed})
    return rows


def _stages(model: nn.Module) -> List[Tuple[int, int, int, int, int, int, int]]:
    """(H, W, dim, ConvGLU hidden width, heads, pooled tokens, window) of each aggregated stage's first block."""
    from moh_vision.models.transnext import TransNeXtAggregatedAttention
    out = []
    for index in range(4):
        block = getattr(model, f"block{index + 1}")[0]
        if isinstance(block.attn, TransNeXtAggregatedAttention):
            H, W = block.attn.input_resolution
            out.append((H, W, block.attn.dim, block.mlp.fc2.in_features, block.attn.num_heads, block.attn.pool_len,
                        block.attn.window_size))
    return out


def component_table(rows: Sequence[Dict], header: str) -> str:
    names = list(dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, dict)))  # the timed pieces
    lines = [header, "", "| stage | tokens | dim / hidden / heads | " + " | ".join(names) + " |",
             "|" + "---|" * (3 + len(names))]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['tokens']} | {r['dim']} / {r['hidden']} / {r['heads']} | "
                     + " | ".join(_spread(r[n], 2) if n in r else "-" for n in names) + " |")
    lines += [f"\nStage {r['stage']}: {k[:-len('_error')]} did not run ({v})" for r in rows for k, v in r.items()
              if k.endswith("_error")]
    return "\n".join(lines) + "\n"


# -- The table and the record ------------------------------------------------------------------------------------------
def _spread(d: Dict[str, float], digits: int) -> str:
    return Spread(**d).text(digits)


def backbones_table(rows: Sequence[Dict], header: str) -> str:
    """One line per pair and compile mode; "a / b" cells give ours / peer."""
    saved = "saved_ratio" in rows[0]
    peak = "train_peak_mb" in rows[0]["ours"]
    columns = ["ours / peer", "compiled", "GFLOPs", "params M", "train ms", "train x peer", "per GFLOP",
               "infer ms", "infer x peer", "per GFLOP", "train img/s", "infer img/s"]
    util = "train_utilisation" in rows[0]["ours"]
    columns += ["train TFLOP/s"] + (["train utilisation"] if util else [])
    columns += ["saved MiB/img", "saved x peer"] if saved else []
    columns += ["train peak MB"] if peak else []
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        ours, peer = r["ours"], r["peer"]

        def both(key: str, fmt: str) -> str:
            return f"{ours[key]:{fmt}} / {peer[key]:{fmt}}"

        cells = [f"{ours['model']} / {peer['model']}", "yes" if r["compiled"] else "no", both("gflops", ".3g"),
                 both("params_m", ".1f")]
        for mode in MODES:
            cells += [f"{_spread(ours[f'{mode}_ms'], 1)} / {_spread(peer[f'{mode}_ms'], 1)}",
                      _spread(r[f"{mode}_ratio"], 2), _spread(r[f"{mode}_ratio_per_gflop"], 2)]
        cells += [both("train_img_s", ".1f"), both("infer_img_s", ".1f"), both("train_tflops", ".3g")]
        cells += [f"{100 * ours['train_utilisation']:.1f}% / {100 * peer['train_utilisation']:.1f}%"] if util else []
        cells += [both("saved_mib_per_image", ".1f"), f"{r['saved_ratio']:.2f}"] if saved else []
        cells += [both("train_peak_mb", ".0f")] if peak else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bench_backbones(pairs: Optional[Sequence[str]] = None, batch: Optional[int] = None, img_size: Optional[int] = None,
                    rounds: Optional[int] = None, warmup: Optional[int] = None, min_seconds: float = 0.0,
                    device: str = "auto", dtype: str = "float32", threads: Optional[int] = None,
                    compile_modes: Sequence[bool] = (False,), compile_mode: str = "default",
                    saved: Optional[bool] = None, quick: bool = False, out: Optional[str] = None, profile: bool = False,
                    with_components: bool = False, kernels: Optional[Kernels] = None) -> List[Dict]:
    """Time every ``ours:peer`` pair (default :data:`PAIR_SETS` ``default``; ``quick``: ``quick`` at
    :data:`QUICK_SETTINGS`), print the table and return its rows; ``out`` also gets the table, and ``<out>.json`` every
    number with the versions, the machine and these settings. ``saved`` (default: on the CPU only): the bytes saved for
    backward per image; ``profile``: each model's operators by self time in one training step (:func:`top_ops`);
    ``with_components``: each TransNeXt's pieces timed alone (:func:`component_times`); ``kernels``: ours' kernels
    config (default all ``auto``)."""
    import timm
    settings = {"pairs": list(pairs) if pairs else None, "batch": batch, "img_size": img_size, "rounds": rounds,
                "warmup": warmup, "min_seconds": min_seconds, "device": device, "dtype": dtype, "threads": threads,
                "compile": list(compile_modes), "compile_mode": compile_mode, "saved": saved, "quick": quick,
                "profile": profile, "components": with_components}
    kernels = Kernels.of(kernels)
    defaults = QUICK_SETTINGS if quick else SETTINGS
    batch, img_size, rounds, warmup = (defaults[k] if settings[k] is None else settings[k]
                                       for k in ("batch", "img_size", "rounds", "warmup"))
    chosen = parse_pairs(pairs or PAIR_SETS["quick" if quick else "default"])
    if not compile_modes:
        raise ConfigError("compile wants true, false or false,true")
    if threads:
        torch.set_num_threads(threads)
    where, torch_dtype = resolve_device(device), DTYPES[dtype]
    saved = where.type == "cpu" if saved is None else saved
    rows = []
    for ours, peer in chosen:
        rows += bench_pair(ours, peer, img_size, batch, rounds, warmup, min_seconds, where, torch_dtype,
                           compile_modes, compile_mode, saved, profile, kernels)
        print(f"done {ours}:{peer}", file=sys.stderr, flush=True)
    compiled = {(False,): "eager", (True,): "torch.compile'd"}.get(tuple(sorted(set(compile_modes))),
                                                                   "eager and torch.compile'd")
    mode = "" if compile_mode == "default" or compiled == "eager" else f" (mode {compile_mode})"
    header = (f"Backbones against timm peers: {where_measured(where)}, {dtype}, batch {batch}, {img_size} px, "
              f"{compiled}{mode}; each pair interleaved, {rounds}+ rounds after {warmup} warm-up: ms per step and "
              f"x peer (ours/peer per round) as median [quartiles]; per GFLOP = x peer / GFLOPs ratio (fvcore "
              f"multiply-adds, one image); train TFLOP/s = 2 x 3 x active GFLOPs x images/s (utilisation: of the "
              f"GPU's dense peak)" + ("; saved = bytes kept for backward per image (eager; parameters and their "
                                      "autocast copies excluded)" if saved else ""))
    header += f"; ours with kernels {kernels_text(kernels)}"
    table = backbones_table(rows, header) + top_ops_table(rows)
    machine = torch.cuda.get_device_name(where) if where.type == "cuda" else machine_description()
    record = {"header": header, "torch": torch.__version__, "timm": timm.__version__, "device": where.type,
              "machine": machine, "threads": torch.get_num_threads(), "options": settings,
              "kernels": kernels.as_dict(),
              "resolved": {"pairs": [f"{a}:{b}" for a, b in chosen], "batch": batch, "img_size": img_size,
                           "rounds": rounds, "warmup": warmup, "saved": saved}, "rows": rows}

    write_record(out, table, record)  # now, and again after each model's pieces: a run cut short keeps the rest
    for name in dict.fromkeys(ours for ours, _ in chosen) if with_components else ():
        record.setdefault("components", {})[name] = pieces = component_times(name, batch, rounds, where, torch_dtype)
        table += "\n" + component_table(pieces, (
            f"Pieces of {name}'s aggregated stages ({dtype}, batch {batch}): forward + backward ms, median [quartiles] "
            f"of {rounds} interleaved rounds; dwconv_<kernel>: the ConvGLU's depthwise convolution, aggregated_<kernel>: "
            "the aggregated attention, under each implementation that runs on this device (kernels.depthwise, "
            "kernels.aggregated)"))
        write_record(out, table, record)
    print(table)
    return rows


OPTIONS = (
    Option("pairs", type=list_of(text), help="ours:peer pairs, or a set: default | big | quick "
           "(default: transnext_micro:pvt_v2_b1,transnext_tiny:swin_tiny_patch4_window7_224)"),
    Option("batch", type=integer, minimum=1, help="images per step (default 2; quick: 1)"),
    Option("img_size", type=integer, minimum=32, help="image side in pixels (default 224; quick: 64)"),
    Option("rounds", type=integer, minimum=1, help="timed rounds, each runs both models once (default 15; quick: 2)"),
    Option("warmup", type=integer, minimum=0, help="untimed steps per model first (default 2; quick: 1)"),
    *TIMING_OPTIONS,
    Option("compile", [False], list_of(boolean), "torch.compile both models (compilation untimed); "
           "false,true: each pair both ways"),
    Option("compile_mode", "default", help="torch.compile's mode (reduce-overhead: CUDA graphs)",
           choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
    Option("saved", type=boolean, help="measure the bytes saved for backward per image (default: on the CPU)"),
    Option("quick", False, boolean, "tiny models at 64 px, batch 1, 2 rounds (smoke test)"),
    Option("profile", False, boolean, "also each model's top operators (CUDA: kernels) by self time in one step"),
    Option("components", False, boolean, "also time each of our models' pieces alone (the depthwise convolution, "
           "the aggregated attention, each implementation) per stage"),
    Option("kernels.*", type=text, help="one entry of our models' kernels config, e.g. kernels.depthwise=triton"),
    Option("out", help="also write the markdown table here, and every number as JSON beside it (.json)"),
)


def bench(opts) -> List[Dict]:
    return bench_backbones(opts.pairs, opts.batch, opts.img_size, opts.rounds, opts.warmup, opts.min_seconds,
                           opts.device, opts.dtype, opts.threads, opts.compile, opts.compile_mode, opts.saved,
                           opts.quick, opts.out, opts.profile, opts.components, opts.kernels_options)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
