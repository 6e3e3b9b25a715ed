"""Training and inference throughput (images/s) of MoH models against their dense twins.

    python tools/bench_models.py                                   # the default pairs, CPU, batch 2
    python tools/bench_models.py --pairs moh_dit_s_2_75:dit_s_2 --batch 8 --impl auto masked sparse
    python tools/bench_models.py --quick                           # tiny models (CI smoke test)

Each MoH model runs with every ``--impl`` given (how its MoH layers execute: ``auto`` is what
training uses); its dense twin runs once. Inference: eval mode, no gradients. Training: forward,
backward and an AdamW step. Times are medians over ``--iters`` after ``--warmup`` iterations;
"x dense" is the MoH model's time over its twin's, measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

DEFAULT_PAIRS = ("moh_transnext_base_50:transnext_base", "moh_dit_xl_2_75:dit_xl_2",
                 "moh_dit_b_2_75:dit_b_2")
QUICK_PAIRS = ("moh_dit_s_2_75:dit_s_2",)


def build(name: str, img_size: int, impl: str, device: torch.device) -> torch.nn.Module:
    from moh_vision.models import build_model

    # DiT works on 256px images as 32x32 latents (1/8); TransNeXt and ViT on the images.
    kwargs: Dict = {"input_size": img_size // 8} if "dit" in name else {"img_size": img_size}
    attention = {"name": "moh", "impl": impl} if name.startswith("moh_") else None  # keeps the preset's heads
    return build_model(name, attention=attention, **kwargs).to(device)


def make_step(model: torch.nn.Module, batch: int, device: torch.device, train: bool,
              dtype: torch.dtype) -> Callable[[], None]:
    is_dit = hasattr(model, "t_embedder")
    if is_dit:
        s = model.x_embedder.img_size
        x = torch.randn(batch, model.in_channels, *s, device=device)
        t = torch.randint(0, 1000, (batch,), device=device)
        y = torch.randint(0, model.y_embedder.num_classes, (batch,), device=device)
        inputs = (x, t, y)
    else:
        size = model.pretrained_cfg["input_size"]
        inputs = (torch.randn(batch, *size, device=device),)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6) if train else None

    def step() -> None:
        ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
        if train:
            with ctx:
                out = model(*inputs)
            out.float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad(), ctx:
                model(*inputs)

    model.train(train)
    return step


def time_step(step: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_pair(moh: str, dense: str, args, device: torch.device, dtype: torch.dtype) -> List[Dict]:
    rows = []
    dense_model = build(dense, args.img_size, "masked", device)
    base = {mode: time_step(make_step(dense_model, args.batch, device, mode == "train", dtype), args.warmup,
                            args.iters, device) for mode in ("infer", "train")}
    rows.append({"model": dense, "impl": "-", **{f"{m}_img_s": args.batch / t for m, t in base.items()},
                 "infer_x_dense": 1.0, "train_x_dense": 1.0})
    del dense_model
    for impl in args.impl:
        try:
            model = build(moh, args.img_size, impl, device)
        except Exception as err:  # an impl this model cannot run (e.g. sparse on TransNeXt's own kernels)
            print(f"skip {moh} impl={impl}: {err}", file=sys.stderr)
            continue
        times = {mode: time_step(make_step(model, args.batch, device, mode == "train", dtype), args.warmup,
                                 args.iters, device) for mode in ("infer", "train")}
        rows.append({"model": moh, "impl": impl, **{f"{m}_img_s": args.batch / t for m, t in times.items()},
                     "infer_x_dense": times["infer"] / base["infer"], "train_x_dense": times["train"] / base["train"]})
        del model
    return rows


def format_table(rows: Sequence[Dict], header: str) -> str:
    lines = [header, "", "| model | MoH impl | inference img/s | x dense | training img/s | x dense |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['impl']} | {r['infer_img_s']:.3g} | {r['infer_x_dense']:.2f} | "
                     f"{r['train_img_s']:.3g} | {r['train_x_dense']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=None, help="moh_model:dense_model pairs")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--img-size", type=int, default=None, help="image side (default 224; DiT: 256px)")
    parser.add_argument("--impl", nargs="+", default=["auto", "masked"], choices=["auto", "masked", "sparse", "triton"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="one small pair at small inputs (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = args.pairs or (QUICK_PAIRS if args.quick else DEFAULT_PAIRS)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for pair in pairs:
        moh, _, dense = pair.partition(":")
        if not dense:
            parser.error(f"--pairs wants moh:dense, got {pair}")
        size = args.img_size or (64 if args.quick else (256 if "dit" in moh else 224))
        args_pair = argparse.Namespace(**{**vars(args), "img_size": size})
        rows += bench_pair(moh, dense, args_pair, device, dtype)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    table = format_table(rows, f"{machine}, {args.dtype}, batch {args.batch}, median of {args.iters}")
    print(table)
    if args.out:
        args.out.write_text(table)
    return rows


if __name__ == "__main__":
    main()
