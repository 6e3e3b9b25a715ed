"""The optimizer and the learning-rate schedule, built by timm's factories.

Optimizer (:func:`build_optimizer`): any of timm's optimizers by name (``timm.optim.create_optimizer_v2``: adamw,
lamb, sgd, lion, ...). No weight decay on 1-D parameters, biases, the model's ``no_weight_decay()`` names and its
``no_weight_decay_keywords()`` fragments, nor on parameters whose name holds one of ``no_weight_decay_keywords``
(the TransNeXt / DeiT recipe). Without layer decay the parameters form two groups, decayed first, as every earlier
release saved them (their optimizer states load); with ``layer_decay`` timm's groups by depth
(``param_groups_layer_decay`` over the model's ``group_matcher()``), each with its ``lr_scale``.

Schedule (:class:`Schedule`): timm's schedulers (``timm.scheduler.create_scheduler_v2``) updated every optimizer
step (``t_in_epochs=False``): a linear warm-up from ``warmup_lr`` over ``warmup_epochs`` (+ ``warmup_steps``), then
the decay over the steps left less ``cooldown_epochs``, then ``min_lr`` held for the cool-down. The rate is a pure
function of the step, so a resumed run recomputes it from the step alone."""
from __future__ import annotations

import glob
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import nn

from moh_vision.config import check_optimizer
from moh_vision.errors import ConfigError


# ---- Optimizer -------------------------------------------------------------------------------
def no_decay_names(model: nn.Module, extra_keywords: Sequence[str] = ()) -> set:
    """Names the model asks to exclude (``no_weight_decay``, ``no_weight_decay_keywords``) plus those holding one
    of ``extra_keywords`` (``optim.no_weight_decay_keywords``)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    keywords = set(getattr(model, "no_weight_decay_keywords", lambda: set())()) | set(extra_keywords)
    return {name for name, _ in model.named_parameters() if name in skip or any(k in name for k in keywords)}


def param_groups(model: nn.Module, weight_decay: float, extra_keywords: Sequence[str] = ()) -> List[dict]:
    """Two groups: decayed weights, and 1-D params / biases / :func:`no_decay_names` with wd 0."""
    skip = no_decay_names(model, extra_keywords)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or name in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def layer_decay_groups(model: nn.Module, weight_decay: float, layer_decay: float,
                       extra_keywords: Sequence[str] = ()) -> List[dict]:
    """timm's layer-wise groups (lr x ``layer_decay`` per layer below the head, layers from ``group_matcher()``), with
    1-D parameters (biases among them) and :func:`no_decay_names` undecayed as without layer decay."""
    from timm.optim import param_groups_layer_decay

    skip = sorted(no_decay_names(model, extra_keywords))
    return param_groups_layer_decay(model, weight_decay=weight_decay, layer_decay=layer_decay,
                                    no_weight_decay_list=[glob.escape(n) for n in skip])  # timm matches patterns


def build_optimizer(model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.05,
                    betas: Iterable[float] = (0.9, 0.999), eps: float = 1e-8, momentum: float = 0.9,
                    layer_decay: Optional[float] = None, no_weight_decay_keywords: Sequence[str] = (),
                    kwargs: Optional[Mapping[str, Any]] = None,
                    kernel: Optional[Mapping[str, bool]] = None) -> torch.optim.Optimizer:
    """timm's optimizer ``name`` over :func:`param_groups` (or :func:`layer_decay_groups`); ``betas``, ``eps`` and
    ``momentum`` go to the optimizers that take them, ``kwargs`` to the optimizer as given, and ``kernel`` (its
    implementation, ``fused=True`` or ``foreach=True``: device_settings.optimizer_kernel) where it takes it."""
    from timm.optim import create_optimizer_v2

    check_optimizer(name)
    kwargs = {**{k: v for k, v in (kernel or {}).items() if k in _init_keywords(name)}, **dict(kwargs or {})}
    groups = (layer_decay_groups(model, weight_decay, layer_decay, no_weight_decay_keywords) if layer_decay is not None
              else param_groups(model, weight_decay, no_weight_decay_keywords))
    try:
        return create_optimizer_v2(model, opt=name, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                   param_group_fn=lambda _: groups, betas=tuple(betas), eps=eps, **kwargs)
    except TypeError as err:  # an argument the optimizer does not take
        raise ConfigError(f"optim.name={name}: {err} (optim.kwargs={kwargs})") from None


def _init_keywords(name: str) -> set:
    """The keyword arguments optimizer ``name``'s class takes (empty where timm cannot say)."""
    import inspect

    from timm.optim import get_optimizer_class
    try:
        return set(inspect.signature(get_optimizer_class(name.split("_")[-1])).parameters)
    except (ValueError, TypeError):
        return set()


