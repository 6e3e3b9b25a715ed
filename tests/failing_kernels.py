"""Run a script (train.py) with some of the ops' implementations made to fail, as a kernel that does not compile or
launch fails: each raises a ``RuntimeError`` of two lines whenever it is called.

``python tests/failing_kernels.py <target>[,<target>...] <script> <args...>``; a target is ``<op>/<implementation>``
(the function registered in ``moh_vision.ops.OPS``) or ``<module>:<function>`` (a kernel an operator calls, looked up
when it runs, e.g. ``moh_vision.ops.aggregated:_cpu_backward``).
"""
from __future__ import annotations

import dataclasses
import importlib
import runpy
import sys
from typing import Callable


def failing(target: str) -> Callable:
    def fail(*args, **kwargs):
        raise RuntimeError(f"injected failure of {target}\nsecond line, which the warning leaves out")
    return fail


def inject(target: str) -> None:
    if ":" in target:
        module, name = target.split(":")
        setattr(importlib.import_module(module), name, failing(target))
        return
    from moh_vision.ops import OPS
    op, name = target.split("/")
    impls = OPS[op].impls
    impls[name] = dataclasses.replace(impls[name], fn=failing(target))


def main(targets: str, script: str, *args: str) -> None:
    import moh_vision  # noqa: F401  (registers the ops)
    for target in targets.split(","):
        inject(target)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
