"""Random-number-generator states as plain data (saved in checkpoints so a resumed run continues bit-exactly)."""
from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def capture_rng() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": _numpy_state_to_plain(np.random.get_state()),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _numpy_state_to_plain(st) -> Dict[str, Any]:
    name, keys, pos, has_gauss, cached = st
    return {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_state_from_plain(d: Dict[str, Any]):
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached"])
