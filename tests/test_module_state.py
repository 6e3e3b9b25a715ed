"""Issue 13: attention modules keep no per-forward state.

A routed layer hands its auxiliary loss and routing statistics to the recorder the caller opens
(``record_routing``) and keeps nothing of a forward on itself. What must hold, on every model family and
attention, with and without gradient checkpointing:

* after a forward in a recorder no module holds a tensor besides its parameters and buffers;
* ``copy.deepcopy``, ``pickle``, ``torch.save(model)`` (also loaded in a fresh process: the composed
  attention classes resolve by name), timm's ``ModelEmaV3`` and torch's ``AveragedModel`` work after
  training steps, even in the middle of a step (a forward's loss still holding its graph);
* gradient checkpointing changes no gradient, aux loss included, and records every layer once;
* the learned-shared-heads warm-up counts optimizer steps, not forwards, micro-batches or recomputations.
"""
import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import timm
import torch
from timm.utils import ModelEmaV3
from torch.optim.swa_utils import AveragedModel

import moh_vision  # noqa: F401  (registers the models)
from moh_vision.attention import after_optimizer_step, find_attention, record_routing, routed_modules

from helpers import REPO

FAMILIES = {  # tiny members of every family
    "transnext_nano": dict(in_chans=1, img_size=32, num_classes=10),
    "plain_vit_nano": dict(img_size=16, depth=2, num_classes=10),
    "dit_tiny_2": dict(input_size=8, depth=2, num_classes=10),
}
ATTENTIONS = {"mha": {}, "moh": dict(activation_ratio=0.5), "moa": {}}
LEARNED = dict(shared_heads="learned", activation_ratio=0.5)


def make(family, attention, checkpointing=False, seed=0, **options):
    torch.manual_seed(seed)
    model = timm.create_model(family, attention=attention, **FAMILIES[family], **options)
    if checkpointing:
        if not callable(getattr(model, "set_grad_checkpointing", None)):
            pytest.skip(f"{family} has no set_grad_checkpointing yet (timm conformance work)")
        model.set_grad_checkpointing(True)
    with torch.no_grad():
        for p in model.parameters():  # DiT zero-initialises adaLN and its output layer: no gradient would
            if not p.any():           # reach the attention (nor the learned head scores)
                p.normal_(0.0, 0.02)
        for _, m in find_attention(model):  # routers off their initial values: no ties between heads or experts
            if hasattr(m, "w_gate"):
                m.w_gate.weight.normal_()
            if getattr(m, "learned_shared", False):
                m.shared_score.normal_()
    return model


def inputs(family, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    if family == "dit_tiny_2":
        return (torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 1000, (batch,), generator=g),
                torch.randint(0, 10, (batch,), generator=g))
    chans, size = (1, 32) if family == "transnext_nano" else (3, 16)
    return (torch.randn(batch, chans, size, size, generator=g),)


def forward_loss(model, family, seed, coef=0.01, batch=2):
    """A training forward in a recorder: (loss with the aux loss, the recorder)."""
    torch.manual_seed(seed)  # the same dropout / label dropout / Gumbel noise for every caller
    with record_routing(model) as routing:
        out = model(*inputs(family, batch=batch, seed=seed))
    return out.float().square().mean() + routing.aux_loss(coef=coef), routing


