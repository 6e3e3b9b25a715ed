"""Triton, where it is installed: the one place that imports it for the package's Triton kernels (MoH's routing,
:mod:`~moh_vision.attention.triton_routing`; TransNeXt's aggregated attention,
:mod:`moh_vision.models.triton_aggregated`).

``impl="triton"`` (MoH's routed heads in a Triton flash-attention kernel over per-head token lists) was removed:
on one H100 it was slower than the masked path at every shape measured, fp32 and bf16 (1.30-28.98x dense
forward, ``docs/performance.md``), and ``impl="auto"`` never picked it. Its code is in git history (``git log
-- moh_vision/attention/triton_moh.py``).

The kernels run compiled on CUDA tensors, or on CPU tensors under Triton's interpreter when
``TRITON_INTERPRET=1`` was in the environment before Python started (Triton decides at import time whether
its own standard library is interpreted): how the tests check them on a machine without a GPU.
"""
from __future__ import annotations

import os

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
