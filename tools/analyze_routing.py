"""How a trained MoH / MoA model routes its heads, on a few validation images.

    python tools/analyze_routing.py ckpt=outputs/<run>/checkpoints/last.pt
    python tools/analyze_routing.py ckpt=<path> num_images=32 out=routing/ map_images=4
    python tools/analyze_routing.py ckpt=<path> data=imagefolder data.root=/data/val   # other data
    python tools/analyze_routing.py ckpt=<dit run>/checkpoints/last.pt timestep=250

The checkpoint carries its config: the data, task and model are rebuilt from it exactly as
``eval.py`` does (``data=<name>`` / ``data.<key>=...`` override the data, as there). Each routed
layer records which heads every token selected (``record_selection``) and the gates they got.
Written to ``out`` (default: ``<run dir>/routing_analysis``):

* ``head_load.png``: layers x heads, fraction of tokens using each head (``s`` = shared head);
* ``shared_heads.png`` (only when some layer learns its shared heads, ``attention.shared_heads=learned``):
  layers x heads, the heads each layer shares (``S``), learned or fixed, frozen or still in warm-up;
* ``gate_mass.png``: layers x heads, mean gate per token;
* ``router_entropy.png``: mean router entropy per routed layer, against the uniform maximum;
* ``head_utility.png``: routed heads ranked per layer by selections and by gate mass (MoA-style);
* ``token_heads_<i>.png``: for the first ``map_images`` images, the heads each token chose on
  each routed layer's token grid (TransNeXt: the stage's H/4 ... H/32 grid; DiT / ViT: the patch
  grid, class token dropped);
* ``routing_analysis.json``: all of the above as numbers (per layer: load, gate mass, entropy,
  utility ranking, grid); ``selection.npz``: the raw per-token masks and gates of the mapped images.

Options: ``num_images`` (8), ``map_images`` (4), ``batch_size`` (32), ``device`` (auto),
``weights`` (``model`` | ``ema``), ``timestep`` (diffusion: the noise level the DiT sees; default
half the schedule), ``max_map_layers`` (8 rows per token map, spread over depth), ``logger``
(``auto``: wandb if the run logged to wandb, offline without credentials; ``wandb``; ``none``).
"""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moh_vision.analysis import routing_plots  # noqa: E402
from moh_vision.analysis.routing import routed_loads_of  # noqa: E402
from moh_vision.errors import ConfigError  # noqa: E402

log = logging.getLogger("analyze_routing")

OPTIONS = {"ckpt": None, "num_images": 8, "map_images": 4, "batch_size": 32, "device": "auto", "weights": "model",
           "timestep": None, "max_map_layers": 8, "out": None, "logger": "auto"}


# ----------------------------------------------------------------------------------------------
# Arguments and rebuilding the run
# ----------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    """Own ``key=value`` options, and the ``data=`` / ``data.*=`` overrides for Hydra."""
    opts, data_overrides = dict(OPTIONS), []
    for word in argv:
        if word in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        key, sep, value = word.partition("=")
        if not sep:
            raise ConfigError(f"arguments are key=value (e.g. ckpt=<path>); got '{word}'")
        if key == "data" or key.startswith(("data.", "+data.", "~data.")):
            data_overrides.append(word)
        elif key in OPTIONS:
            opts[key] = yaml.safe_load(value) if key not in ("ckpt", "out") else value
        else:
            raise ConfigError(f"unknown argument '{key}'; known: {', '.join(OPTIONS)}, data, data.<key>")
    if not opts["ckpt"]:
        raise ConfigError("give ckpt=<path to a checkpoint written by train.py>")
    if opts["weights"] not in ("model", "ema"):
        raise ConfigError(f"weights={opts['weights']} is unknown; use model or ema")
    if opts["logger"] not in ("auto", "wandb", "none"):
        raise ConfigError(f"logger={opts['logger']} is unknown; use auto, wandb or none")
    for key in ("num_images", "map_images", "batch_size", "max_map_layers"):
        if not isinstance(opts[key], int) or opts[key] < (1 if key != "map_images" else 0):
            raise ConfigError(f"{key}={opts[key]} must be a positive integer")
    return opts, data_overrides


