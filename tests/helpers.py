"""Run the real entry points in subprocesses, as a user would, with shrunk settings."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]

# A short classification run on the embedded digits: the real configs, shrunk.
FAST_TRAIN = ("trainer.epochs=1", "trainer.max_steps=3", "trainer.batch_size=32", "trainer.progress=false",
              "trainer.log_every=1", "trainer.num_workers=0")


def run_entry(script: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: int = 600,
              check: bool = True, launcher: Sequence[str] = (), root: Path = REPO) -> subprocess.CompletedProcess:
    """``python <script> <args>`` from the repository root (or a copy of it: ``root``); raises with the
    output on failure."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
                "HYDRA_FULL_ERROR": "1", **(env or {})}
    cmd = [*launcher, str(root / script), *args] if launcher else [sys.executable, str(root / script), *args]
    proc = subprocess.run(cmd, cwd=root, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def load_tool(name: str):
    """Import ``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def bf16_train_outputs(modules, x):
    """Each module's train-mode output under CPU bf16 autocast (checked bf16, with a finite input
    gradient after a backward), as float: what the sparse-vs-masked autocast tests compare."""
    import torch
    outs = []
    for m in modules:
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m.train()(xi)
        assert y.dtype == torch.bfloat16
        y.float().square().mean().backward()
        assert torch.isfinite(xi.grad).all()
        outs.append(y.float())
    return outs


def recorded_backward(m, x, grad_out, train: bool):
    """One forward in a routing recorder, then backward of ``sum(y * grad_out) + aux`` (aux at weight 1):
    ``(y, input gradient, {parameter: gradient}, recorder)``, what the sparse-vs-masked tests compare."""
    from moh_vision.attention import record_routing
    m.train(train)
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with record_routing(m) as routing:
        y = m(x)
    ((y * grad_out).sum() + routing.aux_loss(coef=1.0)).backward()
    return y.detach(), x.grad, {name: p.grad for name, p in m.named_parameters()}, routing


def model_config(name: str, **overrides) -> dict:
    """A model config as train.py passes it to a task: every key present."""
    return {"name": name, "checkpoint_path": None, "init_from": None, "kwargs": {}, **overrides}


ATTENTION_PRESET = {"name": None, "aux_loss_weight": 0.01}  # keep the model's own attention


def trainer_config(**overrides):
    """The trainer's typed config with the defaults of the schema, shrunk for tests (no progress bar,
    no FLOP count); ``ema={...}`` overrides the EMA options."""
    from moh_vision.config import EmaConfig, TrainerConfig
    ema = EmaConfig(**overrides.pop("ema", {}))
    settings = {"progress": False, "count_flops": False, "device": "cpu", **overrides}
    return TrainerConfig(ema=ema, **settings)
