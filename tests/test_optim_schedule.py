"""The optimizer and the schedule from timm's factories (issue 53): the paper recipes keep their learning rate at
every step, timm's other schedules and optimizers are one option away, layer decay follows ``group_matcher()``,
weight decay skips what it skipped before, and optimizer states saved by earlier releases still load."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from moh_vision.config import compose, validate
from moh_vision.engine.optim import build_optimizer, build_schedule, param_groups
from moh_vision.errors import ConfigError


def handwritten_lr(step, name, base_lr, total_steps, warmup_steps, warmup_lr, min_lr):
    """The learning rate the trainer computed itself up to issue 53 (``Schedule.lr`` of moh_vision/engine/optim.py at
    a4ad4f1, verbatim in substance): the oracle the timm schedule must reproduce."""
    total_steps = max(1, int(total_steps))
    if step < warmup_steps:
        return warmup_lr + (base_lr - warmup_lr) * step / warmup_steps
    if name == "constant":
        return base_lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def _one_param_optimizer(lr):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _run_lengths(cfg, steps_per_epoch):
    """(total steps, warm-up steps) as the trainer computes them (fit_setup.build_parts, and build_schedule before)."""
    total = cfg.trainer.epochs * steps_per_epoch
    if cfg.trainer.max_steps:
        total = min(total, cfg.trainer.max_steps)
    warmup = int(round(float(cfg.sched.warmup_epochs) * steps_per_epoch)) + int(cfg.sched.warmup_steps)
    return total, warmup


# (experiment overrides, optimizer steps per epoch): the default run on the digits (1438 training images, batch 64),
# the TransNeXt / MoH-ViT ImageNet recipe (1,281,167 images, global batch 1024) and the DiT recipe as dit_s_2 runs it
# (ImageNet at 256, batch 256, trainer.max_steps=400000 inside 80 epochs).
RECIPES = {"default": ([], 22), "transnext_imagenet": (["experiment=moh_transnext_small_75"], 1281167 // 1024),
           "dit_imagenet": (["experiment=dit_s_2"], 5004)}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_recipes_keep_their_learning_rate_at_every_step(recipe):
    overrides, steps_per_epoch = RECIPES[recipe]
    cfg = compose("train", overrides)
    total, warmup = _run_lengths(cfg, steps_per_epoch)
    sched = OmegaConf.to_container(cfg.sched)
    optimizer = _one_param_optimizer(cfg.optim.lr)
    schedule = build_schedule(sched, optimizer, total, steps_per_epoch)
    worst = 0.0
    # the warm-up and 1000 steps after it, every 37th step on, the last 1000 and past the end (every step of all
    # three recipes agreed within the same bound once; ~30 s, too long for the suite)
    dense = set(range(warmup + 1000)) | set(range(0, total, 37)) | set(range(max(0, total - 1000), total + 3))
    for step in sorted(dense):
        expected = handwritten_lr(step, sched["name"], cfg.optim.lr, total, warmup, sched["warmup_lr"],
                                  sched.get("min_lr", 0.0))
        got = schedule.apply(optimizer, step)
        assert got == optimizer.param_groups[0]["lr"]
        worst = max(worst, abs(got - expected) / expected)
    # timm computes the same formulas with other operation orders (the warm-up's slope first, pi x t / T for the cosine):
    # they differ in the last bits only
    print(f"{recipe}: largest relative difference {worst:.2e}")
    assert worst <= 1e-12, worst
    if sched["name"] == "constant":
        assert worst == 0.0
    assert {"default": (330, 44), "transnext_imagenet": (375300, 6255), "dit_imagenet": (400000, 0)}[recipe] == \
        (total, warmup)


@pytest.mark.parametrize("sched, total, steps_per_epoch", [
    ({"name": "cosine", "warmup_epochs": 0.5, "warmup_steps": 3, "warmup_lr": 1e-4, "min_lr": 0.0}, 57, 10),
    ({"name": "cosine", "warmup_epochs": 2, "warmup_steps": 0, "warmup_lr": 1e-6, "min_lr": 1e-5}, 3, 22),  # all warm-up
    ({"name": "constant", "warmup_epochs": 1, "warmup_steps": 2, "warmup_lr": 0.0}, 40, 7),
])
def test_warmup_semantics_match_the_handwritten_schedule(sched, total, steps_per_epoch):
    optimizer = _one_param_optimizer(2e-3)
    schedule = build_schedule(sched, optimizer, total, steps_per_epoch)
    warmup = int(round(sched["warmup_epochs"] * steps_per_epoch)) + sched["warmup_steps"]
    for step in range(total + 2):
        expected = handwritten_lr(step, sched["name"], 2e-3, total, warmup, sched["warmup_lr"], sched.get("min_lr", 0))
        assert schedule.apply(optimizer, step) == pytest.approx(expected, rel=1e-12, abs=1e-18), step


def _lrs(sched, total=100, steps_per_epoch=10, lr=1.0):
    optimizer = _one_param_optimizer(lr)
    schedule = build_schedule(sched, optimizer, total, steps_per_epoch)
    return [schedule.apply(optimizer, step) for step in range(total)]


def test_timms_other_schedules_count_in_steps_after_the_warmup():
    warm = {"warmup_epochs": 1, "warmup_steps": 0, "warmup_lr": 0.0}
    cooled = _lrs({"name": "cosine", **warm, "min_lr": 0.01, "cooldown_epochs": 2})
    assert cooled[:10] == pytest.approx([s / 10 for s in range(10)]) and cooled[10] == 1.0
    assert cooled[80:] == [0.01] * 20 and cooled[79] > 0.01  # the decay spans steps 10-79, then the cool-down
    step = _lrs({"name": "step", **warm, "decay_epochs": 3, "decay_rate": 0.5})
    assert step[10:40] == [1.0] * 30 and step[40:70] == [0.5] * 30 and step[70] == step[99] == 0.25
    multi = _lrs({"name": "multistep", **warm, "decay_milestones": [2, 5], "decay_rate": 0.1})
    # timm's convention: a milestone applies from the step before it (steps 20 and 50 after the warm-up: 29 and 59)
    assert multi[28] == 1.0 and multi[29] == multi[58] == pytest.approx(0.1) and multi[59] == pytest.approx(0.01)
    poly = _lrs({"name": "poly", **warm, "min_lr": 0.0, "cooldown_epochs": 0, "power": 1.0})
    assert poly[10:100:30] == pytest.approx([1.0, 1 - 30 / 90, 1 - 60 / 90])  # linear to 0 over the 90 steps left
    wsd = _lrs({"name": "wsd", **warm, "min_lr": 0.0, "cooldown_epochs": 0, "decay_fraction": 0.5, "decay_fn": "linear"})
    assert wsd[10:55] == [1.0] * 45 and 0 < wsd[80] < wsd[60] < 1.0  # stable for half the 90 steps, then decaying
    tanh = _lrs({"name": "tanh", **warm, "min_lr": 0.0, "cooldown_epochs": 0})
    assert tanh[10] == pytest.approx(1.0, rel=1e-3) and tanh[99] < 0.05


@pytest.mark.parametrize("group", ["sched=step", "sched=multistep", "sched=poly", "sched=wsd", "sched=tanh",
                                   "optim=sgd", "optim=lamb", "optim.name=lion", "optim.layer_decay=0.75"])
def test_every_option_composes_validates_and_trains_a_step(group):
    import timm

    run = validate(compose("train", [group, "model=plain_vit_nano"]))
    model = timm.create_model("plain_vit_nano", num_classes=10)
    optimizer = build_optimizer(model, **vars(run.optim))
    schedule = build_schedule(run.sched, optimizer, total_steps=50, steps_per_epoch=10)
    assert schedule.apply(optimizer, 20) > 0
    model(torch.randn(2, 3, 32, 32)).square().mean().backward()
    optimizer.step()


def test_bad_optimizer_options_are_one_line():
    with pytest.raises(ConfigError, match=r"optim.name=adamx is unknown; timm's optimizers .*adamw"):
        validate(compose("train", ["optim.name=adamx"]))
    with pytest.raises(ConfigError, match=r"optim.layer_decay=1.5: must be above 0 and at most 1"):
        validate(compose("train", ["optim.layer_decay=1.5"]))
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ConfigError, match=r"optim.name=sgd: .*unexpected keyword.*bogus"):
        build_optimizer(model, name="sgd", kwargs={"bogus": 1})


def test_weight_decay_skips_what_it_skipped_before_with_and_without_layer_decay():
    import timm

    model = timm.create_model("transnext_nano", num_classes=10)
    named = dict(model.named_parameters())
    undecayed = {n for n, p in named.items() if p.ndim <= 1 or n.endswith(".bias") or n in model.no_weight_decay()
                 or "mlp.fc1" in n}
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.05, no_weight_decay_keywords=["mlp.fc1"])
    names = {id(p): n for n, p in named.items()}
    decay, no_decay = optimizer.param_groups  # decayed first: the layout earlier releases saved
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} == undecayed
    assert {names[id(p)] for p in decay["params"]} == set(named) - undecayed

    layered = build_optimizer(model, lr=1e-3, weight_decay=0.05, layer_decay=0.5, no_weight_decay_keywords=["mlp.fc1"])
    assert {names[id(p)] for g in layered.param_groups if g["weight_decay"] == 0 for p in g["params"]} == undecayed
    schedule = build_schedule({"name": "constant", "warmup_epochs": 0, "warmup_steps": 0, "warmup_lr": 0.0},
                              layered, total_steps=10, steps_per_epoch=10)
    assert schedule.apply(layered, 3) == pytest.approx(1e-3)  # the head's rate
    by_name = {names[id(p)]: g["lr"] for g in layered.param_groups for p in g["params"]}
    layers = max(round(math.log(1e-3 / lr, 2)) for lr in by_name.values())
    assert by_name["head.weight"] == pytest.approx(1e-3) and layers >= 5
    assert by_name["patch_embed1.proj.weight"] == pytest.approx(1e-3 * 0.5 ** layers)


def test_an_optimizer_state_of_an_earlier_release_loads():
    """Earlier releases saved torch's AdamW over :func:`param_groups`' two groups: the state loads into timm's."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("plain_vit_nano", num_classes=10)
    old = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3)
    model(torch.randn(2, 3, 32, 32)).square().mean().backward()
    old.step()
    new = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    new.load_state_dict(old.state_dict())
    assert type(new) is torch.optim.AdamW
    for p in model.parameters():
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])


def test_a_run_saved_before_these_options_resumes_without_extend():
    """A checkpoint of an earlier release holds no optim.momentum / layer_decay / kwargs nor sched.cooldown_epochs:
    their defaults train as it did, so resuming it is no change; setting one is."""
    from moh_vision.checkpoints import config_changes

    current = OmegaConf.to_container(compose("train", []), resolve=True)
    saved = OmegaConf.to_container(compose("train", []), resolve=True)
    for group, key in (("optim", "momentum"), ("optim", "layer_decay"), ("optim", "kwargs"), ("sched", "cooldown_epochs")):
        del saved[group][key]
    assert config_changes(saved, current) == []
    layered = OmegaConf.to_container(compose("train", ["optim.layer_decay=0.75", "+optim.kwargs.amsgrad=true"]))
    assert config_changes(saved, layered) == ["optim.kwargs.amsgrad: null -> true", "optim.layer_decay: null -> 0.75"]
