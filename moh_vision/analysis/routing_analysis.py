"""How a trained routed model uses its heads on a few images (``tools/analyze_routing.py``, ``docs/routing.md``).

Each routed layer records which heads every token selected and the gates they got
(``record_routing(model, keep_selection=True)``: nothing is left on the modules). :func:`analyse` sums them over the
images, :func:`layer_statistics` turns the sums into per-layer numbers (the trainer's ``RoutingMeter.averages`` format
plus token grid, gate mass and MoA-style utility ranking), and :func:`write_outputs` draws them (head load, gate mass,
router entropy, head utility, shared heads when a layer learns them, and per image the heads each token chose on its
layer's token grid) and keeps the raw per-token masks and gates of the mapped images in ``selection.npz``."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Tuple

import numpy as np
import torch

from moh_vision.attention import record_routing, routed_modules
from moh_vision.errors import ConfigError
from . import routing_plots
from .routing_stats import routed_loads_of


def token_grid(model: torch.nn.Module, module: torch.nn.Module, tokens: int) -> Tuple[Tuple[int, int], int]:
    """((H, W), prefix tokens) of a layer's token sequence: the kernel's own ``input_resolution`` (TransNeXt stages),
    else the model's patch grid (DiT ``grid_size``, ViT ``patch_embed``) with leading class tokens dropped; a square or
    a single row as the last resort."""
    grid = getattr(module, "input_resolution", None) or getattr(model, "grid_size", None) \
        or getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is not None:
        H, W = int(grid[0]), int(grid[1])
        if tokens >= H * W:
            return (H, W), tokens - H * W
    side = int(math.isqrt(tokens))
    return ((side, side), 0) if side * side == tokens else ((1, tokens), 0)


@torch.no_grad()
def analyse(model: torch.nn.Module, batches: Iterable[Any], forward: Callable[[Any], torch.Tensor], num_images: int,
            map_images: int):
    """Per-layer sums over ``num_images`` images and the raw masks of the first ``map_images``. ``forward(batch)`` runs
    ``model`` on one batch and returns the images it was given (for the token maps). Returns (per-layer sums for
    :func:`layer_statistics`, per-layer masks and gates, images, images seen)."""
    model.eval()
    layers = [name for name, _ in routed_modules(model)]
    if not layers:
        raise ConfigError("this model has no routed attention layer (attention=mha?): nothing to analyse")
    sums: Dict[str, Dict[str, Any]] = {}
    maps: Dict[str, Dict[str, List[np.ndarray]]] = {name: {"selection": [], "gates": []} for name in layers}
    images: List[np.ndarray] = []
    seen = 0
    for batch in batches:
        if seen >= num_images:
            break
        with record_routing(model, keep_selection=True) as routing:
            x = forward(batch)
        take = min(x.shape[0], num_images - seen)
        keep_maps = max(0, min(take, map_images - seen))
        images.extend(x[:keep_maps].float().cpu().numpy())
        for name, record in routing.named_records():
            selection = record.selection[:take].float()  # [b, N, h]
            gates = record.gates[:take].float() if record.gates is not None else None
            stats = record.stats
            s = sums.setdefault(name, {"tokens": 0, "load": 0.0, "gate": 0.0, "entropy": 0.0,
                                       "N": selection.shape[1], "num_heads": selection.shape[2],
                                       "shared_heads": int(stats.get("shared_heads", 0)),
                                       "topk": int(stats.get("topk", 0)), "has_gates": gates is not None})
            n = selection.shape[0] * selection.shape[1]
            s["tokens"] += n
            s["load"] = s["load"] + selection.sum(dim=(0, 1)).cpu()
            if gates is not None:
                s["gate"] = s["gate"] + gates.sum(dim=(0, 1)).cpu()
            if stats.get("shared_mask") is not None:  # a layer that learns its shared heads
                s["shared_mask"] = [bool(v) for v in stats["shared_mask"].tolist()]
                s["shared_frozen"] = bool(stats.get("shared_frozen", False))
            if stats.get("entropy") is not None:  # the batch mean; weighted by tokens
                s["entropy"] += float(stats["entropy"]) * n
            if keep_maps:
                maps[name]["selection"].append(record.selection[:keep_maps].cpu().numpy())
                if gates is not None:
                    maps[name]["gates"].append(gates[:keep_maps].cpu().numpy().astype(np.float16))
        seen += take
    if not seen:
        raise ConfigError("the validation set is empty")
    return sums, maps, images, seen


def layer_statistics(model, sums: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per layer, in the ``RoutingMeter.averages`` format plus grid, gate mass, utility ranking."""
    modules = dict(model.named_modules())
    stats = {}
    for name, s in sums.items():
        tokens = max(s["tokens"], 1)
        load = (s["load"] / tokens).tolist()
        routed = s["num_heads"] - s["shared_heads"]
        (H, W), prefix = token_grid(model, modules[name], s["N"])
        entry = {
            "num_heads": s["num_heads"], "shared_heads": s["shared_heads"], "topk": s["topk"],
            "load": load, "gate_mass": (s["gate"] / tokens).tolist() if s["has_gates"] else None,
            "entropy": s["entropy"] / tokens if s["topk"] > 0 else None,
            "max_entropy": math.log(routed) if s["topk"] > 0 and routed > 1 else None,
            "active_heads_per_token": float(sum(load)), "tokens": s["tokens"],
            "grid": [H, W], "prefix_tokens": prefix,
        }
        if s.get("shared_mask") is not None:
            entry.update(shared_mask=s["shared_mask"], shared_frozen=s["shared_frozen"])
        entry["utility"] = routing_plots.utility_ranking(entry) if s["topk"] > 0 else []
        stats[name] = entry
    return stats


