"""Checkpoints that survive crashes: atomic writes, verified reads, fallback to the previous good file.

A checkpoint is a dict of tensors and plain Python types only (loads with ``weights_only=True``).
Writing goes to a temporary file in the same directory, is fsynced, then renamed over the target,
so a crash or a full disk never leaves a half-written ``last.pt``; the previous one is kept as
``last.prev.pt`` and used when ``last.pt`` turns out to be unreadable.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from moh_vision.errors import ConfigError, RunError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class CheckpointWriteError(RunError):
    """Saving failed (e.g. disk full); the previous checkpoint is intact."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: os.PathLike, keep_previous: bool = False) -> None:
    """``torch.save`` to ``path`` atomically: tmp file + fsync + rename (+ keep the old file as ``*.prev.pt``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, (OSError, RuntimeError)):  # torch's zip writer reports a full disk as RuntimeError
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
            raise CheckpointWriteError(f"could not write checkpoint {path}: {reason}; "
                                       f"the previous checkpoint is intact") from err
        raise


def previous_path(path: Path) -> Path:
    return path.with_name(path.stem + ".prev" + path.suffix)


def load_checkpoint_file(path: os.PathLike) -> Dict[str, Any]:
    """Load and sanity-check one checkpoint file (weights_only, on CPU)."""
    path = Path(path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"{path} is not a moh-vision checkpoint (no 'model' entry)")
    return ckpt


def load_with_fallback(path: os.PathLike) -> Tuple[Dict[str, Any], Path]:
    """Load ``path``; if it is truncated or corrupt, warn naming it and use its ``.prev`` twin."""
    path = Path(path)
    candidates = [path, previous_path(path)]
    errors = []
    for cand in candidates:
        if not cand.exists():
            continue
        try:
            return load_checkpoint_file(cand), cand
        except Exception as err:  # corrupt zip, truncated pickle, wrong content
            log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", cand, type(err).__name__, err)
            errors.append(f"{cand.name}: {type(err).__name__}")
    if errors:
        raise ConfigError(f"no readable checkpoint at {path} ({'; '.join(errors)})")
    raise ConfigError(f"checkpoint {path} does not exist")


def resolve_resume(resume: Optional[str], out_dir: Path) -> Optional[Path]:
    """``auto``: last.pt in this run's output dir if any; ``None``/``never``: fresh; else an explicit path."""
    if resume in (None, "", "never", "none", False):
        return None
    if resume == "auto":
        last = out_dir / "checkpoints" / "last.pt"
        return last if last.exists() or previous_path(last).exists() else None
    path = Path(str(resume))
    if not path.exists() and not previous_path(path).exists():
        raise ConfigError(f"trainer.resume={resume}: no such checkpoint file")
    return path


def capture_rng() -> Dict[str, Any]:
    import random

    import numpy as np
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    import random

    import numpy as np
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
    import numpy as np
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached"])
