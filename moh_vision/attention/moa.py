"""Mixture of Attention heads (MoA, Zhang et al., 2022).

``E = num_heads`` attention experts, each with its own query projection ``W_q^i`` (C -> d) and output projection
``W_o^i`` (d -> C); keys and values are ONE head (``W_k``, ``W_v``: C -> d) that every expert attends to. A
zero-initialised router ``p = softmax(x W_g)`` (optionally noisy while training) picks the top-k experts per token and
the output is ``y = sum_{i in topk} p_i W_o^i Attn(W_q^i x, W_k X, W_v X)`` with the raw, not renormalised, top-k
probabilities as in the released code.

Auxiliary loss per layer: ``switch_weight * E * sum_i P_i f_i + zloss_weight * mean(logsumexp^2) + cv_weight * cv^2``.
The weights are relative to the global aux coefficient (``attention.aux_loss_weight``, 0.01 by default), so the defaults
give the paper's 0.01 switch and 0.001 z-loss. As in the released code the layers' losses are SUMMED over layers
(``aux_reduction = "sum"``; MoH takes the mean), and the shared key/value projection has no bias (``kv_bias=False``).

Defaults versus the paper (WMT14 base: E = 8 experts, top-k 8, head size 128 for a 512-wide Transformer): here the
experts are the backbone's heads (E = num_heads, head size = head_dim: the dense layer's query/output width) and
``topk`` comes from ``activation_ratio`` (0.75 by default) or is given, so MoA and MoH compare at equal active heads."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moh_vision.errors import ConfigError
from .registry import register_attention
from .routing import RoutedMixin, active_heads_for_ratio, topk_mask

Tensor = torch.Tensor


def switch_loss(probs: Tensor, mask: Tensor) -> Tensor:
    """``E * sum_i P_i f_i``: P = mean router probability, f = share of the top-k assignments."""
    num_experts = probs.shape[-1]
    P = probs.reshape(-1, num_experts).float().mean(dim=0)
    counts = mask.reshape(-1, num_experts).float().sum(dim=0).detach()
    f = counts / counts.sum().clamp_min(1.0)
    return num_experts * (P * f).sum()


def z_loss(logits: Tensor) -> Tensor:
    return logits.float().logsumexp(dim=-1).pow(2).mean()


def cv_squared_loss(gates: Tensor) -> Tensor:
    """Squared coefficient of variation of the per-expert gate mass (0 for a single expert)."""
    mass = gates.reshape(-1, gates.shape[-1]).float().sum(dim=0)
    if mass.numel() == 1:
        return mass.new_zeros(())
    mass = mass / mass.sum().clamp_min(1e-10)
    return mass.var() / (mass.mean() ** 2 + 1e-10)


@register_attention("moa")
class MoA(RoutedMixin):
    """Mixin: MoA experts over any form. ``num_heads`` is the number of experts E.

    Args:
        topk: experts per token; or ``activation_ratio`` (``topk = round(ratio * E)``); an explicit ``topk`` wins.
        noisy_gating: add learned Gaussian noise to the router logits while training.
        switch_weight, zloss_weight, cv_weight: per-term aux weights, relative to the global aux coefficient.
        kv_bias: bias of the shared key/value projection (the released code has none).
    """

    option_ranges = {"topk": "1..num_heads (experts)", "activation_ratio": "(0, 1]",
                     "switch_weight": ">= 0", "zloss_weight": ">= 0", "cv_weight": ">= 0"}
    aux_reduction = "sum"  # the released code sums the layers' losses (MoH takes the mean)
    variant_parameters = ("q_proj", "kv_proj", "w_gate", "w_noise")
    flops_roles = {"q_proj": "per_head", "kv_proj": "fixed", "proj": "per_head", "w_gate": "fixed", "w_noise": "fixed"}
    dense_start_refusal = (
        "MoA cannot be continue-tuned from a dense checkpoint: its experts share ONE key/value head (kv_proj: "
        "C -> 2 x head_dim) where the dense layer has one per head, and its output projection has no bias; no "
        "choice of the shared key/value head reproduces the dense layer, so the model would not start from the "
        "dense function. Train MoA from scratch, or continue-tune to attention=moh")

    def __init__(self, dim: int, num_heads: int, *, topk: Optional[int] = None,
                 activation_ratio: Optional[float] = 0.75, noisy_gating: bool = False, switch_weight: float = 1.0,
                 zloss_weight: float = 0.1, cv_weight: float = 0.0, kv_bias: bool = False, **form_options):
        self.kv_bias = bool(kv_bias)
        super().__init__(dim, num_heads, **form_options)
        E = self.num_heads
        if topk is None:
            if activation_ratio is None:
                raise ConfigError("MoA needs topk or activation_ratio")
            topk = self.options_for_ratio(E, activation_ratio)["topk"]
        if isinstance(topk, bool) or not 1 <= int(topk) <= E:
            raise ConfigError(f"MoA topk={topk} is outside 1..num_experts={E}")
        for key, value in (("switch_weight", switch_weight), ("zloss_weight", zloss_weight), ("cv_weight", cv_weight)):
            if float(value) < 0:
                raise ConfigError(f"MoA {key}={value} must be >= 0")
        self.topk = int(topk)
        self.noisy_gating = bool(noisy_gating)
        self.switch_weight, self.zloss_weight, self.cv_weight = float(switch_weight), float(zloss_weight), float(cv_weight)
        self.w_gate = nn.Linear(dim, E, bias=False)
        self.w_noise = nn.Linear(dim, E, bias=False) if self.noisy_gating else None
        self.reset_router()

    @classmethod
    def options_for_ratio(cls, num_heads: int, activation_ratio: float):
        return {"topk": active_heads_for_ratio(num_heads, activation_ratio)}

    def active_heads(self) -> int:
        return self.topk

    def reset_router(self) -> None:
        """MoA starts from a uniform router (zero gate weights)."""
        nn.init.zeros_(self.w_gate.weight)
        if self.w_noise is not None:
            nn.init.zeros_(self.w_noise.weight)

    # --- projections: per-expert queries and outputs, one shared key/value head ------------
    def init_projections(self, qkv_bias: bool) -> None:
        self.q_proj = nn.Linear(self.dim, self.inner_dim, bias=False)
        self.kv_proj = nn.Linear(self.dim, 2 * self.head_dim, bias=self.kv_bias)  # official: no bias
        self.proj = nn.Linear(self.inner_dim, self.dim, bias=False)

    def project_q(self, x: Tensor) -> Tensor:
        return self.split_heads(self.q_proj(x), self.num_heads)

    def project_kv(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        return k.unsqueeze(1), v.unsqueeze(1)  # [B, 1, M, d]: one head for every expert

    def project_qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return (self.project_q(x), *self.project_kv(x))

    # --- routing ---------------------------------------------------------------------------------
    def route(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        logits = self.w_gate(x)
        if self.noisy_gating and self.training:
            noise_std = F.softplus(self.w_noise(x)) + 1e-2
            logits = logits + torch.randn_like(logits) * noise_std
        probs = logits.softmax(dim=-1)
        index, mask = topk_mask(probs.detach(), self.topk)
        gates = probs * mask
        loss = None
        if self.wants_aux_loss():
            loss = self.switch_weight * switch_loss(probs, mask) + self.zloss_weight * z_loss(logits)
            if self.cv_weight:
                loss = loss + self.cv_weight * cv_squared_loss(gates)
        self.record_routing(mask, probs, loss, gates=gates)
        return gates, index

    def forward(self, x: Tensor) -> Tensor:
        gates, _ = self.route(x)
        return self.output(self.heads(x), gates)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts={self.num_heads}, topk={self.topk}, noisy={self.noisy_gating}"
