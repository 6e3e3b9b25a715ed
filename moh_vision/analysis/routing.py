"""Routing statistics over an epoch: head load, router entropy, and health warnings."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from moh_vision.attention import collect_routing_stats


class RoutingMeter:
    """Accumulates ``collect_routing_stats`` over the forwards of an epoch (per device).

    ``load`` per head is the fraction of tokens that used it (shared heads: 1); the per-layer
    sum is the active heads per token. ``entropy`` is the mean router entropy in nats.
    """

    def __init__(self, collapse_load: float = 0.95, starve_share: float = 0.01):
        self.collapse_load, self.starve_share = collapse_load, starve_share
        self.layers: Dict[str, Dict[str, Any]] = {}

    def update(self, model: nn.Module) -> None:
        for name, st in collect_routing_stats(model).items():
            entry = self.layers.get(name)
            load = st["load"].detach().float().cpu()
            if entry is None:
                entry = self.layers[name] = {"load": torch.zeros_like(load), "entropy": 0.0, "n": 0,
                                             "shared_heads": st["shared_heads"], "topk": st["topk"]}
            entry["load"] += load
            entry["entropy"] += float(st["entropy"]) if st["entropy"] is not None else 0.0
            entry["n"] += 1

    def averages(self) -> Dict[str, Dict[str, Any]]:
        out = {}
        for name, e in self.layers.items():
            n = max(e["n"], 1)
            out[name] = {"load": (e["load"] / n).tolist(), "entropy": e["entropy"] / n,
                         "shared_heads": e["shared_heads"], "topk": e["topk"]}
        return out

    @staticmethod
    def balance(routed_load: List[float], k: int) -> float:
        """Effective share of routed heads in use: ``exp(H(load / k)) / E`` (1 = perfectly balanced)."""
        p = torch.tensor(routed_load, dtype=torch.float64) / max(k, 1)
        p = p[p > 0]
        return float(torch.exp(-(p * p.log()).sum()) / len(routed_load)) if len(p) else 0.0

    def summary(self, prefix: str = "routing") -> Dict[str, float]:
        """Flat metrics: mean entropy over routed layers, the number of unhealthy layers, and per
        routed layer its entropy, min/max routed-head load and balance."""
        row: Dict[str, float] = {}
        entropies = []
        for name, avg in self.averages().items():
            if avg["topk"] == 0:
                continue
            routed = avg["load"][avg["shared_heads"]:]
            row[f"{prefix}/{name}/entropy"] = avg["entropy"]
            row[f"{prefix}/{name}/max_load"] = max(routed)
            row[f"{prefix}/{name}/min_load"] = min(routed)
            row[f"{prefix}/{name}/balance"] = self.balance(routed, avg["topk"])
            entropies.append(avg["entropy"])
        if entropies:
            row[f"{prefix}/entropy_mean"] = sum(entropies) / len(entropies)
            row[f"{prefix}/unhealthy_layers"] = float(len({w.split(":")[0] for w in self.health_warnings()}))
        return row

    def health_warnings(self) -> List[str]:
        """A routed head that (nearly) every token takes when it should be chosen by only some
        (collapse: load >= ``collapse_load``), or one that (almost) no token took all epoch
        (starvation: load below ``starve_share`` of its balanced share ``k / E``)."""
        warnings = []
        for name, avg in self.averages().items():
            k, h_s = avg["topk"], avg["shared_heads"]
            routed = avg["load"][h_s:]
            if k == 0 or k >= len(routed):
                continue
            balanced = k / len(routed)
            for j, load in enumerate(routed):
                if load >= self.collapse_load:
                    warnings.append(f"{name}: routed head {h_s + j} took {100 * load:.1f}% of tokens (collapse; "
                                    f"balanced is {100 * balanced:.0f}%)")
                elif load == 0.0:
                    warnings.append(f"{name}: routed head {h_s + j} was never chosen (starved)")
                elif load < self.starve_share * balanced:
                    warnings.append(f"{name}: routed head {h_s + j} took only {100 * load:.2f}% of tokens (starved; "
                                    f"balanced is {100 * balanced:.0f}%)")
        return warnings

    def dump(self, path: Path, epoch: int) -> None:
        """Append this epoch's per-layer loads and entropies to a JSON file {epoch: {layer: ...}}."""
        if not self.layers:
            return
        path = Path(path)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[str(epoch)] = self.averages()
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    def state_dict(self) -> Dict[str, Any]:
        return {name: dict(e) for name, e in self.layers.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.layers = {name: dict(e) for name, e in state.items()}
