"""Released weights, evaluated as the papers evaluate them: ``eval.py model=<preset> pretrained=<weights>``.

``pretrained`` is a local file in any format :func:`moh_vision.checkpoints.read_weights` reads, a Hugging Face hub id
(``owner/repo`` or ``hf-hub:owner/repo``, through :mod:`moh_vision.models.hub`'s cache), or ``true`` for the weights the
preset's registered cfg names. They load strictly: a tensor that does not fit is a one-line error, never a
re-initialised classifier. Top-1 follows timm's ``validate.py``: the images go through ``timm.data.create_transform``
with what ``resolve_data_config`` reads from the model's pretrained cfg, not the data config's eval transform. Under
torchrun each rank takes every WORLD_SIZE-th image and the sums are all-reduced."""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from moh_vision.checkpoints import read_weights, state_dict_mismatch
from moh_vision.errors import ConfigError
from moh_vision.engine.distributed import cleanup, init_distributed, reduce_sums
from moh_vision.engine.loggers import write_json

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^(hf-hub:)?[\w.-]+/[\w.-]+$")
PRESET_WEIGHTS = ("true", "default")


def released_weights_path(name: str, pretrained: str) -> Path:
    """The local file that ``pretrained`` names for model ``name`` (fetched into the hub cache for a hub id)."""
    from timm.models import get_pretrained_cfg

    from moh_vision.models.hub import WEIGHT_SUFFIXES, released_weights_file
    value = str(pretrained).strip()
    registered = get_pretrained_cfg(name)
    registered = registered.to_dict() if registered is not None else {}
    if value.lower() in PRESET_WEIGHTS:
        path = released_weights_file(name, registered)
        if path is None:
            raise ConfigError(f"pretrained={value}: {name} has no registered released weights; give pretrained=<file>")
        return path
    local = Path(value).expanduser()
    if local.is_file():
        return local
    if HUB_ID.match(value) and not value.endswith(WEIGHT_SUFFIXES):
        repo = value.removeprefix("hf-hub:")
        filename = registered.get("hf_hub_filename") if registered.get("hf_hub_id") == repo else None
        return released_weights_file(name, {"hf_hub_id": repo, "hf_hub_filename": filename})
    raise ConfigError(f"pretrained={value} does not exist; give a local weights file, a Hugging Face hub id "
                      f"(owner/repo) or true (the weights {name}'s cfg names)")


def read_released(name: str, pretrained: str) -> Tuple[Path, Dict[str, torch.Tensor]]:
    """(file, weights) that ``pretrained`` names for model ``name``."""
    path = released_weights_path(name, pretrained)
    return path, read_weights(path)


def load_strictly(model: nn.Module, state: Dict[str, torch.Tensor], what: str, hint: str = "") -> None:
    """Every tensor of ``state`` into ``model``, or a one-line error saying what does not fit."""
    problem = state_dict_mismatch(model.state_dict(), state)
    if problem:
        raise ConfigError(f"{what} does not fit the model as built: {problem}{hint}")
    model.load_state_dict(state, strict=True)


def timm_eval_transform(model: nn.Module):
    """(transform, data config) as timm's validate.py builds them from the model's pretrained cfg."""
    from timm.data import create_transform, resolve_data_config
    config = resolve_data_config({}, model=model, use_test_size=True)
    return create_transform(**config, is_training=False), config


def check_released_classifier(model_cfg: Dict[str, Any], data_cfg: Any) -> None:
    """``eval.py model=... pretrained=...`` names an image classifier, its weights only in ``pretrained``, and data."""
    from moh_vision.config import TASK_MODEL_FAMILIES
    from moh_vision.models import model_family
    name, families = model_cfg["name"], TASK_MODEL_FAMILIES["classification"]
    if model_cfg.get("checkpoint_path") or model_cfg.get("init_from"):
        raise ConfigError("model.checkpoint_path / model.init_from start training runs; released weights go in "
                          "pretrained=<file | hub id | true>")
    if model_family(name) not in families:
        raise ConfigError(f"eval.py model=... pretrained=... evaluates image classifiers ({', '.join(families)}), "
                          f"not {name}; sample released DiT weights with tools/sample.py model={name} pretrained=...")
    if data_cfg is None:
        raise ConfigError("released weights need data to evaluate on: data=imagenet data.root=<dir> "
                          "(or data=imagefolder data.root=<dir>)")


def released_classifier(model_cfg: Dict[str, Any], pretrained: str, num_classes: int) -> Tuple[nn.Module, Path]:
    """The preset with ``num_classes`` outputs and the released weights loaded strictly; their file."""
    from moh_vision.models import build_model
    kwargs = dict(model_cfg.get("kwargs") or {})
    if kwargs.setdefault("num_classes", num_classes) != num_classes:
        raise ConfigError(f"model.kwargs.num_classes={kwargs['num_classes']} but the data have {num_classes} classes")
    model = build_model(model_cfg["name"], **kwargs)
    weights, state = read_released(model_cfg["name"], pretrained)
    load_strictly(model, state, f"pretrained={pretrained} ({weights})", f" (the data have {num_classes} classes)")
    return model.eval(), weights


