"""torchrun / DDP plumbing: one process per device, rank 0 alone logs and saves.

The process group and every collective wait at most ``trainer.dist_timeout_s``. A rank that fails posts its one-line
error to the process group's store before it leaves the group (:func:`settle_failure`); a rank whose collective then
fails (its peer left: gloo at once, a timeout otherwise) reads it and stops with ``rank N failed: <error>``, so every
rank ends with the error that ended the job, not with a broken connection or after a silent wait."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    timeout_s: float = 1800.0  # the process group's and each collective's limit (trainer.dist_timeout_s)
    store: Any = dataclasses.field(default=None, compare=False, repr=False)  # the process group's store, when joined

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
        if info.device.type == "cuda":
            torch.cuda.set_device(info.device)
        timeout = timedelta(seconds=timeout_s)
        # the rendezvous init_process_group would make, done here to keep its store (failures are posted there)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group(backend="nccl" if info.device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        info = dataclasses.replace(info, store=store)
    return info


# -- A failure on one rank ends every rank with its error --------------------------------------------------------------
FAILURES = "moh_vision/failures"  # the store's count of ranks that posted a failure; each is at FAILURES/<n>
SEEN = "moh_vision/failures_seen"  # how many ranks read one
WAIT_FOR_READERS_S = 10.0  # a failing rank keeps its store (under submitit: rank 0 hosts it) this long for the others


def settle_failure(err: BaseException, info: DistInfo, line: str) -> Optional[str]:
    """Called by a rank that fails with ``err`` (``line``: its one-line message) before it leaves the process group.
    When another rank failed first and ``err`` is what that did to this rank (a collective that broke or timed out: a
    RuntimeError), returns ``rank N failed: <its line>``, the error to stop with. Otherwise posts ``line`` (a timeout's
    own line: what it means) for the others and returns None, or the timeout's line; rank 0 then waits (at most
    ``WAIT_FOR_READERS_S``) until every rank read or posted one."""
    store = info.store
    if store is None or not info.enabled:
        return None
    timed_out = (isinstance(err, RuntimeError) and "timed out" in str(err).lower()) or "Timeout" in type(err).__name__
    own = (f"waited trainer.dist_timeout_s={info.timeout_s:g} s in a collective and no rank reported an error: a rank "
           f"is stuck, or works alone for longer than that (a slow checkpoint write: raise it) ({line})"
           if timed_out else None)
    try:
        if isinstance(err, RuntimeError) and store.add(FAILURES, 0) > 0:
            rank, _, first = store.get(f"{FAILURES}/1").decode().partition("\t")
            store.add(SEEN, 1)
            return f"rank {rank} failed: {first}"
        line = own or line
        number = store.add(FAILURES, 1)
        store.set(f"{FAILURES}/{number}", f"{info.rank}\t{line}")
        if info.is_main:  # every other rank read a failure or posted its own, or the time is up
            end = time.monotonic() + min(WAIT_FOR_READERS_S, info.timeout_s)
            while store.add(SEEN, 0) + store.add(FAILURES, 0) < info.world_size and time.monotonic() < end:
                time.sleep(0.05)
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
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
