"""Routing helpers shared by the routed variants: head budgets, top-k gates, losses, statistics."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from moh_vision.errors import ConfigError
from moh_vision.ops.routing import load_balance_loss, renormalised_topk_gates, topk_mask  # noqa: F401 (re-exported)
from .recorder import LayerRecord, active_recorder
from .registry import AttentionVariant

Tensor = torch.Tensor


def check_ratio(activation_ratio: float) -> float:
    ratio = float(activation_ratio)
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"activation_ratio={activation_ratio} is outside (0, 1]; it is the fraction of heads a token uses")
    return ratio


def active_heads_for_ratio(num_heads: int, activation_ratio: float) -> int:
    """Heads a token uses at ``activation_ratio``: ``round(ratio * h)`` clamped to [1, h]."""
    ratio = check_ratio(activation_ratio)
    return min(num_heads, max(1, int(round(ratio * num_heads))))


def resolve_moh_heads(num_heads: int, shared_heads: Optional[int] = None, topk: Optional[int] = None,
                      activation_ratio: Optional[float] = None) -> Tuple[int, int]:
    """Turn the user's options into ``(shared_heads, topk)`` for one layer of ``num_heads`` heads. Explicit
    ``shared_heads`` + ``topk`` (the official ``routed_head``) are used as given; else the activation-ratio policy:

    * ``a = clamp(round(ratio * h), 1, h)`` heads are active per token, so the realised ratio ``a / h`` is within
      ``1 / (2h)`` of the request;
    * ``a == h`` (e.g. ratio 1.0) gives a dense-weighted layer: every head shared, ``topk = 0``;
    * otherwise ``shared_heads = a // 2`` (or the given value) and ``topk = a - shared_heads``, i.e. about half of the
      active heads are always on and half are routed, as in the official presets."""
    if num_heads < 1:
        raise ConfigError(f"num_heads={num_heads} must be at least 1")
    if activation_ratio is not None and topk is not None:
        raise ConfigError("give MoH either activation_ratio or topk (with shared_heads), not both")
    if topk is None:
        active = active_heads_for_ratio(num_heads, 0.75 if activation_ratio is None else activation_ratio)
        if active == num_heads:
            if shared_heads is not None and shared_heads != num_heads:
                raise ConfigError(
                    f"activation_ratio={activation_ratio} activates all {num_heads} heads, so shared_heads must be "
                    f"{num_heads} (got {shared_heads})")
            return num_heads, 0
        if shared_heads is None:
            shared_heads = active // 2
        if not 0 <= shared_heads < active:
            raise ConfigError(
                f"shared_heads={shared_heads} leaves no routed head at activation_ratio={activation_ratio} "
                f"({active} of {num_heads} heads active); allowed 0..{active - 1}")
        topk = active - shared_heads
    shared_heads = num_heads if shared_heads is None and topk == 0 else shared_heads
    if shared_heads is None:
        raise ConfigError("MoH with an explicit topk also needs shared_heads")
    shared_heads, topk = int(shared_heads), int(topk)
    if not 0 <= shared_heads <= num_heads:
        raise ConfigError(f"shared_heads={shared_heads} is outside 0..num_heads={num_heads}")
    routed = num_heads - shared_heads
    if not 0 <= topk <= routed:
        raise ConfigError(
            f"topk={topk} exceeds the routed pool num_heads - shared_heads = {num_heads} - {shared_heads} = {routed}; "
            f"allowed 0..{routed}")
    if topk == 0 and shared_heads != num_heads:
        raise ConfigError(
            f"topk=0 routes nothing, so shared_heads must be num_heads={num_heads} (got {shared_heads}); "
            f"otherwise {routed} heads would never be used")
    return shared_heads, topk


class RoutedMixin(AttentionVariant):
    """What every routed variant shares: handing a forward's aux loss and statistics to the caller's recorder
    (:func:`~moh_vision.attention.recorder.record_routing`), if one is open; nothing stays on the module."""

    is_routed = True

    def recording(self) -> bool:
        """Whether this forward is recorded (worth computing the statistics and the aux loss)."""
        return active_recorder() is not None

    def wants_aux_loss(self) -> bool:
        """Training forwards compute the aux loss whether or not it is recorded: a forward that
        gradient checkpointing replays in backward (not recorded) must save what the first pass saved."""
        return self.training and torch.is_grad_enabled()

    def record_routing(self, active: Tensor, probs: Optional[Tensor], loss: Optional[Tensor],
                       gates: Optional[Tensor] = None, heads_dim: int = -1, shared_prefix: int = 0, **extra) -> None:
        """Hand what this forward decided to the open recorder: the active mask (heads along ``heads_dim``, ``1`` for
        head-major ``[B, h, N]``; without the first ``shared_prefix`` heads, which every token uses), router
        probabilities, aux loss (training only), gates [..., h], and ``extra`` statistics. Only references to tensors
        the forward made: the recorder computes the statistics when asked (:attr:`LayerRecord.stats`)."""
        recorder = active_recorder()
        if recorder is None:
            return
        keep = recorder.keep_selection
        recorder.add(LayerRecord(self, loss if self.training else None, active.detach(),
                                 None if probs is None else probs.detach(), heads_dim, extra,
                                 gates.detach() if keep and gates is not None else None, keep, shared_prefix))


class SharedPlusTopK:
    """The head budget of MoH-style variants: ``shared_heads`` always on plus ``topk`` routed heads per
    token; an activation ratio maps to them by :func:`resolve_moh_heads`'s policy."""

    @classmethod
    def options_for_ratio(cls, num_heads: int, activation_ratio: float):
        shared, topk = resolve_moh_heads(num_heads, activation_ratio=activation_ratio)
        return {"shared_heads": shared, "topk": topk}

    def active_heads(self) -> int:
        return self.shared_heads + self.topk

    def routing_description(self):
        return {**super().routing_description(), "shared_heads": self.shared_heads, "topk": self.topk}
