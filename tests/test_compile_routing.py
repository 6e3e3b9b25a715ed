"""Issue 31: routed layers cost the host little, and compile to one graph with the recorder open.

* ``torch.compile`` captures a MoH model whole in eval and in training with a recorder open (``fullgraph``:
  a break raises), records every routed layer with its aux loss, and three training steps with a fresh
  recorder each compile once (the compiled code reads the recorder from a plain slot, not a ContextVar);
* a recorder adds no statistics work to the forward: the forward hands over tensors it made, and the
  statistics are computed when read;
* ``benchmarks/bench_models.py ops=true`` reports the operators each call dispatches, dense against MoH.
"""
import json

import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

import moh_vision  # noqa: F401  (registers the models)
from op_count import count_ops
from moh_vision.attention import build_attention, record_routing, routed_modules

from helpers import load_benchmark
from test_module_state import inputs, make


def test_compiled_training_steps_with_fresh_recorders_compile_once_and_record_every_layer():
    model = make("dit_tiny_2", "moh", activation_ratio=0.5).train()
    eager = [m for _, m in routed_modules(model)]
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break raises
    losses = []
    for step in range(3):
        with record_routing(model) as routing:
            out = compiled(*inputs("dit_tiny_2", seed=step))
        assert [r.module for r in routing.records] == eager, "every routed layer, once, in order"
        assert all(r.aux_loss is not None and r.aux_loss.requires_grad for r in routing.records)
        loss = out.float().square().mean() + routing.aux_loss()
        loss.backward()
        losses.append(routing.aux_loss().detach())
        with record_routing(model) as reference:  # eager, same weights and input
            model(*inputs("dit_tiny_2", seed=step))
        torch.testing.assert_close(losses[-1], reference.aux_loss().detach())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    model.eval()
    with torch.no_grad():  # eval, no recorder: one more graph, no break
        compiled(*inputs("dit_tiny_2"))
    assert counters["stats"]["unique_graphs"] == 2
    dynamo.reset()


def test_a_recorder_adds_no_statistics_work_to_the_forward():
    """The forward hands the recorder tensors it made (a detach each); load and entropy are computed
    when ``stats()`` is read, from those tensors, with the values they always had."""
    torch.manual_seed(0)
    layer = build_attention("moh", 64, 8, activation_ratio=0.5).eval()
    for router in ("wg", "wg_0", "wg_1"):
        getattr(layer, router).weight.data.normal_()
    x = torch.randn(2, 10, 64)

    def forward(recorder):
        with torch.no_grad():
            if recorder is None:
                return layer(x)
            with recorder:
                return layer(x)

    forward(None)
    closed = count_ops(lambda: forward(None))
    routing = record_routing(layer)
    opened = count_ops(lambda: forward(routing))
    assert opened - closed <= 3, (closed, opened)
    stats = routing.stats()[next(iter(routing.stats()))]
    load = stats["load"]
    assert load.shape == (8,) and torch.allclose(load[:2], torch.ones(2))  # the shared heads: every token
    assert abs(float(load.sum()) - layer.active_heads()) < 1e-5
    assert 0 < float(stats["entropy"]) <= float(torch.log(torch.tensor(6.0))) + 1e-6


def test_bench_models_counts_operators_dense_against_moh(tmp_path, monkeypatch):
    import op_count

    monkeypatch.setattr(op_count, "LAYER_SHAPES", ((64, 4),))
    monkeypatch.setattr(op_count, "LAYER_TOKENS", (2, 16))
    real_host_us = op_count.host_us
    timed = real_host_us({"dense": build_attention("mha", 32, 4), "moh": build_attention("moh", 32, 4)},
                         torch.randn(1, 4, 32), True, calls=2, rounds=3)  # interleaved rounds, both layers
    assert sorted(timed) == ["dense", "moh", "ratio"] and min(timed.values()) > 0
    monkeypatch.setattr(op_count, "host_us", lambda layers, x, train, **kw: {"dense": 1.0, "moh": 3.0, "ratio": 2.5})
    out = tmp_path / "ops.md"
    rows = load_benchmark("bench_models").main(["ops=true", "pairs=dit_tiny_2:dit_tiny_2", "attention=moh",
                                                "attention.activation_ratio=0.5", f"out={out}"])
    by = {r["figure"]: r for r in rows}
    layer = by["one attention layer, dim 64 / 4 heads, infer ops"]
    assert 0 < layer["dense"] < layer["moh"]
    model_train = by["dit_tiny_2 vs dit_tiny_2, train ops"]
    assert model_train["dense"] < model_train["moh"]
    for mode in ("eval", "train"):  # one graph, no break, dense and MoH alike
        assert by[f"dit_tiny_2 vs dit_tiny_2, torch.compile {mode} graphs"]["moh"] == 1
        assert by[f"dit_tiny_2 vs dit_tiny_2, torch.compile {mode} breaks"]["moh"] == 0
    assert by["dit_tiny_2 vs dit_tiny_2, torch.compile train graphs 3 steps"]["moh"] == 1
    assert "| MoH / dense |" in out.read_text() and "| 1.0 | 3.0 | 2.50x |" in out.read_text()  # a timing: its ratio
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == rows



def test_bench_models_counts_operators_under_cpu_autocast(tmp_path, monkeypatch):
    """``ops=true dtype=bfloat16``: every call under CPU autocast, as GPU runs train; "kernels" rows leave out
    the views; MoH's routing (the formulas on the CPU) adds operators to every layer."""
    import op_count

    monkeypatch.setattr(op_count, "LAYER_SHAPES", ((64, 4),))
    monkeypatch.setattr(op_count, "LAYER_TOKENS", (2, 16))
    monkeypatch.setattr(op_count, "host_us", lambda layers, x, train, **kw: {"dense": 1.0, "moh": 1.5, "ratio": 1.5})
    out = tmp_path / "ops.md"
    rows = load_benchmark("bench_models").main(["ops=true", "dtype=bfloat16", "graphs=false",
                                                "pairs=dit_tiny_2:dit_tiny_2", "attention=moh",
                                                "attention.activation_ratio=0.75", f"out={out}"])
    by = {r["figure"]: r for r in rows}
    for mode in ("infer", "train"):
        ops, kernels = (by[f"one attention layer, dim 64 / 4 heads, {mode} {what}"] for what in ("ops", "kernels"))
        assert 0 < kernels["dense"] < ops["dense"] and 0 < kernels["moh"] < ops["moh"]
        assert ops["dense"] < ops["moh"], (mode, ops)
        assert by[f"dit_tiny_2 vs dit_tiny_2, {mode} kernels"]["moh"] < by[f"dit_tiny_2 vs dit_tiny_2, {mode} ops"]["moh"]
    assert "bfloat16 autocast" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text())["dtype"] == "bfloat16"
