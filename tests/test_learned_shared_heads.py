"""Learned shared heads (``attention.shared_heads=learned``): which heads a MoH layer shares is learned
during a warm-up, then frozen.

What must hold: the head budget is the activation-ratio policy's, exactly, for every token, during
warm-up and after; the straight-through estimator carries a gradient to the head scores (and learns
the head the output needs) until the partition freezes, which then survives further training and a
state-dict round trip; a frozen layer IS an official MoH layer with its heads permuted so the learned
shared heads come first; statistics, the routing meter, the plots and a real training run report the
learned heads.
"""
import csv
import json
import math

import pytest
import timm
import torch
from torch import nn

import moh_vision  # noqa: F401  (registers the models)
from moh_vision.analysis import routing_plots
from moh_vision.analysis.routing_stats import RoutingMeter, routed_heads_of, routed_loads_of
from moh_vision.attention import build_attention, record_routing, routed_modules
from moh_vision.attention.routing import resolve_moh_heads
from moh_vision.errors import ConfigError
from moh_vision.ops import merge_heads

from helpers import FAST_TRAIN, load_tool

ROUTERS = ("wg", "wg_0", "wg_1")


def learned_layer(dim=32, heads=8, ratio=0.5, steps=3, estimator="ste", seed=0, **opts):
    """A learned-shared-heads MoH layer with random routers, biases and head scores."""
    torch.manual_seed(seed)
    m = build_attention("moh", dim, heads, shared_heads="learned", activation_ratio=ratio, learn_shared_steps=steps,
                        shared_estimator=estimator, **opts)
    with torch.no_grad():
        for name in ROUTERS:
            if hasattr(m, name):
                getattr(m, name).weight.normal_()
        m.qkv.bias.normal_(0, 0.1)
        m.proj.bias.normal_(0, 0.1)
        m.shared_score.normal_()
    return m


def freeze_on(m, scores):
    """Freeze ``m`` (learn_shared_steps=1) on ``top-h_s(scores)``: one training forward, one optimizer step."""
    assert m.learn_shared_steps == 1
    with torch.no_grad():
        m.shared_score.copy_(scores)
    m.train()(torch.randn(1, 3, m.dim))
    assert not bool(m.shared_frozen), "a forward changes no buffer"
    m.after_optimizer_step()
    assert bool(m.shared_frozen)
    return m.shared_mask.clone()


def partition_order(mask):
    """Shared heads first, then routed heads, each ascending."""
    shared = [i for i, s in enumerate(mask.tolist()) if s]
    return torch.tensor(shared + [i for i, s in enumerate(mask.tolist()) if not s])


# ---------------------------------------------------------------------------------------------
# The head budget
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,ratio", [(4, 0.5), (8, 0.75), (6, 0.84), (12, 0.5)])
@pytest.mark.parametrize("estimator", ["ste", "gumbel"])
def test_every_token_uses_exactly_the_policys_heads_in_warmup_and_after(heads, ratio, estimator):
    m = learned_layer(dim=24, heads=heads, ratio=ratio, steps=3, estimator=estimator)
    h_s, k = resolve_moh_heads(heads, activation_ratio=ratio)
    assert (m.shared_heads, m.topk) == (h_s, k) and m.learned_shared and m.active_heads() == h_s + k
    x = torch.randn(2, 9, 24)
    masks = []
    steps_taken = 0
    for step in range(6):  # 3 warm-up steps (new random scores each time), then frozen
        with torch.no_grad():
            m.shared_score.normal_()
        for train in (True, False):
            m.train(train)
            buffers = {n: b.clone() for n, b in m.named_buffers()}
            with record_routing(m, keep_selection=True) as routing:
                m(x)
            assert all(torch.equal(b, buffers[n]) for n, b in m.named_buffers()), "a forward changes no buffer"
            (record,) = routing.records
            stats, selection = record.stats, record.selection  # selection: [B, N, h]
            mask = stats["shared_mask"]
            assert mask.dtype == torch.bool and int(mask.sum()) == h_s
            assert (selection.sum(-1) == h_s + k).all(), "every token uses exactly h_s + k heads"
            assert selection[..., mask].all(), "every token uses every shared head"
            assert (selection[..., ~mask].sum(-1) == k).all(), "and exactly top-k of the others"
            assert stats["load"].sum().item() == pytest.approx(h_s + k)
            assert (stats["load"][mask] == 1.0).all()
            assert bool(stats["shared_frozen"]) == (steps_taken >= 3)  # after the 3rd optimizer step
            if train:
                masks.append(mask)
                m.after_optimizer_step()  # the trainer calls it once per optimizer step taken
                steps_taken += 1
                assert int(m.shared_seen) == min(steps_taken, 3)
                if steps_taken <= 3:  # each warm-up step puts the noise-free top-h_s of the scores in force
                    clean = torch.zeros(heads, dtype=torch.bool)
                    clean[m.shared_score.detach().topk(h_s).indices] = True
                    assert torch.equal(m.shared_mask, clean)
    assert all(torch.equal(mask, m.shared_mask) for mask in masks[3:]), "frozen after 3 optimizer steps"
    if estimator == "ste":  # Gumbel: the 3rd forward used a noisy sample; the noise-free choice is frozen
        assert torch.equal(masks[2], m.shared_mask)


