"""Routing statistics over an epoch: head load, router entropy, and health warnings."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from moh_vision.checkpoints import atomic_write


# ---- Which heads of a layer are shared: the first ``shared_heads`` (official), or the learned mask ----
def shared_mask_of(stat: Mapping[str, Any]) -> List[bool]:
    """Per head, whether it is shared: ``stat["shared_mask"]`` when the layer learns its shared heads
    (``attention.shared_heads=learned``), else the first ``stat["shared_heads"]`` heads."""
    mask = stat.get("shared_mask")
    if mask is not None:
        return [bool(v) for v in (mask.tolist() if hasattr(mask, "tolist") else mask)]
    return [i < int(stat.get("shared_heads", 0)) for i in range(len(stat["load"]))]


def routed_heads_of(stat: Mapping[str, Any]) -> List[int]:
    """Indices of the routed (not shared) heads, ascending."""
    return [i for i, shared in enumerate(shared_mask_of(stat)) if not shared]


def routed_loads_of(stat: Mapping[str, Any]) -> List[float]:
    """Load of each routed head (order of :func:`routed_heads_of`). When the learned partition changed
    during the epoch, ``stat["routed_load"]`` averages a head's load over the forwards in which it was
    routed (its plain ``load`` would count the forwards in which it was shared as 1)."""
    per_head = stat.get("routed_load")
    return [float(per_head[i]) if per_head is not None and per_head[i] is not None else float(stat["load"][i])
            for i in routed_heads_of(stat)]


def learned_shared_heads(stat: Mapping[str, Any]) -> Optional[str]:
    """The shared heads of a learned layer as a compact string, e.g. ``"1,4,6"`` (None for a fixed layer)."""
    if stat.get("shared_mask") is None:
        return None
    return ",".join(str(i) for i, shared in enumerate(shared_mask_of(stat)) if shared)


class RoutingMeter:
    """Accumulates the routing statistics of the forwards of an epoch (per device): each training
    step hands it ``RoutingRecorder.stats()`` of its forward.

    ``load`` per head is the fraction of tokens that used it (shared heads: 1); the per-layer
    sum is the active heads per token. ``entropy`` is the mean router entropy in nats.

    Layers that learn their shared heads (``shared_mask`` in their statistics) also report the
    latest ``shared_mask`` and ``shared_frozen``, ``shared_frac`` (fraction of the epoch's forwards
    in which each head was shared) and ``routed_load`` (each head's load over the forwards in which
    it was routed; None for a head shared all epoch). Shared/routed is read from that mask."""

    def __init__(self, collapse_load: float = 0.95, starve_share: float = 0.01):
        self.collapse_load, self.starve_share = collapse_load, starve_share
        self.layers: Dict[str, Dict[str, Any]] = {}

    def update(self, stats: Mapping[str, Mapping[str, Any]]) -> None:
        """Add one forward's per-layer statistics (``RoutingRecorder.stats()``)."""
        for name, st in stats.items():
            entry = self.layers.get(name)
            load = st["load"].detach().float().cpu()
            if entry is None:
                entry = self.layers[name] = {"load": torch.zeros_like(load), "entropy": 0.0, "n": 0,
                                             "shared_heads": st["shared_heads"], "topk": st["topk"]}
            entry["load"] += load
            entry["entropy"] += float(st["entropy"]) if st["entropy"] is not None else 0.0
            entry["n"] += 1
            if st.get("shared_mask") is not None:
                mask = torch.as_tensor(st["shared_mask"]).detach().bool().cpu()
                if "shared_count" not in entry:
                    entry["shared_count"], entry["routed_load_sum"] = torch.zeros_like(load), torch.zeros_like(load)
                entry["shared_count"] += mask.float()
                entry["routed_load_sum"] += torch.where(mask, torch.zeros_like(load), load)
                entry["shared_mask"] = mask.tolist()
                entry["shared_frozen"] = bool(st.get("shared_frozen", False))

    def averages(self) -> Dict[str, Dict[str, Any]]:
        out = {}
        for name, e in self.layers.items():
            n = max(e["n"], 1)
            out[name] = {"load": (e["load"] / n).tolist(), "entropy": e["entropy"] / n,
                         "shared_heads": e["shared_heads"], "topk": e["topk"]}
            if "shared_mask" in e:
                routed_n = e["n"] - e["shared_count"]
                out[name].update(
                    shared_mask=list(e["shared_mask"]), shared_frozen=e["shared_frozen"],
                    shared_frac=(e["shared_count"] / n).tolist(),
                    routed_load=[float(s / c) if c > 0 else None
                                 for s, c in zip(e["routed_load_sum"].tolist(), routed_n.tolist())])
        return out

    @staticmethod
    def balance(routed_load: List[float], k: int) -> float:
        """Effective share of routed heads in use: ``exp(H(load / k)) / E`` (1 = perfectly balanced)."""
        p = torch.tensor(routed_load, dtype=torch.float64) / max(k, 1)
        p = p[p > 0]
        return float(torch.exp(-(p * p.log()).sum()) / len(routed_load)) if len(p) else 0.0

    def summary(self, prefix: str = "routing") -> Dict[str, float]:
        """Flat metrics: mean entropy over routed layers, the number of unhealthy layers, and per
        routed layer its entropy, min/max routed-head load and balance; per layer that learns its
        shared heads, ``shared_heads_learned`` (e.g. ``"1,4,6"``, a string) and ``shared_frozen``."""
        row: Dict[str, Any] = {}
        entropies = []
        for name, avg in self.averages().items():
            if avg["topk"] == 0:
                continue
            routed = routed_loads_of(avg)
            learned = learned_shared_heads(avg)
            if learned is not None:
                row[f"{prefix}/{name}/shared_heads_learned"] = learned
                row[f"{prefix}/{name}/shared_frozen"] = float(avg["shared_frozen"])
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
            k = avg["topk"]
            heads, routed = routed_heads_of(avg), routed_loads_of(avg)
            if k == 0 or k >= len(routed):
                continue
            balanced = k / len(routed)
            for head, load in zip(heads, routed):
                if load >= self.collapse_load:
                    warnings.append(f"{name}: routed head {head} took {100 * load:.1f}% of tokens (collapse; "
                                    f"balanced is {100 * balanced:.0f}%)")
                elif load == 0.0:
                    warnings.append(f"{name}: routed head {head} was never chosen (starved)")
                elif load < self.starve_share * balanced:
                    warnings.append(f"{name}: routed head {head} took only {100 * load:.2f}% of tokens (starved; "
                                    f"balanced is {100 * balanced:.0f}%)")
        return warnings

    def dump(self, path: Path, epoch: int) -> None:
        """Append this epoch's per-layer loads and entropies (and, for learned shared heads, the mask)
        to a JSON file {epoch: {layer: ...}}."""
        if not self.layers:
            return
        path = Path(path)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[str(epoch)] = self.averages()
        atomic_write(path, lambda f: f.write(json.dumps(data).encode()))

    def state_dict(self) -> Dict[str, Any]:
        return {name: dict(e) for name, e in self.layers.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.layers = {name: dict(e) for name, e in state.items()}
