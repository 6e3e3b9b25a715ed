"""Run a script (``train.py``) with kernels that fail at every call, as a Triton kernel that cannot compile or launch
fails: ``python tests/failing_kernels.py <target>[,<target>...] <script> <args...>``.

A target is ``<op>/<implementation>`` (an implementation registered in ``moh_vision.ops.OPS``, replaced there) or
``<module>:<function>`` (a kernel an operator looks up by name when it runs, e.g.
``moh_vision.ops.aggregated:_cpu_backward``).
Each raises ``RuntimeError("injected failure of <target>")`` with a second line that the one-line warning leaves out."""
from __future__ import annotations

import dataclasses
import importlib
import runpy
import sys


def raising(target: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"injected failure of {target}\n(a second line of the error)")
    return kernel


def make_fail(target: str) -> None:
    if ":" in target:
        module, name = target.split(":")
        setattr(importlib.import_module(module), name, raising(target))
    else:
        from moh_vision.ops import OPS
        op, name = target.split("/")
        OPS[op].impls[name] = dataclasses.replace(OPS[op].impls[name], fn=raising(target))


if __name__ == "__main__":
    targets, script, *args = sys.argv[1:]
    import moh_vision.ops  # noqa: F401  (the ops register their implementations)
    for one in targets.split(","):
        make_fail(one)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
