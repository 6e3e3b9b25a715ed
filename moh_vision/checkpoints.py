"""Checkpoint I/O, all of it: the trainer, ``eval.py``, the models' loaders and every tool use this module.

A checkpoint is a dict of tensors and plain Python types only (loads with ``weights_only=True``, tensors mapped from
the file, ``mmap``). :func:`atomic_save` and :func:`atomic_write` write a fsynced temporary file and rename it over the
target, so a crash or a full disk never leaves a half-written ``last.pt``; the previous one is kept as ``last.prev.pt``
for :func:`load_with_fallback`. One write can have further names (``also``: hard links of the file written, copies where
a link fails), each renamed into place whole. :class:`BackgroundWriter` runs writes in a thread, one at a time, on a
host copy of the state (:func:`host_copy`).
:func:`load_file` reads any file (``.safetensors`` too) with one-line errors for a missing, truncated, corrupt or
foreign one, and accepts ``argparse.Namespace`` (official TransNeXt / MoH / DiT releases pickle their arguments);
:func:`find_weights` finds the weights in ours (``model`` / ``model_ema``), DiT's (``model`` / ``ema``), timm's
(``state_dict`` / ``state_dict_ema``) and plain state dicts, with DDP's and ``torch.compile``'s prefixes stripped.

A run's checkpoints and their directory: numbered checkpoints and their retention (:class:`CheckpointHistory`), the
directory's name in a SLURM job (:func:`run_name`, the same after every requeue), one run per directory
(:class:`RunLock`), and what a resumed run may change in its config (:func:`config_changes`, :func:`record_config`)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import yaml

from moh_vision.errors import ConfigError, RunError, os_error_in, storage_problem

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


def atomic_write(path: os.PathLike, write: Callable[[BinaryIO], None], keep_previous: bool = False,
                 what: str = "file", also: Sequence[os.PathLike] = ()) -> Path:
    """``write(file)`` into a temporary file beside ``path``, fsync, then rename it over ``path`` (keeping the old file
    as ``*.prev.<suffix>`` with ``keep_previous``): readers never see a half-written file. Each of ``also`` gets the
    same file, written once: a hard link (a copy where the file system refuses one) made under a temporary name, then
    renamed over it, before ``path`` itself."""
    path = Path(path)
    temporary: List[str] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
        temporary.append(tmp)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        for other in map(Path, also):  # first: a kill in between leaves the older path, which resumes to here
            other_tmp = _second_name(tmp, other)
            temporary.append(other_tmp)
            os.replace(other_tmp, other)
            if other.parent != path.parent:
                _fsync_dir(other.parent)
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as err:
        for name in temporary:
            with contextlib.suppress(OSError):
                os.unlink(name)
        if isinstance(err, (OSError, RuntimeError)):  # torch's zip writer reports a full disk as RuntimeError
            cause = os_error_in(err)  # the operating system's reason, not the zip writer's
            if cause is None:
                reason = str(err).splitlines()[0]
            else:  # the temporary file's name says nothing to the user
                reason = cause.strerror if cause.filename in (None, *temporary) and cause.strerror \
                    else storage_problem(cause)
            raise CheckpointWriteError(f"could not write {what} {path} ({reason}); the previous {what} is intact") \
                from err
        raise
    return path


def _second_name(written: str, target: Path) -> str:
    """A temporary name beside ``target`` for the whole file ``written``: a hard link, else a fsynced copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        name = str(target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.link(written, name)
            return name
        except FileExistsError:
            continue
        except OSError as err:  # no hard links here (EPERM, EXDEV, EMLINK, ...): a copy
            log.debug("cannot link %s to %s (%s): copying", written, target, err)
            break
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        with os.fdopen(fd, "wb") as out, open(written, "rb") as source:
            shutil.copyfileobj(source, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return name


# The temporary files of the project's writes: atomic_write's (and its further names'), .<name>.<random>.tmp, and the
# profiler's trace, .<name>.json.tmp (moh_vision/engine/profiling.py)
PARTIAL_WRITE = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")


def remove_partial_writes(folder: os.PathLike, recursive: bool = False, skip: Sequence[str] = ()) -> List[Path]:
    """Delete the temporary files of writes killed half-way (SIGKILL, a node lost) in ``folder`` (and, ``recursive``,
    its subfolders but hidden ones and those named in ``skip``); what was removed. :func:`atomic_write` removes its own on any error it
    survives, so only a dead process leaves one: call this while no write can be under way there (a run holding its
    directory's lock, before its first write)."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        if recursive and entry.is_dir(follow_symlinks=False) and entry.name not in skip \
                and not entry.name.startswith("."):  # .hydra, .git: never written by atomic_write
            removed += remove_partial_writes(entry.path, recursive, skip)
        elif entry.is_file(follow_symlinks=False) and PARTIAL_WRITE.match(entry.name):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(Path(entry.path))
    return removed


def atomic_save(obj: Any, path: os.PathLike, keep_previous: bool = False, also: Sequence[os.PathLike] = ()) -> Path:
    """``torch.save`` to ``path`` atomically: tmp file + fsync + rename (+ keep the old file as ``*.prev.pt``); the
    names in ``also`` get the same file (one serialisation: :func:`atomic_write`)."""
    return atomic_write(path, lambda f: torch.save(obj, f), keep_previous, what="checkpoint", also=also)


def host_copy(obj: Any) -> Any:
    """A copy of ``obj`` (a checkpoint: containers, plain values, tensors) whose tensors are on the host and own their
    memory, as ``torch.save`` would see ``obj`` now: tensors that shared a storage share one copy of it (views stay
    views), so the saved file is the same. What a background write serialises while training changes the original."""
    storages: Dict[Tuple[str, int], torch.UntypedStorage] = {}
    memo: Dict[int, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = _host_tensor(value, storages)
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(obj)
    return copy.deepcopy(obj, memo)  # containers (and OrderedDict's metadata) copied; the tensors: the host copies


def _host_tensor(tensor: torch.Tensor, storages: Dict[Tuple[str, int], torch.UntypedStorage]) -> torch.Tensor:
    tensor = tensor.detach()
    storage = tensor.untyped_storage()
    key = (str(tensor.device), storage.data_ptr())
    if key not in storages:
        storages[key] = storage.clone() if tensor.device.type == "cpu" else storage.cpu()
    return torch.empty((0,), dtype=tensor.dtype).set_(storages[key], tensor.storage_offset(), tensor.size(),
                                                       tensor.stride())


class BackgroundWriter:
    """Writes run one at a time, in a thread (``threaded``) or at once. :meth:`submit` waits for the write before it;
    :meth:`wait` waits for the one under way. A write's error is raised by the next :meth:`submit` or :meth:`wait`, on
    the caller's thread; never lost."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()
        if not self.threaded:
            write()
            return

        def run() -> None:
            try:
                write()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                self.error = err

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Wait for the write under way; raise its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def previous_path(path: Path) -> Path:
    return path.with_name(path.stem + ".prev" + path.suffix)


def load_checkpoint_file(path: os.PathLike) -> Dict[str, Any]:
    """Load and sanity-check one of our training checkpoints (weights_only, on CPU)."""
    path = Path(path)
    ckpt = load_file(path)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ConfigError(f"{path} is not a moh-vision checkpoint (no 'model' entry)")
    return ckpt


def load_with_fallback(path: os.PathLike) -> Tuple[Dict[str, Any], Path]:
    """Load ``path``; if it is truncated or corrupt, warn naming it and use its ``.prev`` twin."""
    path = Path(path)
    errors = []
    for cand in (path, previous_path(path)):
        if not cand.exists():
            continue
        try:
            return load_checkpoint_file(cand), cand
        except ConfigError as err:  # corrupt zip, truncated pickle, wrong content
            log.warning("checkpoint %s is unreadable (%s); trying the previous one", cand, err)
            errors.append(f"{cand.name}: {err}")
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


def run_config(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """The training config of a run: ``<dir>/config.yaml`` (or ``<dir>/.hydra/config.yaml``) of a run directory, or the
    one inside a checkpoint file that ``train.py`` wrote."""
    where = Path(path).expanduser()
    if where.is_dir():
        for candidate in (where / "config.yaml", where / ".hydra" / "config.yaml"):
            if candidate.is_file():
                return yaml.safe_load(candidate.read_text()) or {}
        raise ConfigError(f"{path} holds no config.yaml; expected a directory written by train.py")
    if where.is_file():
        state = load_file(where)
        if not isinstance(state, dict) or not state.get("config"):
            raise ConfigError(f"{path} is a file without a training config; expected a train.py checkpoint")
        return state["config"]
    raise ConfigError(f"{path} does not exist; expected a run directory or a checkpoint")


# -- Reading any checkpoint file, and the weights inside it ------------------------------------------------------------
EMA_KEYS = ("model_ema", "ema", "state_dict_ema")  # ours, DiT's training script, timm
MODEL_KEYS = ("model", "state_dict", "module")
STRIP_PREFIXES = ("module.", "_orig_mod.")        # DistributedDataParallel, torch.compile
SAFE_GLOBALS = (argparse.Namespace,)               # what released training checkpoints pickle besides tensors


def load_file(path: Union[str, os.PathLike], trust_pickle: bool = False) -> Any:
    """The object saved in ``path`` (on CPU), or a :class:`ConfigError` that says in one line why not. Tensors, plain
    Python types and ``argparse.Namespace`` load safely (``weights_only=True``); ``trust_pickle=True`` loads any pickled
    object (run only on files you trust). Files in torch's zip format load with ``mmap=True``: the tensors map the
    file (private pages: writing to one never changes the file), so a load reads only what is used, once."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file as load_safetensors
            return load_safetensors(str(path), device="cpu")
        except Exception as err:  # noqa: BLE001 - any parse failure is a bad file
            raise ConfigError(f"{path} is not a readable safetensors file ({_first_line(err)})") from None
    mmap = _is_zip(path)  # torch's zip format: tensors mapped from the file, read as they are used (not legacy pickles)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's warnings about the pickle format are not the user's business
            if trust_pickle:
                return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
            with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "Unsupported global" in str(err) or "GLOBAL" in str(err):  # a pickled object, not a broken file
            raise ConfigError(
                f"{path} holds pickled Python objects besides tensors ({_unsupported_global(err)}); if you trust the "
                f"file, extract its weights: python tools/convert_checkpoint.py src={path} dst=<out.pt> "
                f"trust_pickle=true") from None
        reason = next((line.strip() for line in str(err).splitlines() if "invalid load key" in line), "")
        raise ConfigError(f"{path} is not a readable checkpoint ({reason or 'not a torch file'})") from None
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError, ImportError) as err:
        raise ConfigError(f"{path} is not a readable checkpoint (truncated or not a torch file: "
                          f"{_first_line(err)})") from None


def _is_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def find_weights(obj: Any, prefer: str = "auto", source: str = "checkpoint") -> Tuple[Dict[str, torch.Tensor], str]:
    """The state dict inside a loaded checkpoint and where it was (e.g. ``"['model_ema']"``). ``prefer``: ``auto`` takes
    EMA weights when present (what DiT releases and timm's loader prefers), ``ema`` requires them, ``model`` takes the
    raw weights. Wrapper prefixes are stripped."""
    if prefer not in ("auto", "ema", "model"):
        raise ConfigError(f"weights='{prefer}' is unknown; use auto, ema or model")
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{source} holds a {type(obj).__name__}, not a state dict or checkpoint dict")
    order = {"auto": EMA_KEYS + MODEL_KEYS, "ema": EMA_KEYS, "model": MODEL_KEYS}[prefer]
    where = ""
    while True:
        key = next((k for k in order if isinstance(obj.get(k), Mapping)), None)
        if key is None:
            break
        obj, where = obj[key], f"{where}[{key!r}]"
        order = EMA_KEYS + MODEL_KEYS if prefer == "ema" else order  # inside the EMA entry: any wrapper
    if prefer == "ema" and "ema" not in where:
        raise ConfigError(f"{source} has no EMA weights")
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors or len(tensors) != len(obj):
        other = [k for k in obj if not isinstance(obj[k], torch.Tensor)][:3]
        raise ConfigError(f"{source}{where} is not a state dict of tensors (e.g. entries {other}; looked under "
                          f"{', '.join(order)})")
    return strip_prefixes(tensors), where or "(top level)"


def read_weights(path: Union[str, os.PathLike], prefer: str = "auto", trust_pickle: bool = False
                 ) -> Dict[str, torch.Tensor]:
    """:func:`load_file` then :func:`find_weights`: the model weights of any checkpoint file we understand."""
    return find_weights(load_file(path, trust_pickle=trust_pickle), prefer, source=str(path))[0]


def strip_prefixes(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        bare = key
        while bare.startswith(STRIP_PREFIXES):
            bare = next(bare[len(p):] for p in STRIP_PREFIXES if bare.startswith(p))
        if bare in out:
            raise ConfigError(f"two keys map to '{bare}' after stripping {', '.join(STRIP_PREFIXES)} (e.g. {key})")
        out[bare] = value
    return out


def plain_tensors(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that own exactly their data (a saved view would save its whole base)."""
    out = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        out[key] = tensor
    return out


def state_dict_diff(expected: Mapping[str, Any], given: Mapping[str, Any], optional: Sequence[str] = ()
                    ) -> Tuple[List[str], List[str], List[str]]:
    """(missing, unexpected, reshaped) keys of ``given`` against ``expected``; ``optional`` keys may be missing."""
    skip = set(optional)
    missing = [k for k in expected if k not in given and k not in skip]
    unexpected = [k for k in given if k not in expected]
    reshaped = [k for k in given if k in expected and tuple(expected[k].shape) != tuple(given[k].shape)]
    return missing, unexpected, reshaped


def state_dict_mismatch(expected: Mapping[str, Any], given: Mapping[str, Any]) -> str:
    """One line describing missing / unexpected / reshaped keys ('' when the two fit)."""
    missing, unexpected, reshaped = state_dict_diff(expected, given)
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} keys with other shapes (e.g. {k}: {tuple(given[k].shape)} vs "
                     f"{tuple(expected[k].shape)})")
    return "; ".join(parts)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _unsupported_global(err: BaseException) -> str:
    for line in str(err).splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return line.strip()[:200]
    return _first_line(err)


def check_checkpoint_file(path: Union[str, os.PathLike]) -> Optional[str]:
    """None when ``path`` looks like a checkpoint a loader here can read (torch's zip or legacy pickle format, or
    safetensors), else what is wrong, in words. Reads a few bytes: fit for checking a config before a run starts; a file
    that passes can still be truncated (the loader then says so)."""
    path = Path(path).expanduser()
    if not path.exists():
        return "no such checkpoint file"
    if not path.is_file():
        return "not a file"
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # torch.save zip / legacy pickle
        return None
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size:
        return None  # safetensors: an 8-byte header length, then the JSON header
    return "not a checkpoint (neither torch.save's format nor safetensors)" if head else "an empty file"


def is_whole_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a checkpoint file that was written to its end: :func:`check_checkpoint_file`'s header test
    and, for torch's zip format, a readable central directory (written last, so a truncated file lacks it). Reads the
    file's header and its end, never the tensors."""
    path = Path(path)
    if check_checkpoint_file(path) is not None:
        return False
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"PK\x03\x04":
                return True  # legacy pickle or safetensors: the header test is all a cheap check can do
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


# -- Numbered checkpoints and their retention --------------------------------------------------------------------------
# Numbered checkpoints beside ``last.pt`` / ``last.prev.pt`` / ``best.pt``: ``checkpoints/step_0400000.pt`` every
# ``trainer.ckpt_history_every_steps`` optimizer steps and/or every ``trainer.ckpt_history_every_epochs`` epochs, the
# newest ``trainer.ckpt_keep`` kept (0: all). Each is a whole training checkpoint, written atomically (the trainer's
# numbered file is a hard link of the ``last.pt`` written with it: one serialisation), that ``trainer.resume=``,
# ``eval.py ckpt=`` and ``tools/sample.py ckpt=`` take like any other. Newest means last written (after a resume from an
# earlier one, the abandoned trajectory's later-numbered files stay until they are the oldest); retention never deletes
# the newest whole one (:func:`moh_vision.checkpoints.is_whole_checkpoint`).

NUMBERED = re.compile(r"^step_(\d+)\.pt$")


def numbered_name(step: int) -> str:
    """``step_0400000.pt``: seven digits (DiT's numbering) sort by name up to 10M steps."""
    return f"step_{step:07d}.pt"


def numbered_checkpoints(folder: Path) -> List[Tuple[int, Path]]:
    """(step, path) of the numbered checkpoints in ``folder``, newest written first (ties: the later step)."""
    found = []
    for entry in os.scandir(folder) if Path(folder).is_dir() else ():
        match = NUMBERED.match(entry.name)
        if match and entry.is_file():
            found.append((entry.stat().st_mtime_ns, int(match.group(1)), Path(entry.path)))
    return [(step, path) for _, step, path in sorted(found, reverse=True)]


def to_prune(newest_first: List[Tuple[int, Path]], keep: int) -> List[Path]:
    """The files beyond the newest ``keep`` (0: none), less the newest whole one when none of the kept is whole."""
    if keep <= 0 or len(newest_first) <= keep:
        return []
    kept, rest = [path for _, path in newest_first[:keep]], [path for _, path in newest_first[keep:]]
    if not any(is_whole_checkpoint(path) for path in kept):
        newest_whole = next((path for path in rest if is_whole_checkpoint(path)), None)
        rest = [path for path in rest if path != newest_whole]
    return rest


class CheckpointHistory:
    """When numbered checkpoints are due, and writing and pruning them (the main rank's job)."""

    def __init__(self, folder: Path, every_steps: int = 0, every_epochs: int = 0, keep: int = 0):
        self.folder, self.every_steps, self.every_epochs, self.keep = Path(folder), every_steps, every_epochs, keep

    def due_after_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_after_epoch(self, epochs_done: int) -> bool:
        return bool(self.every_epochs) and epochs_done % self.every_epochs == 0

    def write(self, state: Dict[str, Any], step: int) -> Path:
        """``state`` as ``step_<step>.pt`` (atomically), then the oldest beyond ``keep`` removed."""
        path = atomic_save(state, self.folder / numbered_name(step))
        self.prune()
        return path

    def prune(self) -> None:
        """Remove the numbered checkpoints beyond the newest ``keep``. A numbered file may be a hard link of
        ``last.pt`` or ``best.pt`` (one write, several names: ``Trainer.save``); removing the name leaves those."""
        for old in to_prune(numbered_checkpoints(self.folder), self.keep):
            try:
                old.unlink()
            except FileNotFoundError:
                continue
            log.info("removed %s (trainer.ckpt_keep=%d)", old, self.keep)


# -- A SLURM job's directory -------------------------------------------------------------------------------------------
def slurm_job(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """This process's SLURM job as its requeues keep it: ``<job id>``, or ``<array job id>_<task id>`` for an array
    task (``%A_%a`` in sbatch's file names); None outside SLURM."""
    environ = os.environ if environ is None else environ
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def run_name(job_name: str, default: str) -> str:
    """The ``${run_name:}`` resolver of ``hydra.run.dir``: ``slurm-<job>`` for a ``train`` job inside SLURM, the same
    after every requeue, so the requeued job resumes from its directory's last.pt; ``default`` (the date and time)
    otherwise."""
    job = slurm_job()
    return f"slurm-{job}" if job and job_name == "train" else default


# -- The run directory: its SLURM name, its lock, the configs it was trained with --------------------------------------
# The run directory's own rules: its name in a SLURM job (:func:`run_name`), one run at a time (:class:`RunLock`), what
# a resumed run may change in its config (:func:`config_changes`), and the record of every config the run was trained
# with (:func:`record_config`).

LOCK_NAME = ".run.lock"
HISTORY_DIR = "config_history"

# Options a resumed run may change freely: they change how a run is executed, logged or checkpointed, not its weights,
# optimizer, schedule or data order. Any other change needs trainer.extend=true.
FREE_TO_CHANGE = (
    "trainer.resume", "trainer.extend", "trainer.progress", "trainer.log_every", "trainer.ckpt_every_steps",
    "trainer.num_workers", "trainer.val_every_epochs", "trainer.val_batch_size", "trainer.val_at_start",
    "trainer.count_flops", "trainer.requeue_on_preempt", "trainer.dist_timeout_s", "trainer.throughput_warmup_steps",
    "trainer.max_nonfinite_in_a_row", "trainer.device", "trainer.compile", "trainer.compile_mode", "trainer.tf32",
    "trainer.grad_checkpointing", "logger", "tag",
    "model.checkpoint_path", "model.init_from", "data.root", "task.sample", "task.vae",
    "trainer.ckpt_history_every_steps", "trainer.ckpt_history_every_epochs", "trainer.ckpt_keep", "trainer.profile",
    "data.index_cache", "trainer.ddp.broadcast_buffers", "trainer.ddp.gradient_as_bucket_view",
    "trainer.ddp.bucket_cap_mb", "trainer.ckpt_async",
)

# Options added after runs were saved without them, with the value that keeps the training as it was then: a config
# without one (a checkpoint of an earlier release) is compared as if it held that value.
ADDED_LATER = {"optim.momentum": 0.9, "optim.layer_decay": None, "optim.kwargs": {}, "sched.cooldown_epochs": 0,
               "data.source": "auto", "data.class_order": "sorted", "data.class_map": None, "data.val_labels": None}


# -- One run per directory ---------------------------------------------------------------------------------------------
class RunLock:
    """``<run dir>/.run.lock``, holding the owner's pid, host, start time and SLURM job, while a run trains there
    (``with RunLock(dir):``). A second run on the directory stops with a :class:`ConfigError` naming the first; a lock
    whose process is gone (same host, dead pid) is taken over with a warning, and so is one left by an earlier run of
    this SLURM job on any host (killed with its node, then requeued); a lock from another host and job cannot be checked
    (the error says how to remove it). Creating the lock is the run's first write: an unwritable directory fails here,
    by its cause."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK_NAME
        self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "slurm_job": slurm_job()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(3):  # a stale lock is removed, then taken like a free one
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    self._remove_stale(me["host"], me["slurm_job"])
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                self.held = True
                return
        except OSError as err:
            raise ConfigError(f"cannot use the run directory {self.path.parent}: {storage_problem(err)}") from None
        raise ConfigError(f"cannot take the lock {self.path}: other runs keep taking it")

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.held and (self._owner() or {}).get("pid") == os.getpid():
            try:
                self.path.unlink()
            except OSError as err:
                log.warning("could not remove the run lock (%s)", storage_problem(err))
        self.held = False

    def _owner(self) -> Optional[Dict[str, Any]]:
        try:
            owner = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or damaged: nobody can say whose it is
        return owner if isinstance(owner, dict) else {}

    def _remove_stale(self, host: str, job: Optional[str]) -> None:
        owner = self._owner()
        if owner is None:  # released meanwhile
            return
        pid, where, owner_job = owner.get("pid"), owner.get("host"), owner.get("slurm_job")
        here = where == host and isinstance(pid, int)
        same_job = job is not None and owner_job == job  # a requeued job: its earlier run is gone, wherever it ran
        if (here or same_job) and not (here and _alive(pid)):
            why = f"an earlier run of SLURM job {job}" if same_job else "a run that is gone"
            log.warning("taking over the lock of %s (pid %s on %s, started %s): %s", why, pid, where,
                        owner.get("started", "?"), self.path)
            self.path.unlink(missing_ok=True)
            return
        of_job = f", SLURM job {owner_job}" if owner_job else ""
        who = f"pid {pid} on {where}{of_job}, started {owner.get('started', '?')}" if owner else "an unreadable lock"
        check = "" if where == host else "; if that run is gone, delete the lock"
        raise ConfigError(f"another run is using {self.path.parent} ({who}): use another output directory "
                          f"(hydra.run.dir=...) or wait for it to finish{check} ({self.path})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# -- A resumed run's config --------------------------------------------------------------------------------------------
def _flat(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _free(key: str) -> bool:
    return any(key == free or key.startswith(free + ".") for free in FREE_TO_CHANGE)


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """``key: old -> new`` of each option (but :data:`FREE_TO_CHANGE`) that differs between a saved config and this."""
    old, new = ({**ADDED_LATER, **_flat(config)} for config in (saved, current))
    keys = sorted(k for k in set(old) | set(new) if not _free(k) and old.get(k) != new.get(k))
    return [f"{k}: {_text(old.get(k))} -> {_text(new.get(k))}" for k in keys]


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def record_config(out_dir: Path, config: Dict[str, Any], step: int) -> None:
    """Write ``config.yaml``: the config the run trains with now. When it replaces a different one (a resume with
    changed options), both stay in ``config_history/<n>_step<first step>.yaml``."""
    current = Path(out_dir) / "config.yaml"
    previous = yaml.safe_load(current.read_text()) if current.is_file() else None
    if previous is not None and previous != config:
        history = Path(out_dir) / HISTORY_DIR
        count = len(list(history.glob("*_step*.yaml")))
        if count == 0:  # the run's first config, trained from step 0
            _write_yaml(history / "0_step0.yaml", previous)
            count = 1
        _write_yaml(history / f"{count}_step{step}.yaml", config)
    _write_yaml(current, config)


def _write_yaml(path: Path, config: Dict[str, Any]) -> None:
    from omegaconf import OmegaConf
    text = OmegaConf.to_yaml(OmegaConf.create(config))
    atomic_write(path, lambda f: f.write(text.encode()), what="config")