# ---------------------------------------------------------------------------------------------
# The estimator
# ---------------------------------------------------------------------------------------------
def test_straight_through_gradient_is_the_documented_estimator():
    """d score = J_softmax^T (h_s * sum over tokens of dL/dg_i * (G_shared_i - G_routed_i))."""
    m = learned_layer(dim=24, heads=6, ratio=0.67, steps=5).train()  # 4 active: 2 shared + top-2 of 4
    h_s = m.shared_heads
    assert (h_s, m.topk) == (2, 2)
    x = torch.randn(2, 7, 24)
    weight = torch.randn(2, 7, 6)
    with record_routing(m) as routing:
        gates = m.route(x).gates
    (gates * weight).sum().backward()
    mask = routing.records[0].stats["shared_mask"]
    with torch.no_grad():
        u = x @ m.wg_1.weight.T
        a1 = 2 * torch.softmax(x @ m.wg_0.weight.T, dim=-1)[..., :1]
        as_shared = a1 * h_s * torch.exp(u) / (torch.exp(u) + torch.exp(u[..., mask]).sum(-1, keepdim=True))
        delta = torch.where(mask, gates, as_shared - gates)
        c = (weight * delta).sum(dim=(0, 1))
        p = torch.softmax(m.shared_score, dim=0)
        expected = h_s * p * (c - (p * c).sum())
    torch.testing.assert_close(m.shared_score.grad, expected, rtol=1e-4, atol=1e-6)
    assert m.shared_score.grad.abs().sum() > 0


