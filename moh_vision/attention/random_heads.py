"""Random-router heads: MoH's head budget with a router that is never trained (an ablation baseline).

The example of how small a variant is: this file and ``configs/attention/random_heads.yaml`` are all
there is to it. Every workflow (training, FLOPs, continue-tuning, sweeps and their report, routing
statistics and analysis) works with it because it answers the questions of
:class:`~moh_vision.attention.registry.AttentionVariant`, not because anything else knows it.

A layer of ``h`` heads keeps heads ``0..h_s-1`` on for every token (as MoH) and gives each token the
``topk`` routed heads with the largest scores under a FIXED random projection ``x @ router`` (a
buffer drawn at construction from ``seed``; saved in the state dict, so a checkpoint selects the same
heads). Gates are 1 on the selected heads and 0 elsewhere: the layer is the dense layer with some
heads dropped per token, input-dependently but without learning whom to drop. Comparing it with MoH
at the same ``activation_ratio`` measures what MoH's learned router and gates are worth.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from moh_vision.errors import ConfigError
from .registry import register_attention
from .routing import RoutedMixin, SharedPlusTopK, resolve_moh_heads, topk_mask

Tensor = torch.Tensor


@register_attention("random_heads")
class RandomHeads(SharedPlusTopK, RoutedMixin):
    """Mixin: shared heads plus ``topk`` heads picked per token by a fixed random projection.

    Args:
        shared_heads, topk: as MoH's (explicit counts win over ``activation_ratio``).
        activation_ratio: fraction of heads a token uses (MoH's policy: about half of them shared).
        seed: seed of the random router.
    """

    option_ranges = {"shared_heads": "0..num_heads", "topk": "0..num_heads - shared_heads",
                     "activation_ratio": "(0, 1]", "seed": "any integer"}
    variant_parameters = ("router",)  # a buffer, but a dense checkpoint does not have it either

    def __init__(self, dim: int, num_heads: int, *, shared_heads: Optional[int] = None, topk: Optional[int] = None,
                 activation_ratio: Optional[float] = 0.75, seed: int = 0, **form_options):
        super().__init__(dim, num_heads, **form_options)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"random_heads seed={seed!r} must be an integer")
        if topk is not None:
            activation_ratio = None
        self.shared_heads, self.topk = resolve_moh_heads(self.num_heads, shared_heads, topk, activation_ratio)
        self.seed = seed
        self.register_buffer("router", self.draw_router(torch.Generator().manual_seed(seed)))

    def draw_router(self, generator: torch.Generator) -> Tensor:
        routed = self.num_heads - self.shared_heads
        return torch.randn(self.dim, routed, generator=generator) / self.dim ** 0.5

    # --- the variant contract (the head budget, ratio -> counts: SharedPlusTopK, as MoH) ---------------
    def dense_start(self, router_std: float, generator: torch.Generator) -> Dict[str, Tensor]:
        """Nothing is learned, so the start is the router this layer draws from its own seed."""
        return {"router": self.draw_router(torch.Generator().manual_seed(self.seed))}

    # --- forward -------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape[:-1] + (self.shared_heads,)  # sizes as one tuple, not *args: torch.fx traces them
        if self.topk == 0:
            gates = x.new_ones(x.shape[:-1] + (self.num_heads,))
        else:
            scores = x.detach() @ self.router.to(x.dtype)
            _, mask = topk_mask(scores, self.topk)
            gates = torch.cat([x.new_ones(shape), mask.to(x.dtype)], dim=-1)
        if self.recording():
            self.record_routing(gates, None, None, gates=gates)
        return self.output(self.heads(x), gates)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, shared_heads={self.shared_heads}, topk={self.topk}, "
                f"active={self.active_heads()}/{self.num_heads}, seed={self.seed}")
