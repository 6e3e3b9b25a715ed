"""This package's C++ CPU kernels (one source file each under ``csrc/``, registering ``torch.library`` operators), built
on first use by torch's extension builder (g++ and ninja, ~10 s once per machine, torch version, vector instruction
set (:func:`vector_flags`) and source's content (:func:`shared_source`); cached under ``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``). Without a compiler the callers run their ATen formulas (same values) and say
so once; ``kernels=reference`` never builds them."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Dict, List, Tuple

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: Dict[str, bool] = {}  # per process: library name -> built and loaded


def vector_flags() -> Tuple[str, List[str]]:
    """The build's name suffix and compiler flags for the widest vector instructions worth using here: AVX2 and FMA
    where ATen itself dispatches to AVX2 or AVX-512 (``torch.backends.cpu.get_cpu_capability``, which
    ``ATEN_CPU_CAPABILITY`` can lower), else the compiler's baseline. The suffix keeps a build for one machine's
    instructions out of another's in a shared ``TORCH_EXTENSIONS_DIR``. (AVX-512 flags ran the kernels slower than
    AVX2 on a 2-core AMD EPYC: the rows are 24 numbers, and the position MLP's loops lost a third.)"""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "_avx2", ["-mavx2", "-mfma"]
    return "", []


def load_cpu_kernels(library: str, op: str, source: Path, what: str) -> bool:
    """Whether ``torch.ops.<library>.<op>`` (defined by ``source``) is loaded: :func:`build` on the first call in
    this process, its answer afterwards."""
    if library not in _loaded:
        with _lock:
            if library not in _loaded:
                _loaded[library] = build(library, op, source, what)
    return _loaded[library]


def shared_source(source: Path) -> Tuple[Path, str]:
    """``source`` as a file named by its content (``<TORCH_EXTENSIONS_DIR>/moh_vision_sources/<sha1>/``) and that
    digest's first 12 digits: the build's inputs are the content alone, not where the checkout is. (Built from each
    checkout's own path, two checkouts of the same code, or a test's copy of the project, rebuilt the kernel, 12 s of
    CPU, each time the other had built it: the build's command line names the source's path.)"""
    import hashlib
    import os

    from torch.utils.cpp_extension import get_default_build_root
    code = source.read_bytes()
    digest = hashlib.sha1(code).hexdigest()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    shared = root / "moh_vision_sources" / digest / source.name
    if not shared.is_file():
        shared.parent.mkdir(parents=True, exist_ok=True)
        part = shared.with_name(f".{source.name}.{os.getpid()}.tmp")
        part.write_bytes(code)
        os.replace(part, shared)  # whole, never half-written, for a process that builds beside this one
    return shared, digest[:12]


def build(library: str, op: str, source: Path, what: str) -> bool:
    """Build and load ``source`` unless ``torch.ops.<library>.<op>`` exists already: False (said once) if it cannot
    be built. ``what`` names the kernel in messages."""
    if hasattr(getattr(torch.ops, library), op):
        return True
    try:
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "no CUDA runtime" on CPU hosts
        from torch.utils import cpp_extension
        log.info("loading %s's C++ kernel (compiled on first use: ~10 s once per machine)", what)
        version = "".join(c if c.isalnum() else "_" for c in torch.__version__)  # a build per torch (its ABI)
        isa, flags = vector_flags()
        shared, digest = shared_source(source)
        cpp_extension.load(name=f"moh_vision_{library}_{version}{isa}_{digest}", sources=[str(shared)],
                           extra_cflags=["-O3", *flags], is_python_module=False, verbose=False)
        return True
    except Exception as error:  # no compiler, no ninja, a read-only cache: the formulas are exact too
        log.warning("%s's C++ kernel could not be built (%s); it runs as ATen operators (the same values; "
                    "kernels.<op>=reference skips the attempt)", what, str(error).splitlines()[0][:200])
        return False