def train(model, family, steps=2, seed=0, batch=1):
    """``steps`` optimizer steps as the trainer takes them; returns the optimizer."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        loss, _ = forward_loss(model, family, seed + step, batch=batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        after_optimizer_step(model)
    return opt


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _tensors_in(v)


def per_forward_state(model):
    """``module.attribute`` of every tensor a module holds outside its parameters and buffers."""
    found = []
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            if next(_tensors_in(value), None) is not None:
                found.append(f"{name or '<model>'}.{key}")
    return found


def attention_attributes(model):
    return {name: set(vars(m)) for name, m in find_attention(model)}


def eval_output(model, family):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(*inputs(family, batch=1, seed=100))
    model.train(was)
    return out


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state(model, expected):
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


# ---------------------------------------------------------------------------------------------
# No per-forward state; every way of copying a model works at any point of training
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_copies_and_averages_work_after_training_steps(family, attention, checkpointing):
    model = make(family, attention, checkpointing, **ATTENTIONS[attention])
    attributes = attention_attributes(model)
    opt = train(model, family, steps=1)

    # the middle of the second step: a recorded forward whose loss still holds its graph
    loss, routing = forward_loss(model, family, seed=7, batch=1)
    routed = [name for name, _ in routed_modules(model)]
    assert bool(routed) == (attention != "mha")
    assert sorted(routing.stats()) == sorted(routed), "every routed layer recorded once"
    assert loss.requires_grad and (attention == "mha" or routing.aux_loss() > 0)
    assert per_forward_state(model) == [], "no tensor of the last forward on any module"
    assert attention_attributes(model) == attributes, "no attribute added to an attention module"

    state, reference = snapshot(model), eval_output(model, family)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model)),
              "torch.save": torch.load(buffer, weights_only=False)}
    ema = ModelEmaV3(model, decay=0.5)
    averaged = AveragedModel(model)

    # the step goes on: the copies disturbed neither the graph nor the model
    loss.backward()
    opt.step()
    after_optimizer_step(model)
    ema.update(model)
    averaged.update_parameters(model)
    after = snapshot(model)

    for how, twin in copies.items():
        assert_state(twin, state)
        assert all(a is not b for a, b in zip(twin.parameters(), model.parameters())), how
        assert per_forward_state(twin) == [], how
    twin = copies["torch.save"]  # a copy computes what the model computed, and trains recording its own layers
    torch.testing.assert_close(eval_output(twin, family), reference, rtol=0, atol=0)
    twin_loss, twin_routing = forward_loss(twin, family, seed=8, batch=1)
    twin_loss.backward()
    assert sorted(twin_routing.stats()) == sorted(routed)
    assert all(any(r.module is m for m in twin.modules()) for r in twin_routing.records)
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    assert per_forward_state(twin) == []

    for key, value in ema.module.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, 0.5 * state[key] + 0.5 * after[key], msg=key)
        else:  # integer / bool buffers (learned shared heads: shared_seen, shared_mask) are copied
            assert torch.equal(value, after[key]), key
    for key, value in averaged.module.named_parameters():  # the first update copies the parameters
        assert torch.equal(value, after[key]), key
    assert torch.isfinite(eval_output(ema.module, family)).all()
    assert per_forward_state(ema.module) == per_forward_state(averaged) == per_forward_state(model) == []


def test_torch_save_loads_in_a_fresh_process(tmp_path):
    """The composed attention classes (variant over kernel) are found by name in a process that has not
    imported moh_vision: unpickling imports their modules."""
    saved = []
    for family, attention, options in (("transnext_nano", "moh", ATTENTIONS["moh"]),
                                       ("plain_vit_nano", "moa", {}),
                                       ("dit_tiny_2", "moh", dict(LEARNED, learn_shared_steps=5))):
        model = make(family, attention, **options)
        train(model, family, steps=1)
        classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for _, m in find_attention(model)})
        saved.append({"model": model, "family": family, "inputs": inputs(family, batch=1, seed=100),
                      "expected": eval_output(model, family), "classes": classes, "routed": len(list(routed_modules(model)))})
    torch.save(saved, tmp_path / "models.pt")
    script = textwrap.dedent("""
        import sys
        import torch
        assert "moh_vision" not in sys.modules
        entries = torch.load(sys.argv[1], weights_only=False)  # imports what the pickled classes name
        from moh_vision.attention import record_routing
        for entry in entries:
            model = entry["model"].eval()
            with torch.no_grad():
                torch.testing.assert_close(model(*entry["inputs"]), entry["expected"], rtol=0, atol=0)
            model.train()
            with record_routing(model) as routing:
                out = model(*entry["inputs"])
            (out.square().mean() + routing.aux_loss()).backward()
            assert len(routing.records) == entry["routed"], entry["family"]
            for name in entry["classes"]:
                module, _, qualname = name.rpartition(".")
                assert getattr(sys.modules[module], qualname).__qualname__ == qualname, name
            print(entry["family"], "ok", *entry["classes"])
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "models.pt")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[:2] for line in lines] == [[entry["family"], "ok"] for entry in saved]
    assert any("moh__sdpa" in line for line in lines) and any("moa__sdpa" in line for line in lines)
    assert any("moh__transnext" in line for line in lines)


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing
# ---------------------------------------------------------------------------------------------
CHECKPOINT_ATTENTIONS = {"mha": {}, "moh": ATTENTIONS["moh"], "moa": {},
                         "moh-learned": dict(LEARNED, learn_shared_steps=5),
                         "moh-learned-gumbel": dict(LEARNED, learn_shared_steps=5, shared_estimator="gumbel")}