# ---- Schedule --------------------------------------------------------------------------------
SCHEDULES = ("constant", "cosine", "tanh", "poly", "step", "multistep", "wsd")


def _steps(epochs: float, steps_per_epoch: int) -> int:
    return int(round(float(epochs) * steps_per_epoch))


def timm_schedule_args(sched: Mapping[str, Any], total_steps: int, steps_per_epoch: int) -> Dict[str, Any]:
    """``create_scheduler_v2``'s arguments for a ``sched`` config, lengths in optimizer steps (timm's epochs are steps:
    ``updates_per_epoch=1``): warm-up first (``warmup_prefix``), the cool-down last, the decay (>= 1 step) between."""
    name = sched["name"]
    if name not in SCHEDULES:
        raise ConfigError(f"sched.name={name} is unknown; available: {', '.join(SCHEDULES)}")
    warmup = _steps(sched.get("warmup_epochs", 0), steps_per_epoch) + int(sched.get("warmup_steps", 0))
    cooldown = _steps(sched.get("cooldown_epochs", 0), steps_per_epoch)
    args: Dict[str, Any] = dict(sched=name, num_epochs=max(1, total_steps - warmup - cooldown), warmup_epochs=warmup,
                                warmup_lr=float(sched.get("warmup_lr", 0.0)), min_lr=float(sched.get("min_lr", 0.0)),
                                cooldown_epochs=cooldown, warmup_prefix=True, step_on_epochs=False, updates_per_epoch=1)
    if name == "poly":
        args["decay_rate"] = float(sched["power"])  # timm's poly takes its power as decay_rate
    if name == "step":
        args.update(decay_epochs=max(1, _steps(sched["decay_epochs"], steps_per_epoch)),
                    decay_rate=float(sched["decay_rate"]))
    if name == "multistep":
        args.update(decay_milestones=[_steps(m, steps_per_epoch) for m in sched["decay_milestones"]],
                    decay_rate=float(sched["decay_rate"]))
    if name == "wsd":
        args.update(decay_epochs=float(sched["decay_fraction"]), decay_fn=sched["decay_fn"])
    return args


class Schedule:
    """timm's scheduler for ``optimizer``, stepped per optimizer step: the rate is a function of the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, sched: Mapping[str, Any], total_steps: int,
                 steps_per_epoch: int):
        from timm.scheduler import create_scheduler_v2

        self.optimizer = optimizer
        self.args = timm_schedule_args(sched, total_steps, steps_per_epoch)
        try:
            self.scheduler, _ = create_scheduler_v2(optimizer, **self.args)
        except ValueError as err:  # e.g. wsd's decay longer than the schedule
            raise ConfigError(f"sched={sched['name']}: {err}") from None

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the rates of step ``step`` (0: the first) in ``optimizer`` (the one it was built for); returns the
        head's (layer decay scales the others down from it)."""
        if optimizer is not self.optimizer:
            raise ValueError("Schedule.apply: not the optimizer this schedule was built for")
        self.scheduler.step_update(step)
        return max(group["lr"] for group in optimizer.param_groups)


def build_schedule(sched: Any, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int) -> Schedule:
    """The schedule a ``sched`` config (a dataclass of moh_vision.config, or a mapping) names."""
    fields = dict(vars(sched)) if not isinstance(sched, Mapping) else dict(sched)
    return Schedule(optimizer, fields, total_steps, steps_per_epoch)
