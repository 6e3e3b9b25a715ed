"""Figures of how routed attention layers use their heads (matplotlib, Agg backend, PNG files).

Every function takes per-layer statistics as :meth:`moh_vision.analysis.routing_stats.RoutingMeter.averages` gives them
(what the trainer dumps to ``routing.json`` each epoch)::

    {layer_name: {"load": [h floats], "entropy": float | None, "shared_heads": int, "topk": int,
                  "gate_mass": [h floats] (optional)}, ...}

``load[i]`` is the fraction of tokens that used head ``i`` (1 for a shared head, so a layer's loads sum to its active
heads per token); ``gate_mass[i]`` the mean gate head ``i`` received per token (0 where unselected). Layers keep their
order (depth). Routed heads are indices ``shared_heads..h-1``, except in layers that learn their shared heads
(``attention.shared_heads=learned``): their stats carry ``shared_mask`` ([h] bools; optional ``shared_frozen``,
``shared_frac``, ``routed_load``) and shared means that mask
(:func:`~moh_vision.analysis.routing_stats.shared_mask_of`)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from moh_vision.analysis.routing_stats import routed_heads_of, routed_loads_of, shared_mask_of

Stats = Mapping[str, Mapping[str, Any]]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _short(name: str) -> str:
    """``blocks.3.attn`` -> ``blocks.3``; ``block3.12.attn`` -> ``block3.12``."""
    return name[:-5] if name.endswith(".attn") else name


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def routed_layers(stats: Stats) -> List[str]:
    """Layers that route something (``topk > 0``)."""
    return [name for name, s in stats.items() if int(s.get("topk", 0)) > 0]


# -- Head load: layers x heads -----------------------------------------------------------------------------------------
def plot_head_load(stats: Stats, path: Path, key: str = "load", title: Optional[str] = None) -> Path:
    """Heatmap of ``stats[layer][key]`` (layers x heads), shared heads marked ``s``, rows labelled shared + top-k."""
    plt = _pyplot()
    names = list(stats)
    width = max(len(s[key]) for s in stats.values())
    grid = np.full((len(names), width), np.nan)
    for row, name in enumerate(names):
        values = np.asarray(stats[name][key], dtype=float)
        grid[row, :len(values)] = values
    vmax = 1.0 if key == "load" else max(float(np.nanmax(grid)), 1e-9)
    fig, ax = plt.subplots(figsize=(min(2 + 0.42 * width, 16), min(1.5 + 0.32 * len(names), 30)))
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax,
                      interpolation="nearest")
    small = width * len(names) <= 600
    for row, name in enumerate(names):
        for col, shared in enumerate(shared_mask_of(stats[name])):
            if shared:
                ax.text(col, row, "s", ha="center", va="center", color="white", fontsize=7, fontweight="bold")
            elif small:
                ax.text(col, row, f"{grid[row, col]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if grid[row, col] < 0.6 * vmax else "black")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{_short(n)} ({int(stats[n].get('shared_heads', 0))}+{int(stats[n].get('topk', 0))}"
                        f"{', learned' if stats[n].get('shared_mask') is not None else ''})" for n in names], fontsize=7)
    ax.set_xticks(range(width))
    ax.set_xticklabels([str(i) for i in range(width)], fontsize=7)
    ax.set_xlabel("head (s = shared, always on)")
    ax.set_ylabel("layer (shared + top-k)")
    default = "fraction of tokens using each head" if key == "load" else "mean gate per token"
    ax.set_title(title or default, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    return _save(fig, path)


# -- Router entropy per layer ------------------------------------------------------------------------------------------
def plot_router_entropy(stats: Stats, path: Path, title: Optional[str] = None) -> Path:
    """Mean router entropy (nats) of each routed layer, with the uniform-router maximum ``log(routed heads)`` as a tick:
    low bars = confident (or collapsed) routers."""
    plt = _pyplot()
    names = routed_layers(stats)
    fig, ax = plt.subplots(figsize=(min(3 + 0.35 * max(len(names), 1), 18), 3.6))
    if not names:
        ax.text(0.5, 0.5, "no routed layer (topk = 0 everywhere)", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _save(fig, path)
    entropy = [float(stats[n].get("entropy") or 0.0) for n in names]
    ceiling = [math.log(len(stats[n]["load"]) - int(stats[n].get("shared_heads", 0))) for n in names]
    x = np.arange(len(names))
    ax.bar(x, entropy, color="tab:blue", label="router entropy")
    ax.scatter(x, ceiling, marker="_", s=200, color="tab:red", label="uniform router (log E)", zorder=3)
    ax.set_xticks(x)
    ax.set_xticklabels([_short(n) for n in names], rotation=90, fontsize=7)
    ax.set_ylabel("nats")
    ax.set_ylim(0, 1.3 * max(entropy + ceiling + [1e-3]))
    ax.set_title(title or "router entropy per routed layer", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return _save(fig, path)


# -- Head utility ranking (MoA-style) ----------------------------------------------------------------------------------
def utility_ranking(stat: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One layer's routed heads ranked by how often they are selected (ties: by gate mass): ``[{"rank", "head",
    "selected", "selected_share", "gate_mass", "gate_share"}, ...]``, shares of the layer's routed total."""
    heads = routed_heads_of(stat)
    load = routed_loads_of(stat)
    all_gates = stat.get("gate_mass") or [math.nan] * len(stat["load"])
    gate = [float(all_gates[i]) for i in heads]
    total_load = sum(load) or 1.0
    total_gate = sum(g for g in gate if not math.isnan(g)) or 1.0
    order = sorted(range(len(load)), key=lambda j: (-load[j], -(0.0 if math.isnan(gate[j]) else gate[j]), j))
    return [{"rank": r + 1, "head": heads[j], "selected": load[j], "selected_share": load[j] / total_load,
             "gate_mass": gate[j], "gate_share": gate[j] / total_gate}
            for r, j in enumerate(order)]


