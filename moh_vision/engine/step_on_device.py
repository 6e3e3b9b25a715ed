"""A training step that never makes the host wait for the device or for the other ranks.

Whether a step is skipped is decided on the device, as ``GradScaler`` decides with its ``found_inf``:

- A non-finite loss seeds its backward with NaN (:func:`loss_for_backward`), so every gradient it reaches is NaN; DDP's
  all-reduce spreads them, and every rank's gradient norm is non-finite: all skip the same step without asking.
- The gradient norm (:func:`gradient_norm`, clipping on the way) stays a tensor; a fused optimizer takes the skip flag
  as its ``found_inf`` (:func:`step_unless`) and leaves the parameters, moments and step counts as they were.
- What the step leaves to be counted (its loss and parts, gradient norm, routing statistics and skip flag) stays on the
  device, one vector per step (:class:`PendingSteps`). At a log interval, a checkpoint, an epoch's end or a stop,
  :meth:`PendingSteps.settle` reads all pending steps in one copy to the host (under DDP after one all-reduce of their
  skip flags, so every rank counts the same skipped steps); the meters, the log window and the skip counters take
  them as they took each step's values: the same numbers, added in the same order.

Where the device cannot decide, the host reads the flag once a step: an optimizer without a fused kernel (no
``found_inf``; with ``trainer.amp=fp16`` GradScaler reads it then)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import Tensor, nn

from .distributed import DistInfo, all_reduce_max

# What the meters and the log window read of a task's loss dict, besides every ``log/<name>``.
KEPT = ("loss", "ce", "aux", "num_samples", "routing")


# ---- The skip decision, on the device --------------------------------------------------------
def loss_for_backward(loss: Tensor, finite: Tensor, accum: int) -> Tensor:
    """``loss / accum``, or NaN where ``finite`` is false: the NaN seeds the backward and reaches the
    gradients (and through DDP every rank's), so the step is skipped everywhere without a host read."""
    return loss / torch.where(finite, float(accum), float("nan"))


def gradient_norm(parameters: Sequence[nn.Parameter], max_norm: float) -> Tensor:
    """The gradients' total 2-norm; with ``max_norm > 0`` the gradients are first clipped to it (the norm
    returned is the one before clipping). A tensor on the device: nothing waits for it."""
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in parameters])  # no clipping: no pass over the gradients


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` can skip on a device flag (the fused optimizers, as GradScaler asks them)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """``optimizer.step()``, a no-op on the device where ``skip`` is true: the optimizer gets the flag as
    GradScaler hands it its ``found_inf`` (``takes_found_inf`` must hold)."""
    optimizer.grad_scale, optimizer.found_inf = None, skip.to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


# ---- The steps' records, on the device until read --------------------------------------------
@dataclass(frozen=True)
class _Leaf:
    """Where a tensor of a step's records sits in its vector: its position among the step's tensors."""

    position: int


def _split(tree: Any, tensors: List[Tensor]) -> Any:
    """``tree`` (dicts, lists, tuples) with each tensor, detached and appended to ``tensors``, replaced by a _Leaf."""
    if isinstance(tree, Tensor):
        tensors.append(tree.detach())
        return _Leaf(len(tensors) - 1)
    if isinstance(tree, dict):
        return {key: _split(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split(value, tensors) for value in tree)
    return tree


def _fill(tree: Any, tensors: Sequence[Tensor]) -> Any:
    """The inverse of :func:`_split`, with ``tensors`` in the leaves."""
    if isinstance(tree, _Leaf):
        return tensors[tree.position]
    if isinstance(tree, dict):
        return {key: _fill(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(value, tensors) for value in tree)
    return tree


@dataclass(frozen=True)
class SettledStep:
    """One optimizer step, read: ``index`` (the trainer's step before it), ``skipped`` (for a non-finite loss
    or gradient, on any rank), its micro-batches' loss dicts (``outs``: the :data:`KEPT` keys and every
    ``log/<name>``, tensors on the CPU) and its gradient norm before clipping."""

    index: int
    skipped: bool
    outs: List[Dict[str, Any]]
    grad_norm: float


class PendingSteps:
    """The optimizer steps taken since the last :meth:`settle`, each packed into one device vector."""

    def __init__(self):
        self.flags: List[Tensor] = []    # per step: skipped (bool, one element)
        self.vectors: List[Tensor] = []  # per step: its tensors, flattened and concatenated
        self.layouts: List[Tuple[int, Any, List[Tuple[torch.Size, torch.dtype]]]] = []  # (index, tree, shapes)

    def __len__(self) -> int:
        return len(self.flags)

    def add(self, index: int, outs: Sequence[Mapping[str, Any]], grad_norm: Tensor, skipped: Tensor) -> None:
        """Step ``index``: its micro-batches' loss dicts, gradient norm and skip flag (all left on the device)."""
        kept = [{key: value for key, value in out.items() if key in KEPT or key.startswith("log/")} for out in outs]
        tensors: List[Tensor] = []
        tree = _split({"outs": kept, "grad_norm": grad_norm}, tensors)
        self.flags.append(skipped.reshape(1))
        # one kernel; cat promotes to the widest floating type present, exact for bool, fp16, bf16 and fp32 (the
        # norm of no gradients is a CPU zero: moved, without a wait)
        self.vectors.append(torch.cat([t.reshape(-1).to(skipped.device) for t in tensors]))
        self.layouts.append((index, tree, [(t.shape, t.dtype) for t in tensors]))

    def settle(self, dist: DistInfo) -> List[SettledStep]:
        """Every pending step, read in one copy to the host (under DDP their skip flags first all-reduced with MAX:
        skipped on any rank is skipped on all); nothing pending afterwards. Every rank calls this at the same steps."""
        if not self.flags:
            return []
        flags = torch.cat(self.flags).to(torch.float32)
        if dist.enabled:
            flags = all_reduce_max(flags, dist)
        host = torch.cat([flags, *self.vectors]).cpu()
        settled, offset = [], len(self.flags)
        for skipped, (index, tree, shapes) in zip(host[:len(self.flags)].tolist(), self.layouts):
            tensors = []
            for shape, dtype in shapes:
                size = shape.numel()
                tensors.append(host[offset:offset + size].reshape(shape).to(dtype))
                offset += size
            values = _fill(tree, tensors)
            settled.append(SettledStep(index=index, skipped=skipped > 0, outs=values["outs"],
                                       grad_norm=float(values["grad_norm"])))
        self.flags, self.vectors, self.layouts = [], [], []
        return settled
