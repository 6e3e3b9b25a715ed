"""torchrun / DDP plumbing: one process per device, rank 0 alone logs and saves.

The process group and every collective wait at most ``trainer.dist_timeout_s``. A rank that fails posts its one-line
error to the process group's store before it leaves the group (:func:`settle_failure`); a rank whose collective then
fails (its peer left: gloo at once, a timeout otherwise) reads it and stops with ``rank N failed: <error>``, so every
rank ends with the error that ended the job, not with a broken connection or after a silent wait."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from moh_vision.errors import RunError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    timeout_s: float = 1800.0  # the process group's and each collective's limit (trainer.dist_timeout_s)
    store: Any = dataclasses.field(default=None, compare=False, repr=False)  # the process group's store, when joined
    store_server: Optional[int] = dataclasses.field(default=None, compare=False, repr=False)  # its pid, rank 0 forked

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            from moh_vision.errors import ConfigError
            raise ConfigError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu or auto")
        return torch.device("cuda", local_rank)
    return torch.device(name)


def _export_submitit_env() -> None:
    """Under the submitit SLURM launcher (one task per GPU) set the env:// variables torchrun would."""
    if "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    if "SUBMITIT_EXECUTOR" not in os.environ and "SUBMITIT_FOLDER" not in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def process_info(device: str = "auto") -> DistInfo:
    """This process's rank, world size and device as torchrun (or submitit) set them, joining no process group."""
    _export_submitit_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistInfo(rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
                    local_rank=local_rank, device=pick_device(device, local_rank))


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group when launched by torchrun or submitit (WORLD_SIZE > 1); NCCL on GPU, gloo on CPU.
    Joining (the rendezvous) and every collective wait at most ``timeout_s``."""
    info = dataclasses.replace(process_info(device), timeout_s=float(timeout_s))
    if info.world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        server = None  # the store outlives each rank: torchrun's agent serves it, or a process rank 0 forks
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and info.is_main:
            server = _fork_store_server(host, port, info.world_size, timeout)
        try:
            store = dist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)  # failures go here
            if info.device.type == "cuda":
                torch.cuda.set_device(info.device)
            dist.init_process_group(backend="nccl" if info.device.type == "cuda" else "gloo", store=store,
                                    rank=info.rank, world_size=info.world_size, timeout=timeout)
        except RuntimeError as err:
            if not is_timeout(err):
                raise
            raise RunError(f"rank {info.rank} waited trainer.dist_timeout_s={timeout_s:g} s for the {info.world_size} "
                           f"ranks to join at MASTER_ADDR:MASTER_PORT={host}:{port}: a rank did not start, failed "
                           f"before it joined, or started later than that") from err
        info = dataclasses.replace(info, store=store, store_server=server)
    return info


def _fork_store_server(host: str, port: int, world_size: int, timeout: timedelta) -> int:
    """The job's store (``MASTER_ADDR:MASTER_PORT``) where no torchrun agent serves it (submitit, srun): served by a
    process forked before any store, process group or CUDA context exists, not by rank 0 itself as torch's rendezvous
    would, so that what a failing rank 0 posts as it leaves is there for the others to read (:func:`settle_failure`).
    It serves until rank 0 (this process) is gone or its job is over (:func:`cleanup`), then until every rank read the
    failure rank 0 posted (``WAIT_FOR_READERS_S`` at most; at once when none was posted). It ignores the preemption
    signals (the trainer's to handle) and writes nothing. Returns its pid."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server: never returns
        try:
            os.close(read_end)
            for name in ("SIGINT", "SIGHUP", *PREEMPT_SIGNALS):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
            quiet = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(quiet, fd)
            try:
                server = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
            except Exception as err:
                os.write(write_end, f"{type(err).__name__}: {str(err).strip().splitlines()[0]}".encode())
                os._exit(1)
            os.write(write_end, b"serving")
            os.close(write_end)
            while os.getppid() == parent and not server.check([JOB_OVER]):
                time.sleep(0.1)
            end = time.monotonic() + WAIT_FOR_READERS_S
            while 0 < (failed := server.add(FAILURES, 0)) and server.add(SEEN, 0) + failed < world_size:
                if time.monotonic() > end:
                    break
                time.sleep(0.05)
        finally:
            os._exit(0)
    os.close(write_end)
    told = os.read(read_end, 4096).decode(errors="replace")
    os.close(read_end)
    if told != "serving":
        os.waitpid(pid, 0)
        raise RunError(f"rank 0 could not serve the job's store at MASTER_ADDR:MASTER_PORT={host}:{port} "
                       f"({told or 'its process died'}): is another job using that port?")
    return pid


# -- A failure on one rank ends every rank with its error --------------------------------------------------------------
FAILURES = "moh_vision/failures"  # the store's count of ranks that posted a failure; each is at FAILURES/<n>
SEEN = "moh_vision/failures_seen"  # how many ranks read one
JOB_OVER = "moh_vision/job_over"  # set by rank 0's cleanup: the store's server may go
WAIT_FOR_READERS_S = 10.0  # how long the store's server keeps serving the others once a failing rank 0 is gone


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a collective or a store wait that ran out of time: gloo's ``Timed out waiting ...``, the
    store's ``wait timeout after ...`` (a group's creation, joining), NCCL's watchdog, a ``*Timeout*`` exception."""
    text = str(err).lower()
    return ((isinstance(err, RuntimeError) and ("timed out" in text or "timeout" in text))
            or "Timeout" in type(err).__name__)