def plot_head_utility(stats: Stats, path: Path, title: Optional[str] = None) -> Path:
    """Per routed layer, the routed heads ranked by selection share (left) and by gate-mass share (right): a flat curve
    at 1/E is a balanced layer, a cliff after k heads a collapsed one."""
    plt = _pyplot()
    names = routed_layers(stats)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=False)
    if not names:
        for ax in axes:
            ax.set_axis_off()
        axes[0].text(0.5, 0.5, "no routed layer", ha="center", va="center", transform=axes[0].transAxes)
        return _save(fig, path)
    cmap = _pyplot().get_cmap("viridis")
    for i, name in enumerate(names):
        ranking = utility_ranking(stats[name])
        color = cmap(i / max(len(names) - 1, 1))
        ranks = [r["rank"] for r in ranking]
        axes[0].plot(ranks, [r["selected_share"] for r in ranking], color=color, marker=".", lw=1)
        for ax in axes:  # a perfectly balanced layer: every routed head gets 1/E
            ax.hlines(1.0 / len(ranking), 1, len(ranking), colors=[color], linestyles=":", lw=0.8)
        if not any(math.isnan(r["gate_share"]) for r in ranking):
            axes[1].plot(sorted(ranks), sorted((r["gate_share"] for r in ranking), reverse=True), color=color,
                         marker=".", lw=1)
    for ax, label in zip(axes, ("share of selections", "share of gate mass")):
        ax.set_xlabel("head rank within layer")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    sm = _pyplot().cm.ScalarMappable(cmap=cmap, norm=_pyplot().Normalize(0, max(len(names) - 1, 1)))
    bar = fig.colorbar(sm, ax=axes, fraction=0.03, pad=0.02)
    bar.set_label("routed layer (depth order; dotted: balanced 1/E)")
    ticks = sorted(set(np.linspace(0, len(names) - 1, min(len(names), 6)).round().astype(int).tolist()))
    bar.set_ticks(ticks)
    bar.set_ticklabels([_short(names[i]) for i in ticks], fontsize=6)
    fig.suptitle(title or "head utility: routed heads ranked per layer", fontsize=10)
    return _save(fig, path)


# -- Per-token head choice over the token grid -------------------------------------------------------------------------
def _image_for_display(image: np.ndarray) -> np.ndarray:
    """[C, H, W] (any normalisation) -> [H, W] or [H, W, 3] in [0, 1]."""
    image = np.asarray(image, dtype=float)
    image = image[:3] if image.shape[0] >= 3 else image[:1]
    lo, hi = float(image.min()), float(image.max())
    image = (image - lo) / (hi - lo if hi > lo else 1.0)
    return image[0] if image.shape[0] == 1 else np.transpose(image, (1, 2, 0))