def load_run(ckpt: str, data_overrides: Sequence[str], weights: str):
    """(state, saved config container, data, task, model with the checkpoint's weights) as eval does."""
    from hydra import compose, initialize_config_dir

    from moh_vision.engine.run import rebuild_run, weights_of

    data_cfg = None
    if data_overrides:
        if not any(o.startswith("data=") for o in data_overrides):  # eval.yaml has no data group: add keys
            data_overrides = [f"+{o}" if o.startswith("data.") else o for o in data_overrides]
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            data_cfg = compose(config_name="eval", overrides=[f"ckpt={ckpt}", *data_overrides]).get("data")
    run = rebuild_run(ckpt, data_cfg)
    model = run.task.build_model(run.data)
    model.load_state_dict(weights_of(run, weights == "ema", off_switch="weights=model"))
    return run.state, run.path, run.config, run.data, run.task, model


# ----------------------------------------------------------------------------------------------
# Recording what the routed layers chose
# ----------------------------------------------------------------------------------------------
class Recorder:
    """Turns on ``record_selection`` on every routed layer (which then keep ``last_selection`` and
    ``last_gates``); :meth:`close` turns it off again."""

    def __init__(self, model: torch.nn.Module):
        from moh_vision.attention import routed_modules

        self.layers = list(routed_modules(model))
        for _, module in self.layers:
            module.record_selection = True

    @property
    def gates(self) -> Dict[str, Optional[torch.Tensor]]:
        return {name: module.last_gates for name, module in self.layers}

    def close(self) -> None:
        for _, module in self.layers:
            module.record_selection = False
            module.last_selection = module.last_gates = None


def token_grid(model: torch.nn.Module, module: torch.nn.Module, tokens: int) -> Tuple[Tuple[int, int], int]:
    """((H, W), prefix tokens) of a layer's token sequence: the kernel's own ``input_resolution``
    (TransNeXt stages), else the model's patch grid (DiT ``grid_size``, ViT ``patch_embed``) with
    leading class tokens dropped; a square or a single row as the last resort."""
    grid = getattr(module, "input_resolution", None) or getattr(model, "grid_size", None) \
        or getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is not None:
        H, W = int(grid[0]), int(grid[1])
        if tokens >= H * W:
            return (H, W), tokens - H * W
    side = int(math.isqrt(tokens))
    return ((side, side), 0) if side * side == tokens else ((1, tokens), 0)