@pytest.mark.parametrize("attention", CHECKPOINT_ATTENTIONS)
@pytest.mark.parametrize("family", ["plain_vit_nano", "dit_tiny_2"])
def test_checkpointing_changes_no_gradient_and_records_once(family, attention):
    plain = make(family, attention.split("-")[0], **CHECKPOINT_ATTENTIONS[attention]).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.set_grad_checkpointing(True)
    results = []
    for model in (plain, checkpointed):
        loss, routing = forward_loss(model, family, seed=3, coef=1.0)  # aux loss at full weight
        loss.backward()
        results.append((loss.detach(), routing.aux_loss(coef=1.0).detach(), len(routing.records),
                        {n: p.grad for n, p in model.named_parameters()}))
    (loss, aux, count, grads), (loss_c, aux_c, count_c, grads_c) = results
    assert count == count_c == len(list(routed_modules(plain))), "recomputation is not recorded again"
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(aux_c, aux)
    assert attention == "mha" or aux > 0
    for name, grad in grads.items():
        assert (grad is None) == (grads_c[name] is None), name
        if grad is not None:
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if attention.startswith("moh-learned"):
        assert all(g.abs().sum() > 0 for n, g in grads_c.items() if n.endswith("shared_score")), "warm-up estimator"


def test_compiled_checkpointed_training_records_once_and_matches_eager():
    """A compiled model with gradient checkpointing traces as one graph, given dynamo's switch that skips a
    checkpointed forward's side effects when backward recomputes it (what the recorder wants: without it,
    dynamo cannot trace the recorder's append inside a checkpoint and runs those blocks eagerly). The
    recorder lookup is traced, nothing is recorded twice, and loss and gradients are eager's."""
    plain = make("dit_tiny_2", "moh", activation_ratio=0.5).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.set_grad_checkpointing(True)
    torch._dynamo.reset()
    compiled = torch.compile(checkpointed, backend="aot_eager", fullgraph=True)  # a graph break raises
    results = []
    for model, call in ((plain, plain), (checkpointed, compiled)):
        torch.manual_seed(3)
        with record_routing(model) as routing, torch._dynamo.config.patch(
                skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            out = call(*inputs("dit_tiny_2", batch=2, seed=3))
        loss = out.float().square().mean() + routing.aux_loss(coef=1.0)
        loss.backward()
        results.append((loss.detach(), len(routing.records), {n: p.grad for n, p in model.named_parameters()}))
    (loss, count, grads), (loss_c, count_c, grads_c) = results
    assert count == count_c == len(list(routed_modules(plain)))
    torch.testing.assert_close(loss_c, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_learned_warmup_counts_optimizer_steps_under_accumulation_and_checkpointing():
    family = "plain_vit_nano"
    model = make(family, "moh", checkpointing=True, **LEARNED, learn_shared_steps=3).train()
    learned = [m for _, m in routed_modules(model) if m.learned_shared]
    assert learned
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        for micro in range(2):  # grad accumulation: 2 micro-batches per optimizer step
            loss, _ = forward_loss(model, family, seed=10 * step + micro, batch=1)
            (loss / 2).backward()  # recomputes every checkpointed block's forward
            assert [int(m.shared_seen) for m in learned] == [min(step, 3)] * len(learned), (step, micro)
        opt.step()
        after_optimizer_step(model)
        opt.zero_grad(set_to_none=True)
        assert [int(m.shared_seen) for m in learned] == [min(step + 1, 3)] * len(learned)
        assert [bool(m.shared_frozen) for m in learned] == [step + 1 >= 3] * len(learned)
