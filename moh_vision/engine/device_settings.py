"""The anchors' GPU settings, as options with the anchors' defaults, and what a run used of them.

- ``trainer.tf32`` (on, as DiT's train.py sets ``allow_tf32`` for matmuls and cuDNN): fp32 matmuls and convolutions run
  on TF32 tensor cores. CUDA only: on the CPU it would let oneDNN change what fp32 matmuls compute, for no TF32 gain.
- cuDNN benchmarking (on, as in timm's train.py) unless ``trainer.deterministic``: cuDNN times its kernels for each new
  shape and keeps the fastest (TransNeXt's depthwise convolutions otherwise take whatever its heuristic picks).
- Fused AdamW where torch has a fused kernel for the device (CUDA, CPU; foreach elsewhere): one kernel for the whole
  update, and it takes the skip decision of a non-finite step on the device (``found_inf``), so the host never reads it.
- ``trainer.grad_checkpointing``: the model's ``set_grad_checkpointing`` (set by ``fit_setup.build_parts``).

Process-wide flags are restored after a fit; ``summary.json`` records what the run used (:func:`device_settings`)."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

import torch

FUSED_OPTIMIZER_DEVICES = ("cuda", "cpu")  # where torch's AdamW has a fused kernel that takes found_inf

_FLAGS = ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
          (torch.backends.cudnn, "benchmark"))


@contextlib.contextmanager
def device_settings(tf32: bool, deterministic: bool, device: torch.device) -> Iterator[Dict[str, bool]]:
    """While entered: TF32 (``tf32``) and cuDNN benchmarking (unless ``deterministic``) on a CUDA ``device``.
    Yields the settings in effect (``tf32``, ``cudnn_benchmark``: false on other devices)."""
    previous = [getattr(owner, name) for owner, name in _FLAGS]
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
        torch.backends.cudnn.benchmark = not deterministic
    try:
        yield {"tf32": on_cuda and bool(tf32), "cudnn_benchmark": on_cuda and not deterministic}
    finally:
        for (owner, name), value in zip(_FLAGS, previous):
            setattr(owner, name, value)


def optimizer_kernel(device: torch.device) -> Dict[str, bool]:
    """The optimizer's implementation keyword for ``device``: ``fused`` where torch has the kernel, else ``foreach``."""
    return {"fused": True} if device.type in FUSED_OPTIMIZER_DEVICES else {"foreach": True}


def optimizer_kernel_of(optimizer: torch.optim.Optimizer) -> str:
    """``fused``, ``foreach`` or ``for-loop``: how ``optimizer`` runs its update (summary.json's ``optimizer_impl``)."""
    defaults: Dict[str, Any] = optimizer.defaults
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