def forward_batch(task, model, batch, device, timestep: Optional[int], generator: torch.Generator) -> torch.Tensor:
    """One forward of the task's model on a validation batch; returns the model input (images)."""
    from moh_vision.tasks.classification import split_batch

    x, y, _ = split_batch(batch)
    x, y = x.to(device), y.to(device)
    if getattr(task, "name", "") == "diffusion":
        T = task.diffusion.num_timesteps
        t = torch.full((x.shape[0],), T // 2 if timestep is None else int(timestep), dtype=torch.long, device=device)
        if not 0 <= int(t[0]) < T:
            raise ConfigError(f"timestep={timestep} is outside 0..{T - 1}")
        noise = torch.randn(x.shape, generator=generator).to(device)
        model(task.diffusion.q_sample(x, t, noise), t, y)
    else:
        model(x)
    return x


@torch.no_grad()
def analyse(task, model, loader, device, opts: Dict[str, Any]):
    """Per-layer sums over ``num_images`` validation images and the raw masks of the first ``map_images``."""
    model.eval().to(device)
    recorder = Recorder(model)
    if not recorder.layers:
        recorder.close()
        raise ConfigError("this model has no routed attention layer (attention=mha?): nothing to analyse")
    sums: Dict[str, Dict[str, Any]] = {}
    maps: Dict[str, Dict[str, List[np.ndarray]]] = {name: {"selection": [], "gates": []} for name, _ in recorder.layers}
    images: List[np.ndarray] = []
    seen = 0
    generator = torch.Generator().manual_seed(0)
    try:
        for batch in loader:
            if seen >= opts["num_images"]:
                break
            x = forward_batch(task, model, batch, device, opts["timestep"], generator)
            take = min(x.shape[0], opts["num_images"] - seen)
            keep_maps = max(0, min(take, opts["map_images"] - seen))
            images.extend(x[:keep_maps].float().cpu().numpy())
            for name, module in recorder.layers:
                selection = module.last_selection[:take].float()  # [b, N, h]
                gates = recorder.gates.get(name)
                gates = gates[:take].float() if gates is not None else None
                stats = module.routing_stats or {}
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
                    maps[name]["selection"].append(module.last_selection[:keep_maps].cpu().numpy())
                    if gates is not None:
                        maps[name]["gates"].append(gates[:keep_maps].cpu().numpy().astype(np.float16))
            seen += take
    finally:
        recorder.close()
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


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------
def write_outputs(out: Path, stats, maps, images, opts) -> Dict[str, str]:
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
    shown = map_layers(stats, opts["max_map_layers"])
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
        files[f"token_heads_{i}"] = routing_plots.plot_token_heads(image, rows, out / f"token_heads_{i}.png",
                                                                   title=f"validation image {i}: heads chosen per token")
    if arrays:
        np.savez_compressed(out / "selection.npz", **arrays)
        files["selection"] = out / "selection.npz"
    return {k: Path(v).name for k, v in files.items()}


def log_to_wandb(mode: str, container: Dict[str, Any], state: Dict[str, Any], out: Path, stats, files,
                 summary: Dict[str, Any]) -> Optional[str]:
    """Log the figures and per-layer numbers to a wandb run (job_type ``routing_analysis``) in the
    training run's project and group. Returns the run id, or None when wandb is off or unusable."""
    logger_cfg = dict(container.get("logger") or {})
    if mode == "none" or (mode == "auto" and logger_cfg.get("name") != "wandb"):
        return None
    try:
        from moh_vision.engine.loggers import WandbLogger
        run = WandbLogger(out, {"analysis": summary, "trained": container}, project=logger_cfg.get("project", "moh-vision"),
                          entity=logger_cfg.get("entity"), group=logger_cfg.get("group"),
                          name=f"routing-{state.get('wandb_run_id') or summary['model']}", job_type="routing_analysis",
                          mode=logger_cfg.get("mode", "auto"))
    except Exception as err:  # wandb missing or failing: the files are the result anyway
        log.warning("wandb logging skipped (%s: %s)", type(err).__name__, err)
        return None
    step = int(state.get("step") or 0)
    for key, name in files.items():
        if name.endswith(".png"):
            run.log_image(f"routing/{key}", out / name, step=step)
    row = {}
    for layer, s in stats.items():
        if s["topk"] > 0:
            routed = routed_loads_of(s)
            row[f"routing/{layer}/entropy"] = s["entropy"]
            row[f"routing/{layer}/max_load"] = max(routed)
            row[f"routing/{layer}/min_load"] = min(routed)
    run.log(row, step=step)
    run.summary({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    run_id = run.run_id
    run.finish()
    return run_id


def default_out(ckpt: Path) -> Path:
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / "routing_analysis"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    from torch.utils.data import DataLoader

    from moh_vision.engine.distributed import pick_device

    opts, data_overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    state, used, container, data, task, model = load_run(opts["ckpt"], data_overrides, opts["weights"])
    device = pick_device(str(opts["device"]))
    loader = DataLoader(data.val, batch_size=min(opts["batch_size"], opts["num_images"]), shuffle=False,
                        num_workers=0, collate_fn=data.collate_fn)
    sums, maps, images, seen = analyse(task, model, loader, device, opts)
    stats = layer_statistics(model, sums)
    out = Path(opts["out"]) if opts["out"] else default_out(Path(used))
    files = write_outputs(out, stats, maps, images, opts)
    summary = {"checkpoint": str(used), "model": container["model"]["name"], "task": getattr(task, "name", "?"),
               "data": data.describe() if hasattr(data, "describe") else type(data).__name__,
               "weights": opts["weights"], "num_images": seen, "step": state.get("step"),
               "timestep": (task.diffusion.num_timesteps // 2 if opts["timestep"] is None else int(opts["timestep"]))
               if getattr(task, "name", "") == "diffusion" else None}
    result = {**summary, "layers": stats, "files": files}
    (out / "routing_analysis.json").write_text(json.dumps(result, indent=1))
    result["wandb_run_id"] = log_to_wandb(opts["logger"], container, state, out, stats, files, summary)
    print(f"routing analysis of {summary['model']} on {seen} validation images: {len(stats)} routed layers -> {out}")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from moh_vision.cli import user_error_in

    try:
        main()
    except Exception as err:
        if user_error_in(err) is None:
            raise
        print(f"error: {user_error_in(err)}", file=sys.stderr)
        sys.exit(2)