def settle_failure(err: BaseException, info: DistInfo, line: str) -> Optional[str]:
    """Called by a rank that fails with ``err`` (``line``: its one-line message) before it leaves the process group.
    When another rank failed first and ``err`` is what that did to this rank (a collective that broke or timed out: a
    RuntimeError), returns ``rank N failed: <its line>``, the error to stop with. Otherwise posts ``line`` (a timeout's
    own line: what it means) for the others and returns None, or the timeout's line. A rank in a collective reads it
    once the failing rank left the group (its collective breaks then), from a store that outlives every rank
    (:func:`_fork_store_server`)."""
    store = info.store
    if store is None or not info.enabled:
        return None
    own = (f"waited trainer.dist_timeout_s={info.timeout_s:g} s in a collective and no rank reported an error: a rank "
           f"is stuck, or works alone for longer than that (a slow checkpoint write: raise it) ({line})"
           if is_timeout(err) else None)
    try:
        if isinstance(err, RuntimeError) and store.add(FAILURES, 0) > 0:
            rank, _, first = store.get(f"{FAILURES}/1").decode().partition("\t")
            store.add(SEEN, 1)
            return f"rank {rank} failed: {first}"
        line = own or line
        number = store.add(FAILURES, 1)
        store.set(f"{FAILURES}/{number}", f"{info.rank}\t{line}")
    except Exception:  # the store is gone (the rank that hosted it left): nothing more to learn
        return own
    return own


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def _all_reduce(t: torch.Tensor, info: DistInfo, op: str) -> torch.Tensor:
    if info.enabled:
        t = t.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    return _all_reduce(t, info, "SUM")


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The largest value over ranks, element-wise (the slowest rank's times)."""
    return _all_reduce(t, info, "MAX")


def broadcast_object(obj: Any, info: DistInfo, src: int = 0) -> Any:
    if not info.enabled:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def reduce_sums(sums: Dict[str, float], info: DistInfo, device: torch.device) -> Dict[str, float]:
    """Sum a dict of floats over ranks (same keys on every rank)."""
    if not info.enabled or not sums:
        return dict(sums)
    keys = sorted(sums)
    t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    t = all_reduce_sum(t, info)
    return dict(zip(keys, t.tolist()))


def cleanup(info: DistInfo) -> None:
    """Leave the process group; on rank 0, end the store's server it forked: at once (before the next job of a
    multirun binds the same port) when no failure was posted, else once the others read it."""
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
    if info.store_server is not None:
        try:
            info.store.set(JOB_OVER, "1")
            if info.store.add(FAILURES, 0) == 0:
                os.waitpid(info.store_server, 0)
        except (ChildProcessError, RuntimeError):  # ended by an earlier call
            pass


# -- Preemption --------------------------------------------------------------------------------------------------------
# Preemption: a signal asks the trainer to finish its step, save, and stop.
#
# Under DDP every rank must stop at the same step, though a signal may reach only some of them. Each step all-reduces
# this rank's flag asynchronously, on a gloo group of host tensors (never the device), and reads the previous step's
# result: a stop is agreed one step after the signal, and no step waits for the other ranks.
#
# Under torchrun, the agent forwards the signals it handles (``--signals-to-handle``, default SIGTERM, SIGINT, SIGHUP,
# SIGQUIT) to the workers and any other one kills the agent, leaving its workers to train on without a checkpoint. So
# ``sbatch --signal=B:USR1`` needs ``torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``; the first
# rank warns at the start when a SLURM job runs torchrun without it (:func:`slurm_torchrun_warning`). The agent signals
# each worker's process group: the loader workers a trainer forked get it too, and ignore it.

# SLURM sends SIGTERM on preemption and, with --signal, SIGUSR1/SIGUSR2 before a time limit
# (the submitit launcher uses SIGUSR2 and requeues the job from its own handler).
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
TORCHRUN_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun's agent forwards unless told otherwise


class Preempted(Exception):
    """Raised after a preemption signal once the step finished and the checkpoint is saved."""


def torchrun_drops(signal_name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process runs under a torchrun agent that does not forward ``signal_name`` (the signal then kills the
    agent and never reaches this process). torchrun exports what its agent handles as
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``; one that does not export it handles the default set."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return False
    handled = environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCHRUN_DEFAULT_SIGNALS)
    return signal_name not in {name.strip() for name in handled.split(",")}


def slurm_torchrun_warning(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A line for train.log when a SLURM job runs torchrun whose agent would not forward SIGUSR1 (what
    ``sbatch --signal=B:USR1`` sends it) to this run; None otherwise."""
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ or not torchrun_drops("SIGUSR1", environ):
        return None
    return (f"torchrun does not forward SIGUSR1 to this run: sbatch --signal=B:USR1 would kill torchrun and leave "
            f"no checkpoint; launch torchrun --signals-to-handle={TORCHRUN_DEFAULT_SIGNALS},SIGUSR1 (or send B:TERM)")


class StopSignals:
    """While entered (``with``), the preemption signals only note that a stop was asked for (``received``); on exit the
    handlers that were there before are back. ``dist``: the ranks that must agree (:meth:`agreed`)."""

    def __init__(self, dist: DistInfo = DistInfo()):
        self.dist = dist
        self.received: Optional[str] = None  # the name of the signal, once one arrived
        self.previous: Dict[int, Any] = {}
        self.pid = os.getpid()  # loader workers forked from this process inherit the handler: it ignores them
        self.group: Any = None  # under DDP: the gloo group the flags are all-reduced on
        self.flag: Optional[torch.Tensor] = None  # this rank's flag, then the all-reduced one: a CPU tensor
        self.flag_memory: Any = None  # the same memory as a NumPy array, which the loop reads and writes
        self.reduction: Any = None  # the all-reduce of the flag issued at the previous step

    def __enter__(self) -> "StopSignals":
        def handler(signum, _frame):
            if os.getpid() != self.pid:  # a loader worker: its trainer process stops it
                return
            self.received = signal.Signals(signum).name
            log.warning("received %s: finishing this step, saving, then exiting", self.received)

        for name in PREEMPT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    self.previous[sig] = signal.signal(sig, handler)
                except ValueError:  # not in the main thread
                    pass
        if self.dist.enabled and self.group is None:  # every rank enters at the same point: a group is made here
            import torch.distributed as tdist
            self.group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=self.dist.timeout_s))
            self.flag = torch.zeros(1)
            self.flag_memory = self.flag.numpy()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.reduction is not None:  # done long ago; a process group must not go with work pending
            try:
                self.reduction.wait()
            except RuntimeError:  # the ranks broke apart: the error that brought us here says why
                if exc[0] is None:
                    raise
            self.reduction = None
        self._restore()

    def agreed(self) -> bool:
        """Whether every rank stops now (every rank calls this once a step): in one process as soon as a signal arrived;
        under DDP when one had arrived on any rank by the previous step. Never waits: it reads the all-reduce issued a
        step ago (finished: the ranks met since, in this step's gradient all-reduce) and issues this step's."""
        if not self.dist.enabled:
            return self.received is not None
        import torch.distributed as tdist
        stop = False
        if self.reduction is not None:
            self.reduction.wait()
            stop = bool(self.flag_memory[0] > 0)  # host memory: nothing to wait for, no device to ask
        self.flag_memory[0] = 1.0 if self.received else 0.0
        self.reduction = tdist.all_reduce(self.flag, group=self.group, async_op=True)
        return stop

    def hand_over(self) -> None:
        """After saving, let a handler that was there before us (submitit's checkpoint-and-requeue)
        deal with the signal as it would have without us."""
        sig = getattr(signal, self.received or "", None)
        previous = self.previous.get(sig)
        if sig is None or not callable(previous) or previous in (signal.SIG_DFL, signal.SIG_IGN):
            return
        self._restore()
        log.warning("checkpoint saved; handing %s to the launcher's handler", self.received)
        previous(sig, None)

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
