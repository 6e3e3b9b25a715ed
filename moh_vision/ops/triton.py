"""Triton, where it is installed: the one place that imports it for the package's Triton kernels (routing, aggregated
attention, depthwise: :mod:`~moh_vision.ops.routing_triton`, ``aggregated_triton``, ``depthwise_triton``).

The kernels run compiled on CUDA tensors, or on CPU tensors under Triton's interpreter when ``TRITON_INTERPRET=1`` was
set before Python started (Triton decides at import whether its standard library is interpreted): how the tests check
them without a GPU."""
from __future__ import annotations

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None
