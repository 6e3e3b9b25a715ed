"""torchrun / DDP plumbing: one process per device, rank 0 alone logs and saves."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

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


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun or submitit (WORLD_SIZE > 1); NCCL on GPU, gloo on CPU."""
    info = process_info(device)
    if info.world_size > 1 and not dist.is_initialized():
        if info.device.type == "cuda":
            torch.cuda.set_device(info.device)
        dist.init_process_group(backend="nccl" if info.device.type == "cuda" else "gloo")
    return info


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
