"""Run a script with one of its atomic writes stalled half-way, for a test to kill the process inside it.

``python tests/slow_write.py <file name> <occurrence> <marker> <script> <args...>``: the ``occurrence``-th write (from
1) of a file named ``<file name>`` by :func:`moh_vision.checkpoints.atomic_write` (every atomic write and checkpoint
goes through it; with ``trainer.ckpt_async=true`` in the writer's thread) writes its whole content into its temporary
file, then writes the target's path into ``<marker>`` and sleeps: the temporary file is there, the rename never comes.
The library knows nothing of this: the function is replaced before the script runs, in this process only."""
from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path


def main(name: str, occurrence: str, marker: str, script: str, *args: str) -> None:
    from moh_vision import checkpoints
    original, seen = checkpoints.atomic_write, [0]

    def stalled(path, write, *rest, **options):
        if Path(path).name != name:
            return original(path, write, *rest, **options)
        seen[0] += 1
        if seen[0] != int(occurrence):
            return original(path, write, *rest, **options)

        def half_way(handle):
            write(handle)
            handle.flush()
            Path(marker).write_text(str(path))
            time.sleep(3600)  # killed here
        return original(path, half_way, *rest, **options)

    for module in list(sys.modules.values()):  # the modules that imported it by name already, and the module itself
        ours = getattr(module, "__name__", "").startswith("moh_vision")
        if ours and getattr(module, "atomic_write", None) is original:
            module.atomic_write = stalled
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