def plot_token_heads(image: Optional[np.ndarray], layers: Sequence[Mapping[str, Any]], path: Path,
                     title: Optional[str] = None) -> Path:
    """Which heads the tokens of one image chose, layer by layer, on each layer's token grid.

    ``layers``: ``[{"name", "grid": (H, W), "shared_heads", "selection": [H*W, h] bool, "gates": [H*W, h] float or None,
    "shared_mask": [h] bools (optional: learned shared heads)}]``. Row per layer: the dominant routed head of each token
    (largest gate among its selected routed heads), then one map per routed head (bright = the token chose it)."""
    plt = _pyplot()
    rows = max(len(layers), 1)

    def routed_columns(layer) -> List[int]:
        heads = int(np.asarray(layer["selection"]).shape[-1])
        return routed_heads_of({"load": [0.0] * heads, "shared_heads": layer.get("shared_heads", 0),
                                "shared_mask": layer.get("shared_mask")})

    routed = [len(routed_columns(l)) for l in layers] or [0]
    cols = 2 + max(routed)
    fig, axes = plt.subplots(rows, cols, figsize=(1.25 * cols + 0.6, 1.5 * rows + 0.6), squeeze=False)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_frame_on(False)
    palette = 10 if max(routed) <= 10 else 20  # tab10 contrasts better; tab20 for wide layers
    categorical = plt.get_cmap(f"tab{palette}")
    from matplotlib.colors import ListedColormap
    for row, layer in enumerate(layers):
        H, W = layer["grid"]
        columns = routed_columns(layer)
        selection = np.asarray(layer["selection"], dtype=bool)[:, columns]  # [N, E]
        gates = layer.get("gates")
        weights = np.asarray(gates, dtype=float)[:, columns] if gates is not None else selection.astype(float)
        dominant = np.where(selection, weights, -np.inf).argmax(axis=-1)
        if image is not None and row == 0:
            shown = _image_for_display(image)
            axes[row, 0].imshow(shown, cmap="gray" if shown.ndim == 2 else None)
            axes[row, 0].set_title("input", fontsize=7)
        axes[row, 1].imshow(dominant.reshape(H, W), cmap=categorical, vmin=0, vmax=palette - 1, interpolation="nearest")
        axes[row, 1].set_title(f"{_short(layer['name'])}\ndominant head", fontsize=6)
        for e in range(selection.shape[1]):
            ax = axes[row, 2 + e]
            chosen = ListedColormap(["#eeeeee", categorical(e % palette)])  # light: not chosen; head colour: chosen
            ax.imshow(selection[:, e].reshape(H, W), cmap=chosen, vmin=0, vmax=1, interpolation="nearest")
            ax.set_frame_on(True)
            ax.set_title(f"h{columns[e]}: {100 * selection[:, e].mean():.0f}%", fontsize=6)
    fig.suptitle(title or "routed heads chosen by each token", fontsize=9)
    return _save(fig, path)


# -- Shared heads: which heads each layer shares (learned or fixed) ----------------------------------------------------
def _per_epoch(stats: Mapping[str, Any]) -> Dict[str, Stats]:
    """``{epoch: {layer: stat}}`` from either that or one epoch's ``{layer: stat}``."""
    first = next(iter(stats.values()), None)
    if first is not None and "load" not in first:  # keyed by epoch (routing.json)
        return {str(e): stats[e] for e in sorted(stats, key=lambda e: int(e))}
    return {"": stats}


def plot_shared_heads(stats: Mapping[str, Any], path: Path, title: Optional[str] = None) -> Path:
    """Layers x heads: which heads each routed layer shares, from one epoch's stats or ``routing.json``
    (``{epoch: {layer: stat}}``). ``S`` marks the shared heads of the last epoch; the colour is the fraction of the
    recorded forwards (over every epoch given) in which the head was shared, so a head the learned partition moved shows
    between 0 and 1. Layers without routing are left out."""
    plt = _pyplot()
    epochs = _per_epoch(stats)
    last = list(epochs.values())[-1] if epochs else {}
    names = routed_layers(last)
    fig_h = min(1.6 + 0.32 * max(len(names), 1), 30)
    if not names:
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.text(0.5, 0.5, "no routed layer", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _save(fig, path)
    width = max(len(last[n]["load"]) for n in names)
    frac = np.full((len(names), width), np.nan)
    for row, name in enumerate(names):
        seen = [ep[name] for ep in epochs.values() if name in ep]
        per_epoch = [np.asarray(s.get("shared_frac") or shared_mask_of(s), dtype=float) for s in seen]
        frac[row, :len(per_epoch[-1])] = np.mean(per_epoch, axis=0)
    fig, ax = plt.subplots(figsize=(min(2.5 + 0.42 * width, 16), fig_h))
    cmap = plt.get_cmap("Blues").copy()
    cmap.set_bad("#d9d9d9")  # grey: the layer has fewer heads
    image = ax.imshow(np.ma.masked_invalid(frac), aspect="auto", cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
    for row, name in enumerate(names):
        for col, shared in enumerate(shared_mask_of(last[name])):
            if shared:
                ax.text(col, row, "S", ha="center", va="center", color="white", fontsize=8, fontweight="bold")

    def label(name: str) -> str:
        s = last[name]
        kind = "fixed"
        if s.get("shared_mask") is not None:
            kind = "learned, frozen" if s.get("shared_frozen") else "learned, warm-up"
        return f"{_short(name)} ({int(s.get('shared_heads', 0))}+{int(s.get('topk', 0))}, {kind})"

    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([label(n) for n in names], fontsize=7)
    ax.set_xticks(range(width))
    ax.set_xticklabels([str(i) for i in range(width)], fontsize=7)
    ax.set_xlabel("head (S = shared at the last epoch)")
    ax.set_ylabel("layer (shared + top-k)")
    span = [e for e in epochs if e != ""]
    default = "shared heads" + (f", epochs {span[0]}..{span[-1]}" if len(span) > 1 else
                                (f", epoch {span[0]}" if span else ""))
    ax.set_title(title or default, fontsize=10)
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("fraction of forwards shared", fontsize=7)
    return _save(fig, path)


def has_learned_shared_heads(stats: Mapping[str, Any]) -> bool:
    """Whether any layer of ``stats`` (one epoch or ``{epoch: ...}``) learns its shared heads."""
    return any(s.get("shared_mask") is not None for ep in _per_epoch(stats).values() for s in ep.values())