@pytest.mark.parametrize("estimator", ["ste", "gumbel"])
@pytest.mark.parametrize("good", [1, 3])
def test_warmup_learns_the_head_the_output_needs(estimator, good):
    """Only head ``good`` reaches the output and the target is that head at gate 1 for every token:
    sharing it is the only exact solution. Training the scores alone must find it (the partition
    starts at head 0) and freeze it."""
    torch.manual_seed(0)
    m = build_attention("moh", 32, 4, shared_heads="learned", activation_ratio=0.5, learn_shared_steps=20,
                        shared_estimator=estimator)
    assert (m.shared_heads, m.topk) == (1, 1) and m.shared_mask.tolist() == [True, False, False, False]
    d = m.head_dim
    with torch.no_grad():
        keep = torch.zeros(32)
        keep[good * d:(good + 1) * d] = 1
        m.proj.weight.mul_(keep)
        m.wg_0.weight.zero_()  # equal mix: a shared and a selected routed head both get gate 1
        m.wg.weight.normal_()
    x = torch.randn(4, 16, 32)
    with torch.no_grad():
        target = m.proj(merge_heads(m.heads(x), torch.ones(4, 16, 4)))
    m.requires_grad_(False)
    m.shared_score.requires_grad_(True)
    opt = torch.optim.Adam([m.shared_score], lr=0.05)
    m.train()
    for _ in range(25):
        loss = (m(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        m.after_optimizer_step()
    assert bool(m.shared_frozen) and int(m.shared_seen) == 20
    assert m.shared_mask.tolist() == [i == good for i in range(4)]
    assert loss.item() < 1e-10


def test_gradient_reaches_scores_only_during_warmup_and_mask_survives_state_dict():
    m = learned_layer(heads=8, ratio=0.5, steps=3)
    x = torch.randn(2, 10, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    frozen_mask = None
    for step in range(7):
        m.train()
        with record_routing(m) as routing:
            y = m(x)
        loss = y.square().mean() + routing.aux_loss()
        opt.zero_grad()
        loss.backward()
        grad = m.shared_score.grad
        assert grad is not None and torch.isfinite(grad).all(), "the scores stay in the graph (DDP)"
        if step < 3:
            assert grad.abs().sum() > 0, "straight-through: the scores learn during warm-up"
        else:
            assert grad.abs().sum() == 0, "frozen: the scores no longer matter"
        opt.step()
        m.after_optimizer_step()
        with torch.no_grad():  # shake the scores: the frozen partition must not follow
            m.shared_score.mul_(-3.0).add_(torch.randn(8))
        if step == 2:
            frozen_mask = m.shared_mask.clone()
        if step >= 2:
            assert bool(m.shared_frozen) and torch.equal(m.shared_mask, frozen_mask)
    assert int(m.shared_seen) == 3

    # the frozen mask, not the scores, is what a fresh module loads and uses
    state = m.state_dict()
    assert {"shared_mask", "shared_seen", "shared_frozen", "shared_score"} <= set(state)
    fresh = build_attention("moh", 32, 8, shared_heads="learned", activation_ratio=0.5, learn_shared_steps=3)
    assert not bool(fresh.shared_frozen) and fresh.shared_mask.tolist() == [True, True] + [False] * 6
    fresh.load_state_dict(state)
    assert bool(fresh.shared_frozen) and torch.equal(fresh.shared_mask, frozen_mask)
    m.eval(), fresh.eval()
    with record_routing(fresh) as routing:
        y_fresh = fresh(x)
    torch.testing.assert_close(y_fresh, m(x))
    assert torch.equal(routing.records[0].stats["shared_mask"], frozen_mask)


def test_zero_warmup_freezes_the_official_first_heads_at_once():
    m = build_attention("moh", 32, 8, shared_heads="learned", activation_ratio=0.75, learn_shared_steps=0)
    assert bool(m.shared_frozen) and m.shared_mask.tolist() == [True] * 3 + [False] * 5
    with torch.no_grad():
        m.shared_score.normal_()
    m.train()(torch.randn(1, 4, 32))
    m.after_optimizer_step()
    assert m.shared_mask.tolist() == [True] * 3 + [False] * 5 and int(m.shared_seen) == 0


# ---------------------------------------------------------------------------------------------
# A frozen learned layer is a permuted official layer
# ---------------------------------------------------------------------------------------------
def permuted_official(m, mask):
    """An official MoH layer whose head j is head ``order[j]`` of ``m`` (shared heads first)."""
    order = partition_order(mask)
    h_s, k, d, inner = m.shared_heads, m.topk, m.head_dim, m.inner_dim
    ref = build_attention("moh", m.dim, m.num_heads, shared_heads=h_s, topk=k)
    rows = (order[:, None] * d + torch.arange(d)).reshape(-1)
    qkv_rows = torch.cat([rows + part * inner for part in range(3)])
    with torch.no_grad():
        ref.qkv.weight.copy_(m.qkv.weight[qkv_rows])
        ref.qkv.bias.copy_(m.qkv.bias[qkv_rows])
        ref.proj.weight.copy_(m.proj.weight[:, rows])
        ref.proj.bias.copy_(m.proj.bias)
        ref.wg.weight.copy_(m.wg.weight[order[h_s:]])
        ref.wg_0.weight.copy_(m.wg_0.weight)
        if h_s > 1:
            ref.wg_1.weight.copy_(m.wg_1.weight[order[:h_s]])
    return ref, order, qkv_rows, rows


@pytest.mark.parametrize("heads,ratio", [(8, 0.5), (4, 0.75), (6, 0.84)])  # h_s = 2, 1, 2
def test_frozen_layer_equals_official_layer_with_permuted_heads(heads, ratio):
    m = learned_layer(dim=24, heads=heads, ratio=ratio, steps=1)
    mask = freeze_on(m, torch.randperm(heads, generator=torch.Generator().manual_seed(heads)).float())
    assert mask.tolist()[:m.shared_heads] != [True] * m.shared_heads  # not the official choice
    with torch.no_grad():
        m.shared_score.normal_()  # irrelevant once frozen
    ref, order, qkv_rows, rows = permuted_official(m, mask)
    x = torch.randn(2, 11, 24)
    grad_out = torch.randn(2, 11, 24)
    results = []
    for layer in (m, ref):
        layer.train()
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with record_routing(layer) as routing:
            y = layer(xi)
        ((y * grad_out).sum() + routing.aux_loss(coef=1.0)).backward()
        (record,) = routing.records
        route = layer.route(x)
        results.append((y.detach(), xi.grad, record.aux_loss.detach(), route.gates.detach(), route.index, record.stats))
    (y, gx, aux, gates, index, stats), (y_ref, gx_ref, aux_ref, gates_ref, index_ref, stats_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, aux_ref)
    torch.testing.assert_close(gates[..., order], gates_ref)
    assert torch.equal(index, index_ref)
    assert torch.equal(stats["load"][order], stats_ref["load"])
    torch.testing.assert_close(stats["entropy"], stats_ref["entropy"])
    # parameter gradients are the official ones, permuted back (router rows of the other set: zero)
    torch.testing.assert_close(m.qkv.weight.grad[qkv_rows], ref.qkv.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.proj.weight.grad[:, rows], ref.proj.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.wg.weight.grad[order[m.shared_heads:]], ref.wg.weight.grad, rtol=1e-4, atol=1e-6)
    assert (m.wg.weight.grad[order[:m.shared_heads]] == 0).all()
    assert (m.shared_score.grad == 0).all()


# ---------------------------------------------------------------------------------------------
# Where learning applies, and bad options
# ---------------------------------------------------------------------------------------------
def test_layers_without_both_sets_stay_standard():
    dense = build_attention("moh", 32, 2, shared_heads="learned", activation_ratio=0.75)  # a == h: dense-weighted
    assert (dense.shared_heads, dense.topk) == (2, 0) and not dense.learned_shared
    assert not hasattr(dense, "shared_score") and "shared_mask" not in dense.state_dict()
    routed_only = build_attention("moh", 32, 2, shared_heads="learned", activation_ratio=0.5)  # a = 1: h_s = 0
    assert (routed_only.shared_heads, routed_only.topk) == (0, 1) and not routed_only.learned_shared
    assert routed_only.wg.out_features == 2 and not hasattr(routed_only, "shared_score")
    with record_routing(routed_only) as routing:
        routed_only(torch.randn(1, 3, 32))
    assert "shared_mask" not in routing.records[0].stats

    # transnext_nano (heads 1/2/4/8): stages 3 and 4 learn, at 0.75 and at 0.5
    for ratio, expected in ((0.75, {"block3.0.attn": (1, 2), "block3.1.attn": (1, 2), "block4.0.attn": (3, 3)}),
                            (0.5, {"block3.0.attn": (1, 1), "block3.1.attn": (1, 1), "block4.0.attn": (2, 2)})):
        model = timm.create_model("transnext_nano", attention="moh", shared_heads="learned", activation_ratio=ratio,
                                  in_chans=1, learn_shared_steps=2)
        learned = {n: (m.shared_heads, m.topk) for n, m in routed_modules(model) if m.learned_shared}
        assert learned == expected
        model.train()
        model(torch.randn(2, 1, 32, 32)).sum().backward()
        assert all(m.shared_score.grad is not None for n, m in routed_modules(model) if n in learned)


@pytest.mark.parametrize("opts,fragment", [
    (dict(shared_heads="learnt"), "shared_heads='learnt' is unknown"),
    (dict(shared_heads="learned", topk=2), "drop topk=2"),
    (dict(shared_heads="learned", learn_shared_steps=-1), "learn_shared_steps=-1"),
    (dict(shared_heads="learned", shared_estimator="softmax"), "shared_estimator 'softmax' is unknown"),
])
def test_bad_learned_options_are_one_line_config_errors(opts, fragment):
    with pytest.raises(ConfigError) as err:
        build_attention("moh", 32, 8, **opts)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Statistics, the routing meter and the plots
# ---------------------------------------------------------------------------------------------
def fake_stats(load, mask, frozen=True, topk=1):
    """One layer's ``RoutingRecorder.stats()`` entry with a learned partition."""
    return {"load": torch.tensor(load), "entropy": torch.tensor(0.5), "num_heads": len(load),
            "shared_heads": sum(mask), "topk": topk, "active_heads": sum(mask) + topk,
            "shared_mask": torch.tensor(mask), "shared_frozen": torch.tensor(frozen)}


def test_meter_treats_the_learned_heads_as_shared(tmp_path):
    # heads 1 and 3 shared; routed head 0 collapsed, routed head 4 starved, head 2 fine
    stats = {"learned": fake_stats([0.97, 1.0, 0.03, 1.0, 0.0], [False, True, False, True, False])}
    meter = RoutingMeter()
    meter.update(stats)
    warnings = meter.health_warnings()
    assert any("routed head 0 took 97.0%" in w for w in warnings)
    assert any("routed head 4 was never chosen" in w for w in warnings)
    assert not any("head 1 " in w or "head 3 " in w for w in warnings), "shared heads (load 1) are not collapse"
    row = meter.summary()
    assert row["routing/learned/shared_heads_learned"] == "1,3" and row["routing/learned/shared_frozen"] == 1.0
    assert row["routing/learned/max_load"] == pytest.approx(0.97) and row["routing/learned/min_load"] == 0.0
    avg = meter.averages()["learned"]
    assert avg["shared_mask"] == [False, True, False, True, False] and routed_heads_of(avg) == [0, 2, 4]

    # the partition moves mid-epoch: routed loads average only the forwards in which a head was routed
    stats["learned"].update(load=torch.tensor([1.0, 0.5, 0.5, 1.0, 0.0]),
                            shared_mask=torch.tensor([True, False, False, True, False]))
    meter.update(stats)
    avg = meter.averages()["learned"]
    assert avg["shared_mask"] == [True, False, False, True, False]
    assert avg["shared_frac"] == [0.5, 0.5, 0.0, 1.0, 0.0]
    assert avg["routed_load"] == pytest.approx([0.97, 0.5, 0.265, None, 0.0])
    assert routed_loads_of(avg) == pytest.approx([0.5, 0.265, 0.0])  # heads 1, 2, 4
    assert meter.summary()["routing/learned/shared_heads_learned"] == "0,3"

    meter.dump(tmp_path / "routing.json", epoch=0)
    saved = json.loads((tmp_path / "routing.json").read_text())["0"]["learned"]
    assert saved["shared_mask"] == [True, False, False, True, False] and saved["shared_frozen"] is True
    # the meter state (saved in checkpoints for mid-epoch resumes) round-trips
    again = RoutingMeter()
    again.load_state_dict(meter.state_dict())
    assert again.averages() == meter.averages()


def test_real_layer_stats_and_plots(tmp_path):
    m = learned_layer(dim=24, heads=6, ratio=0.67, steps=1)
    mask = freeze_on(m, torch.tensor([0.0, 3.0, 0.0, 2.0, 0.0, 0.0]))
    assert mask.tolist() == [False, True, False, True, False, False]
    model = nn.ModuleDict({"fixed": build_attention("moh", 24, 6, activation_ratio=0.67), "learned": m})
    x = torch.randn(2, 9, 24)
    with record_routing(model) as routing:
        for layer in model.values():
            layer.train()(x)
    stats = routing.stats()
    assert set(stats) == {"fixed", "learned"}
    assert torch.equal(stats["learned"]["shared_mask"], mask) and bool(stats["learned"]["shared_frozen"])
    assert "shared_mask" not in stats["fixed"]
    meter = RoutingMeter()
    meter.update(stats)
    epoch = meter.averages()
    by_epoch = {"0": epoch, "1": epoch}
    assert routing_plots.has_learned_shared_heads(epoch) and routing_plots.has_learned_shared_heads(by_epoch)
    assert not routing_plots.has_learned_shared_heads({"fixed": epoch["fixed"]})
    for stats_in, name in ((epoch, "one.png"), (by_epoch, "by_epoch.png")):
        assert routing_plots.plot_shared_heads(stats_in, tmp_path / name).stat().st_size > 1000
    assert routing_plots.plot_head_load(epoch, tmp_path / "load.png").is_file()
    assert routing_plots.plot_head_utility(epoch, tmp_path / "util.png").is_file()
    ranking = routing_plots.utility_ranking(epoch["learned"])
    assert sorted(r["head"] for r in ranking) == [0, 2, 4, 5]
    with record_routing(m, keep_selection=True) as routing:
        m(torch.randn(1, 4, 24))
    (record,) = routing.records
    layer = {"name": "learned", "grid": (2, 2), "shared_heads": 2, "shared_mask": mask.tolist(),
             "selection": record.selection[0].numpy(), "gates": record.gates[0].numpy()}
    assert routing_plots.plot_token_heads(None, [layer], tmp_path / "tokens.png").is_file()


# ---------------------------------------------------------------------------------------------
# A real run: train.py attention.shared_heads=learned, then tools/analyze_routing.py
# ---------------------------------------------------------------------------------------------
def test_train_run_logs_and_plots_the_learned_heads(tmp_path, train_in_process):
    assert train_in_process(*FAST_TRAIN, "attention.shared_heads=learned", "attention.learn_shared_steps=2",
                            f"hydra.run.dir={tmp_path}")[0] == 0
    learned_layers = ("block3.0.attn", "block3.1.attn", "block4.0.attn")  # transnext_nano at 0.75
    epoch = json.loads((tmp_path / "routing.json").read_text())["0"]
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    for name in learned_layers:
        layer = epoch[name]
        assert layer["shared_frozen"] is True and sum(layer["shared_mask"]) == layer["shared_heads"]
        assert state[f"{name}.shared_mask"].tolist() == layer["shared_mask"] and bool(state[f"{name}.shared_frozen"])
        assert int(state[f"{name}.shared_seen"]) == 2
        chosen = ",".join(str(i) for i, s in enumerate(layer["shared_mask"]) if s)
        assert rows[-1][f"routing/{name}/shared_heads_learned"] == chosen
        assert sum(layer["load"]) == pytest.approx(layer["shared_heads"] + layer["topk"], abs=1e-4)
    assert "shared_mask" not in epoch["block1.0.attn"] and "shared_mask" not in epoch["block2.0.attn"]
    assert (tmp_path / "routing_shared_heads.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text())["gflops"] > 0, "fvcore traces learned layers"

    out = tmp_path / "analysis"
    result = load_tool("analyze_routing").main([f"ckpt={tmp_path / 'checkpoints' / 'last.pt'}", "num_images=4",
                                                "map_images=1", "batch_size=4", f"out={out}", "logger=none"])
    assert result["files"]["shared_heads"] == "shared_heads.png" and (out / "shared_heads.png").is_file()
    for name in learned_layers:
        layer = result["layers"][name]
        assert layer["shared_mask"] == epoch[name]["shared_mask"]
        assert all(layer["load"][i] == 1.0 for i, s in enumerate(layer["shared_mask"]) if s)
        assert sorted(u["head"] for u in layer["utility"]) == routed_heads_of(layer)
    assert math.isfinite(result["layers"]["block4.0.attn"]["entropy"])