def evaluate_sets(model: nn.Module, options, val, transform, device: torch.device, amp, dist=None) -> Dict[str, Any]:
    """Top-1 / top-5 of ``model`` on each of ``eval.sets`` (:mod:`moh_vision.data.eval_sets`), ``eval.roots`` their
    folders, ``val`` the data's val split (in1k and real without a root of their own); under torchrun each rank
    scores every WORLD_SIZE-th image and the sums are all-reduced."""
    from torch.utils.data import DataLoader

    from moh_vision.data.eval_sets import SetScore, build_set
    from moh_vision.data.imagefolder import SkipBadImagesCollate
    from moh_vision.data.sampler import HeldIndices
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    metrics: Dict[str, Any] = {}
    sets = [build_set(name, dict(options.eval.roots), val, transform) for name in dict.fromkeys(options.eval.sets)]
    model.eval()
    for one in sets:
        score = one.score()
        loader = DataLoader(one.dataset, batch_size=options.eval.batch_size, num_workers=options.eval.num_workers,
                            sampler=HeldIndices(range(rank, len(one.dataset), world)),
                            collate_fn=SkipBadImagesCollate((3, 1, 1)))
        with torch.no_grad():
            for images, targets, _ in loader:
                if images.shape[0]:
                    with amp():
                        logits = model(images.to(device))
                    score.add(logits, targets)
        sums = reduce_sums(score.sums, dist, device) if dist is not None else score.sums
        result = SetScore.result(sums, one.name)
        metrics.update(result)
        metrics.setdefault("sets", {})[one.name] = {"top1": result[f"{one.name}/acc1"],
                                                    "top5": result[f"{one.name}/acc5"], "images": int(sums["count"]),
                                                    "left_out": one.left_out, "root": str(one.root)}
        log.info("%s: top-1 %.2f, top-5 %.2f on %d images of %s", one.name, result[f"{one.name}/acc1"],
                 result[f"{one.name}/acc5"], int(sums["count"]), one.root)
    return metrics


def evaluate_released(cfg: DictConfig, out_dir: Path, options) -> Dict[str, Any]:
    """Top-1 / top-5 of released classification weights on ``data``'s validation images (all ranks)."""
    from torch.utils.data import DataLoader

    from moh_vision.config import build_data
    from moh_vision.data.imagefolder import SkipBadImagesCollate
    from moh_vision.data.sampler import HeldIndices
    from moh_vision.tasks.classification import ClassificationTask
    from moh_vision.engine.fit_setup import amp_context
    start = time.time()
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    name, pretrained = model_cfg["name"], str(options.pretrained)
    check_released_classifier(model_cfg, cfg.data)
    dist = init_distributed(options.eval.device)
    try:
        data = build_data(OmegaConf.to_container(cfg.data, resolve=True), splits=("val",))
        if getattr(data, "in_chans", 3) != 3 or not hasattr(data.val, "transform"):
            raise ConfigError(f"released weights are evaluated on RGB image folders (data=imagenet or "
                              f"data=imagefolder), not {type(data).__name__}")
        from moh_vision.data.eval_sets import check_classes
        check_classes(data.classes, data.num_classes, data.root)  # wnids: in the ImageNet order
        model, weights = released_classifier(model_cfg, pretrained, data.num_classes)
        model = model.to(dist.device)
        data.val.transform, data_config = timm_eval_transform(model)
        loader = DataLoader(data.val, batch_size=options.eval.batch_size, num_workers=options.eval.num_workers,
                            sampler=HeldIndices(range(dist.rank, len(data.val), dist.world_size)),
                            collate_fn=SkipBadImagesCollate(data_config["input_size"]))
        if dist.is_main:
            log.info("evaluating %s with %s on %d images of %s (%d ranks): %s", name, weights, len(data.val),
                     data.root, dist.world_size, ", ".join(f"{k}={v}" for k, v in data_config.items()))
        task = ClassificationTask(model=model_cfg, attention={}, aux_loss_weight=0.0)
        sums = task.evaluate(model, loader, dist.device, amp=amp_context(options.eval.amp, dist.device))
        metrics = task.finalize(reduce_sums(sums, dist, dist.device), prefix="val")
        if options.eval.sets:
            metrics.update(evaluate_sets(model, options, data.val, data.val.transform, dist.device,
                                         amp_context(options.eval.amp, dist.device), dist))
        summary = {"model": name, "pretrained": pretrained, "weights_file": str(weights), "data_root": data.root,
                   "class_order": getattr(data, "class_order", None), "data_source": getattr(data, "source", None),
                   "params": sum(p.numel() for p in model.parameters()), "world_size": dist.world_size,
                   "eval_transform": {k: list(v) if isinstance(v, tuple) else v for k, v in data_config.items()},
                   **metrics, "wall_time_s": time.time() - start}
        if dist.is_main:
            write_json(out_dir / "summary.json", summary)
            OmegaConf.save(cfg, out_dir / "config.yaml")
            log.info("%s", ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
        return summary
    finally:
        cleanup(dist)
