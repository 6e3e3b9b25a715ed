"""Triton, where it is installed: the one place that imports it for the package's Triton kernels (MoH's routing,
:mod:`~moh_vision.ops.routing_triton`; TransNeXt's aggregated attention, :mod:`~moh_vision.ops.aggregated_triton`;
the depthwise convolution candidate, :mod:`~moh_vision.ops.depthwise_triton`).

The kernels run compiled on CUDA tensors, or on CPU tensors under Triton's interpreter when ``TRITON_INTERPRET=1``
was in the environment before Python started (Triton decides at import time whether its own standard library is
interpreted): how the tests check them on a machine without a GPU.
"""
from __future__ import annotations

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None
