#!/usr/bin/env python
"""Convert a released or training checkpoint into a plain tensor state_dict.

The output holds tensors only, so our models load it strictly with ``torch.load(..., weights_only=True)``
(and ``timm.create_model(name, checkpoint_path=...)``). Understood inputs:

* a raw state_dict (the released DiT-XL-2-256x256.pt, ...);
* what DiT / MoH-DiT training writes: ``{"model", "ema", "opt", "args"}`` (EMA weights by default,
  ``--no-ema`` for the raw model weights);
* ``{"model": ...}``, ``{"state_dict": ...}``, timm's ``state_dict_ema`` / ``model_ema`` wrappers;
* ``.safetensors`` files.

``module.`` (DistributedDataParallel) and ``_orig_mod.`` (torch.compile) key prefixes are stripped.

DiT's training checkpoints pickle an ``argparse.Namespace`` (``args``), which ``weights_only=True``
refuses; unpickling it means running whatever the file says, so it needs ``--trust-pickle``.

Examples::

    python tools/convert_checkpoint.py DiT-XL-2-256x256.pt dit_xl_2.pt --model dit_xl_2
    python tools/convert_checkpoint.py results/000/checkpoints/0400000.pt moh.pt \\
        --trust-pickle --model moh_dit_xl_2_90
    python tools/convert_checkpoint.py DiT-XL-2-512x512.pt dit_xl_2_512.pt --model dit_xl_2 --model-arg input_size=64
"""
from __future__ import annotations

import argparse
import ast
import os
import pickle
import re
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from moh_vision.errors import ConfigError

EMA_KEYS = ("ema", "state_dict_ema", "model_ema")
MODEL_KEYS = ("model", "state_dict", "module")
STRIP_PREFIXES = ("module.", "_orig_mod.")
SHOW = 12  # entries shown per problem list


