"""Turn a dense TransNeXt / DiT / plain-ViT checkpoint into a MoH model of the same backbone, and measure the step-0
drop (``tools/convert_dense_to_moh.py``).

Every dense tensor is copied unchanged and the routers start so that every active head has gate 1
(:mod:`moh_vision.models.continue_tuning`): keeping every head computes the dense function at step 0, keeping fewer
starts with those heads dropped. With data overrides (``data=digits``, ``data=imagenet data.root=...``) both models are
built as ``train.py model.init_from=<ckpt>`` would and evaluated on the validation split (classification: top-1/top-5
and loss; diffusion: the validation loss at fixed timesteps and noise). Writes ``out`` (the converted state dict, for
``model.checkpoint_path=``) and ``<out>.json`` (what was copied, which layers start exactly dense, the evaluation)."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from moh_vision.attention import routed_modules
from moh_vision.checkpoints import atomic_save, plain_tensors
from moh_vision.cli import attention_config
from moh_vision.config import compose
from moh_vision.errors import ConfigError, RunError
from moh_vision.models import build_model, list_models, model_family
from moh_vision.models.continue_tuning import (DEFAULT_ROUTER_STD, ContinueTuningError, init_from_dense,
                                               read_dense_checkpoint, routing_like)
from moh_vision.engine.distributed import pick_device

log = logging.getLogger(__name__)

DEFAULT_ATTENTION = "moh"  # the target attention when none is given (the project's subject)


def has_own_routing(name: str) -> bool:
    """Whether model ``name`` routes heads as built (a MoH preset with its own per-layer heads)."""
    with torch.device("meta"):
        return any(True for _ in routed_modules(build_model(name)))


def target_attention(model: str, attention: Optional[str], routing: Dict[str, Any], like: Optional[str],
                     model_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The ``attention`` config group the target is built with (as train.py would pass it): the variant's YAML defaults,
    overridden by the routing options (``activation_ratio``, ``shared_heads``, ``topk``)."""
    routing = {k: v for k, v in routing.items() if v is not None}
    if like:
        if routing:
            raise ConfigError("routing_like sets shared heads and top-k itself; drop activation_ratio, shared_heads "
                              "and topk")
        routing = routing_like(like, model, **model_kwargs)
    name = attention or ("preset" if has_own_routing(model) and not routing else DEFAULT_ATTENTION)
    if name == "preset" and routing:
        raise ConfigError("attention=preset keeps the preset's routing; drop the routing options")
    group = attention_config(name)
    unknown = sorted(set(routing) - set(group))
    if unknown:
        raise ConfigError(f"attention={name} takes no {', '.join(unknown)} (its options: {', '.join(group)})")
    if not attention and not routing:
        log.info("no routing given: %s with configs/attention/%s.yaml's defaults", name, name)
    return {**group, **routing}


def _hydra_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return "null" if value is None else str(value)


def train_overrides(model: str, attention: Dict[str, Any], model_kwargs: Dict[str, Any]) -> List[str]:
    """The ``train.py`` overrides that build this target."""
    overrides = ["experiment=diffusion"] if model_family(model) == "dit" else []
    overrides.append(f"model={model}" if model in list_models() else f"model.name={model}")
    overrides.append(f"attention={attention['name'] or 'preset'}")
    overrides += [f"attention.{k}={_hydra_value(v)}" for k, v in attention.items() if k != "name"]
    return overrides + [f"++model.kwargs.{k}={_hydra_value(v)}" for k, v in model_kwargs.items()]


def build_pair(model: str, attention: Dict[str, Any], model_kwargs: Dict[str, Any], eval_overrides: Sequence[str],
               compare_outputs: bool):
    """(dense model, target model, task or None, data or None); neither has weights loaded yet."""
    if not eval_overrides:
        target = build_model(model, attention=attention, **model_kwargs)
        dense = build_model(model, attention={"name": "mha"}, **model_kwargs) if compare_outputs else None
        return dense, target, None, None
    from omegaconf import OmegaConf

    from moh_vision.config import build_data, build_task

    cfg = compose("train", [*train_overrides(model, attention, model_kwargs), *eval_overrides])
    data = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    config = OmegaConf.to_container(cfg, resolve=True)
    config["model"].update(checkpoint_path=None, init_from=None)
    task = build_task(config["task"], model=config["model"], attention=config["attention"])
    dense_task = build_task(config["task"], model=config["model"], attention={"name": "mha", "aux_loss_weight": 0.0})
    return dense_task.build_model(data), task.build_model(data), task, data