def map_layers(stats: Dict[str, Dict[str, Any]], limit: int) -> List[str]:
    """Up to ``limit`` routed layers spread evenly over depth."""
    names = [n for n, s in stats.items() if s["topk"] > 0]
    if len(names) <= limit:
        return names
    picks = np.linspace(0, len(names) - 1, limit).round().astype(int)
    return [names[i] for i in sorted(set(picks.tolist()))]


def write_outputs(out: Path, stats, maps, images, max_map_layers: int = 8) -> Dict[str, str]:
    """The figures and ``selection.npz`` into ``out``; returns ``{what: file name}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "head_load": routing_plots.plot_head_load(stats, out / "head_load.png"),
        "router_entropy": routing_plots.plot_router_entropy(stats, out / "router_entropy.png"),
        "head_utility": routing_plots.plot_head_utility(stats, out / "head_utility.png"),
    }
    if routing_plots.has_learned_shared_heads(stats):
        files["shared_heads"] = routing_plots.plot_shared_heads(stats, out / "shared_heads.png")
    if all(s["gate_mass"] is not None for s in stats.values()):
        files["gate_mass"] = routing_plots.plot_head_load(stats, out / "gate_mass.png", key="gate_mass")
    arrays = {}
    shown = map_layers(stats, max_map_layers)
    for name, m in maps.items():
        if m["selection"]:
            arrays[f"selection/{name}"] = np.concatenate(m["selection"])
        if m["gates"]:
            arrays[f"gates/{name}"] = np.concatenate(m["gates"])
    for i, image in enumerate(images):
        rows = []
        for name in shown:
            s = stats[name]
            prefix = s["prefix_tokens"]
            gates = arrays.get(f"gates/{name}")
            rows.append({"name": name, "grid": tuple(s["grid"]), "shared_heads": s["shared_heads"],
                         "shared_mask": s.get("shared_mask"),
                         "selection": arrays[f"selection/{name}"][i, prefix:],
                         "gates": gates[i, prefix:].astype(np.float32) if gates is not None else None})
        title = f"validation image {i}: heads chosen per token"
        files[f"token_heads_{i}"] = routing_plots.plot_token_heads(image, rows, out / f"token_heads_{i}.png", title=title)
    if arrays:
        np.savez_compressed(out / "selection.npz", **arrays)
        files["selection"] = out / "selection.npz"
    return {k: Path(v).name for k, v in files.items()}


def wandb_metrics(stats: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """Per routed layer: router entropy and the largest and smallest routed-head load."""
    row = {}
    for layer, s in stats.items():
        if s["topk"] > 0:
            routed = routed_loads_of(s)
            row[f"routing_analysis/{layer}/entropy"] = s["entropy"]
            row[f"routing_analysis/{layer}/max_load"] = max(routed)
            row[f"routing_analysis/{layer}/min_load"] = min(routed)
    return row


def default_out(ckpt: Path) -> Path:
    """``<run dir>/routing_analysis`` for a checkpoint in ``<run dir>/checkpoints/``."""
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / "routing_analysis"