class ConversionError(Exception):
    """Something about the input or its validation that the user must fix; one-line message."""


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load_file(path: str, trust_pickle: bool = False) -> Any:
    """Load ``path`` on the CPU: tensors-only unpickling unless ``trust_pickle``."""
    if not os.path.isfile(path):
        raise ConversionError(f"no such file: {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file as load_safetensors
        return load_safetensors(path, device="cpu")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        what = f"a pickled {found.group(1)}" if found else "pickled Python objects"
        if not trust_pickle:
            raise ConversionError(
                f"{path} contains {what} besides tensors (DiT training checkpoints keep an argparse.Namespace in "
                f"'args'); unpickling it can run arbitrary code, so it is refused. If you trust where the file "
                f"came from, re-run with --trust-pickle") from None
    print(f"WARNING: --trust-pickle: loading {path} with weights_only=False; this executes any code pickled in it. "
          f"Only do this for files from a source you trust.", file=sys.stderr)
    return torch.load(path, map_location="cpu", weights_only=False)


def _describe(obj: Mapping) -> str:
    return ", ".join(f"{k!r} ({type(v).__name__})" for k, v in list(obj.items())[:SHOW])


def pick_state_dict(checkpoint: Any, use_ema: bool = True) -> Tuple[Dict[str, torch.Tensor], str]:
    """The tensor dict inside ``checkpoint`` and where it was found (e.g. ``"['ema']"``).

    Descends through known wrapper keys, EMA first when ``use_ema``; falls back to the raw model
    weights when there is no EMA copy.
    """
    wanted = (EMA_KEYS + MODEL_KEYS) if use_ema else MODEL_KEYS
    obj, where = checkpoint, ""
    while True:
        if not isinstance(obj, Mapping):
            raise ConversionError(f"expected a dict of tensors at checkpoint{where}, found {type(obj).__name__}")
        key = next((k for k in wanted if isinstance(obj.get(k), Mapping)), None)
        if key is None:
            if not use_ema and where == "" and any(isinstance(obj.get(k), Mapping) for k in EMA_KEYS):
                raise ConversionError(f"--no-ema asks for the raw model weights, but the checkpoint has only EMA "
                                      f"weights; its keys: {_describe(obj)}")
            break
        obj, where = obj[key], f"{where}[{key!r}]"
    not_tensors = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not obj or not_tensors:
        raise ConversionError(
            f"checkpoint{where} is not a state_dict (no tensors, or non-tensor entries: "
            f"{', '.join(map(repr, not_tensors[:SHOW]))}); its keys: {_describe(obj)}")
    return dict(obj), where or "(top level)"


def strip_prefixes(state_dict: Dict[str, torch.Tensor],
                   prefixes: Sequence[str] = STRIP_PREFIXES) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        new = key
        while any(new.startswith(p) for p in prefixes):
            new = next(new[len(p):] for p in prefixes if new.startswith(p))
        if new in out:
            raise ConversionError(f"two keys map to '{new}' after stripping {', '.join(prefixes)}")
        out[new] = value
    return out


def plain_tensors(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that own exactly their data (a view would save its whole base)."""
    out = {}
    for key, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        out[key] = t
    return out


# ---------------------------------------------------------------------------------------------
# Validation against a registered model
# ---------------------------------------------------------------------------------------------
def parse_model_args(items: Sequence[str]) -> Dict[str, Any]:
    """``["input_size=64", "attention=moh"]`` -> ``{"input_size": 64, "attention": "moh"}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConversionError(f"--model-arg expects KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def expected_shapes(model_name: str, model_args: Optional[Dict[str, Any]] = None) -> Dict[str, Tuple[int, ...]]:
    """Key -> shape of ``timm.create_model(model_name, **model_args)``, built on the meta device (no memory)."""
    import timm
    import moh_vision  # noqa: F401
    import moh_vision.models.dit  # noqa: F401  (registers dit_*, moh_dit_*)
    import moh_vision.models.vit  # noqa: F401  (registers plain_vit_*)
    try:
        import moh_vision.models  # noqa: F401  (every other registered family)
    except ImportError:
        pass
    if not timm.is_model(model_name):
        raise ConversionError(f"unknown model '{model_name}'; e.g. dit_xl_2, moh_dit_xl_2_90, plain_vit_small")
    with torch.device("meta"):
        model = timm.create_model(model_name, **(model_args or {}))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def compare(state_dict: Dict[str, torch.Tensor], expected: Dict[str, Tuple[int, ...]]) -> List[str]:
    """Readable problem lines (empty when the state_dict loads strictly)."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {expected[k]}"
                  for k in expected if k in state_dict and tuple(state_dict[k].shape) != expected[k]]
    lines = []
    for title, items in (("missing from the checkpoint", missing), ("unexpected in the checkpoint", unexpected),
                         ("shape mismatches", mismatched)):
        if items:
            lines.append(f"{len(items)} {title}:")
            lines += [f"    {item}" for item in items[:SHOW]]
            if len(items) > SHOW:
                lines.append(f"    ... and {len(items) - SHOW} more")
    if any(item.startswith("pos_embed:") for item in mismatched):
        lines.append("hint: pos_embed differs, so the checkpoint is for another resolution; pass "
                     "--model-arg input_size=<latent side> (DiT: image_size / 8) or --model-arg img_size=<side> (ViT)")
    return lines


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def save_atomic(obj: Any, path: str) -> None:
    """torch.save to a temporary file in the target directory, fsync, then rename over ``path``:
    readers never see a half-written file, and a crash leaves the old file intact."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable; not possible on every platform
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Convert a DiT / MoH-DiT / timm-style checkpoint into a plain tensor state_dict that "
                    "moh_vision models load strictly with weights_only=True.",
        epilog="Exit status: 0 written, 1 validation failed (nothing written), 2 unreadable input or bad arguments.")
    p.add_argument("src", help="input checkpoint (.pt/.pth/.bin or .safetensors)")
    p.add_argument("dst", help="output .pt file (written atomically)")
    p.add_argument("--model", help="registered model name to validate against, e.g. dit_xl_2 or moh_dit_xl_2_90")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for --model (repeatable), e.g. input_size=64 for 512px DiT")
    p.add_argument("--no-ema", action="store_true", help="take the raw 'model' weights instead of 'ema'")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling non-tensor objects (e.g. argparse.Namespace); runs code from the file")
    p.add_argument("--force", action="store_true", help="write even if validation against --model fails")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        checkpoint = load_file(args.src, trust_pickle=args.trust_pickle)
        state_dict, where = pick_state_dict(checkpoint, use_ema=not args.no_ema)
        state_dict = plain_tensors(strip_prefixes(state_dict))
        numel = sum(t.numel() for t in state_dict.values())
        print(f"{args.src}: {len(state_dict)} tensors, {numel / 1e6:.2f}M values, from checkpoint{where}")
        if isinstance(checkpoint, Mapping) and "args" in checkpoint:
            train_args = checkpoint["args"]
            train_args = vars(train_args) if hasattr(train_args, "__dict__") else train_args
            if isinstance(train_args, Mapping):
                print("  training args: " + ", ".join(f"{k}={v}" for k, v in train_args.items()
                                                      if k in ("model", "image_size", "num_classes", "vae")))
        if args.model:
            problems = compare(state_dict, expected_shapes(args.model, parse_model_args(args.model_arg)))
            if problems:
                print(f"does not match {args.model}:\n" + "\n".join(problems), file=sys.stderr)
                if not args.force:
                    print("nothing written (use --force to write anyway)", file=sys.stderr)
                    return 1
            else:
                print(f"  matches {args.model}: every key and shape")
    except (ConversionError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    save_atomic(state_dict, args.dst)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