def evaluate(task, data, model: torch.nn.Module, device: torch.device, batch_size: int,
             limit: Optional[int]) -> Dict[str, float]:
    from torch.utils.data import DataLoader, Subset
    val = data.val if not limit else Subset(data.val, range(min(int(limit), len(data.val))))
    loader = DataLoader(val, batch_size=batch_size, shuffle=False, collate_fn=data.collate_fn)
    sums = task.evaluate(model.to(device).eval(), loader, device, amp=contextlib.nullcontext)
    return dict(task.finalize(sums, prefix="val"))


def drop(dense: Dict[str, float], converted: Dict[str, float]) -> Dict[str, float]:
    """Dense minus converted for accuracies (points lost), converted minus dense for losses (rise)."""
    return {key: value - converted[key] if "acc" in key else converted[key] - value
            for key, value in dense.items() if key in converted and not key.endswith("count")}


@torch.no_grad()
def output_difference(dense: torch.nn.Module, target: torch.nn.Module) -> Optional[float]:
    """Max |dense - converted| on a random classification input (no data needed); None for DiT."""
    shape = (getattr(target, "pretrained_cfg", None) or {}).get("input_size")
    if not shape or not hasattr(target, "forward_head"):
        return None
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    return float((dense.eval()(x) - target.eval()(x)).abs().max())


def report_evaluation(dense: Dict[str, float], converted: Dict[str, float], dropped: Dict[str, float]) -> None:
    print(f"step-0 evaluation on {int(dense.get('val/count', 0))} validation items:")
    print(f"  {'metric':<12} {'dense':>10} {'converted':>10} {'drop':>10}")
    for key in (k for k in dense if not k.endswith("count")):
        print(f"  {key:<12} {dense[key]:>10.4f} {converted.get(key, float('nan')):>10.4f} "
              f"{dropped.get(key, float('nan')):>10.4f}")


def convert_dense_to_moh(dense: str, model: str, out: str, attention: Optional[str] = None,
                         routing: Optional[Dict[str, Any]] = None, routing_like_preset: Optional[str] = None,
                         model_kwargs: Optional[Dict[str, Any]] = None, weights: str = "auto",
                         router_std: float = DEFAULT_ROUTER_STD, seed: int = 0, eval_overrides: Sequence[str] = (),
                         eval_limit: Optional[int] = None, eval_batch_size: int = 128, device: str = "auto",
                         compare_outputs: bool = False) -> Dict[str, Any]:
    """Convert ``dense`` into ``model`` (see the module docstring) and write ``out`` and ``<out>.json``. Raises
    :class:`ConfigError` for bad arguments or an unreadable checkpoint, :class:`RunError` when the checkpoint does not
    fit the model (nothing is written). Returns what ``<out>.json`` holds."""
    start, model_kwargs = time.time(), dict(model_kwargs or {})
    target_cfg = target_attention(model, attention, dict(routing or {}), routing_like_preset, model_kwargs)
    ckpt = read_dense_checkpoint(dense, weights)
    dense_model, target, task, data = build_pair(model, target_cfg, model_kwargs, eval_overrides, compare_outputs)
    try:
        report = init_from_dense(target, ckpt, router_std=router_std, seed=seed)
    except ContinueTuningError as err:
        raise RunError(f"{err}; nothing written") from err
    print(report.summary())
    result: Dict[str, Any] = {"dense": str(dense), "model": model, "model_kwargs": model_kwargs,
                              "attention": target_cfg, "conversion": report.as_dict()}
    if dense_model is not None:
        dense_model.load_state_dict(ckpt.state, strict=True)
    if task is not None:
        where = pick_device(device)
        dense_metrics = evaluate(task, data, dense_model, where, eval_batch_size, eval_limit)
        converted = evaluate(task, data, target, where, eval_batch_size, eval_limit)
        result["eval"] = {"overrides": list(eval_overrides), "limit": eval_limit, "dense": dense_metrics,
                          "converted": converted, "drop": drop(dense_metrics, converted)}
        report_evaluation(dense_metrics, converted, result["eval"]["drop"])
    elif dense_model is not None:
        diff = output_difference(dense_model, target)
        if diff is not None:
            result["max_abs_output_difference"] = diff
            print(f"max |dense - converted| on a random input: {diff:.3g}")
    out = Path(out)
    atomic_save(plain_tensors(target.state_dict()), out)
    report_path = out.with_suffix(out.suffix + ".json")
    report_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out} and {report_path} ({time.time() - start:.1f}s)")
    train = [o for o in train_overrides(model, target_cfg, model_kwargs)
             if not o.startswith("attention.aux_loss_weight=")]
    print(f"continue-tune with: python train.py {' '.join(train)} model.init_from={dense}   (the same start: "
          f"model.checkpoint_path={out})")
    return result
