"""impl="auto" thresholds are data: the packaged table, its checks, overrides, and fitting it from benchmark runs."""
import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch

from helpers import load_tool
from moh_vision.analysis.benchmark import fit_sdpa_rule, fitted_table
from moh_vision.attention import build_attention
from moh_vision.attention.auto_table import auto_table, load_table, packaged_tables, parse_table, write_table
from moh_vision.attention.routing import resolve_moh_heads
from moh_vision.attention.sparse import choose_impl, sparse_flops_ratio
from moh_vision.errors import ConfigError


def test_packaged_cpu_table_loads_and_is_immutable():
    table = auto_table("cpu")  # the tests pin auto_cpu.json (conftest), whatever machine runs them
    assert table is not None and table.source.endswith("auto_cpu.json")
    assert table.sdpa.min_batch_tokens > 0 and table.provenance["machine"]
    assert set(table.kernels) == {"transnext_aggregated", "transnext_full"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.sdpa.max_predicted = 2.0
    with pytest.raises(TypeError):
        table.kernels["transnext_full"] = table.kernels["transnext_aggregated"]


def test_packaged_cuda_table_keeps_every_measured_shape_masked():
    """The table fitted on one H100: the sparse path lost to masked at every shape measured there (eager mode
    is host-bound), so auto runs masked on CUDA, also for layers with fewer active heads than measured."""
    table = auto_table("cuda")
    assert Path(table.source).name == "auto_cuda.json" and table.machines == ("NVIDIA H100 80GB HBM3",)
    assert table.kernels == {} and table.sdpa.min_batch_tokens == 64 * 196
    for run in table.provenance["runs"]:
        dim, heads = run["dim"], run["heads"]
        for seqlen in run["seqlens"]:
            for ratio in (0.25, *run["ratios"]):
                shared, topk = resolve_moh_heads(heads, activation_ratio=ratio)
                for training in (False, True):
                    assert choose_impl("cuda", seqlen, dim, heads, dim // heads, shared, topk, batch=run["batch"],
                                       training=training) == "masked"


def test_every_packaged_table_names_the_machines_it_was_measured_on():
    tables = packaged_tables("cpu")
    assert Path(tables[0].source).name == "auto_cpu.json" and len(tables) >= 2
    for table in tables:
        assert table.machines and table.sdpa is not None and set(table.kernels) == {"transnext_aggregated", "transnext_full"}
        assert all(any(name in m for m in table.provenance["machine"]) for name in table.machines)
    names = [name for table in tables for name in table.machines]
    assert len(names) == len(set(names))  # no machine is claimed twice


@pytest.fixture
def packaged_dir(tmp_path, monkeypatch):
    """Packaged tables read from ``tmp_path`` (``auto_cpu.json`` the default) and a settable machine name."""
    from moh_vision.attention import auto_table as module

    for name, machines, overhead in (("auto_cpu.json", ["AMD EPYC"], 0.1), ("auto_cpu_xeon.json", ["Intel(R) Xeon(R)"], 0.5)):
        (tmp_path / name).write_text(json.dumps({"machines": machines, "sdpa": {"overhead": [[64, overhead]]}}))
    machine = {"cpu": "AMD EPYC 7B13"}
    monkeypatch.setattr(module, "PACKAGED_DIR", tmp_path)
    monkeypatch.setattr(module, "machine_name", lambda device_type: machine.get(device_type, ""))
    monkeypatch.delenv("MOH_VISION_AUTO_CPU", raising=False)
    module._cached.cache_clear()
    yield machine
    module._cached.cache_clear()


def test_each_machine_gets_the_table_measured_on_its_kind(packaged_dir, monkeypatch, tmp_path):
    """The same code costs differently on different processors: a machine uses the packaged table that
    names it, any other the default; an explicit file wins over both."""
    def chosen():
        return Path(auto_table("cpu").source).name, auto_table("cpu").sdpa.overhead_at(64)

    assert chosen() == ("auto_cpu.json", 0.1)
    packaged_dir["cpu"] = "Intel(R) Xeon(R) Processor"
    assert chosen() == ("auto_cpu_xeon.json", 0.5)
    assert choose_impl("cpu", 64, 768, 12, 64, 3, 3, batch=32) == "masked"  # 0.74 + 0.5: not on this machine
    packaged_dir["cpu"] = "intel(r) xeon(r) platinum 8480+"  # names match case-insensitively, as prefixes
    assert chosen()[0] == "auto_cpu_xeon.json"
    packaged_dir["cpu"] = "Apple M3"  # measured nowhere: the default table
    assert chosen()[0] == "auto_cpu.json"
    assert choose_impl("cpu", 64, 768, 12, 64, 3, 3, batch=32) == "sparse"  # 0.74 + 0.1
    monkeypatch.setenv("MOH_VISION_AUTO_CPU", str(tmp_path / "auto_cpu_xeon.json"))
    assert chosen()[0] == "auto_cpu_xeon.json"
    assert auto_table("cuda") is None


def test_without_a_default_table_an_unnamed_machine_runs_masked(packaged_dir, tmp_path):
    (tmp_path / "auto_cpu.json").unlink()
    packaged_dir["cpu"] = "Apple M3"
    assert auto_table("cpu") is None and choose_impl("cpu", 1024, 768, 12, 64, 3, 3, batch=2) == "masked"
    packaged_dir["cpu"] = "Intel(R) Xeon(R) Processor"
    assert Path(auto_table("cpu").source).name == "auto_cpu_xeon.json"


@pytest.mark.parametrize("data, message", [
    ({"machines": "AMD EPYC"}, "machines: expected a list of non-empty strings"),
    ({"machines": [""]}, "machines: expected a list of non-empty strings"),
    ([1, 2], "expected a mapping"),
    ({"sdpa": {"overhead": []}}, "sdpa.overhead: expected a non-empty list"),
    ({"sdpa": {"overhead": [[196, 0.1], [64, 0.2]]}}, "token counts must increase"),
    ({"sdpa": {"overhead": [[196, "x"]]}}, r"overhead\[0\] overhead: expected a number"),
    ({"sdpa": {"overhead": [[196, 0.1]], "min_dim": 1.5}}, "min_dim: expected an integer"),
    ({"sdpa": {"overhead": [[196, 0.1]], "typo": 1}}, "unknown typo"),
    ({"sdpa": {"overhead": [[196, 0.1]], "training_overhead": []}}, "sdpa.training_overhead: expected a non-empty"),
    ({"sdpa": {"overhead": [[196, 0.1]], "min_dim": 384, "wider": [{"min_dim": 384, "overhead": [[196, 0.1]]}]}},
     "wider: min_dim must increase"),
    ({"sdpa": {"overhead": [[196, 0.1]], "wider": [{"overhead": [[196, 0.1]]}]}}, r"wider\[0\]: missing min_dim"),
    ({"kernels": {"transnext_full": {"min_tokens": 1}}}, "kernels.transnext_full: missing min_batch_tokens"),
    ({"kernels": {"k": {"min_tokens": 1, "min_batch_tokens": 1, "max_active": -0.5}}}, "max_active: expected"),
    ({"kernels": {"k": {"min_tokens": 1, "min_batch_tokens": 1, "max_active": 0.5, "inference_max_tokens": 0.5}}},
     "kernels.k.inference_max_tokens: expected an integer"),
])
def test_malformed_tables_fail_in_one_line(data, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_table(data, "t.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("auto thresholds t.json")


def test_unreadable_files_fail_in_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ConfigError, match="bad.json: not JSON"):
        load_table(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_table(tmp_path / "missing.json")


def test_write_then_load_round_trips(tmp_path):
    table = auto_table("cpu")
    again = load_table(write_table(table, tmp_path / "t.json"))
    assert (again.sdpa, dict(again.kernels), dict(again.provenance), again.notes, again.machines) == \
        (table.sdpa, dict(table.kernels), dict(table.provenance), table.notes, table.machines)


def test_choice_uses_tokens_per_call(tmp_path, monkeypatch):
    # a table measured at >= 1,000 tokens per call: one 196-token image per call is outside it
    table = {"sdpa": {"overhead": [[64, 0.2], [1024, 0.1]], "min_batch_tokens": 1000}}
    assert choose_impl("cpu", 196, 768, 12, 64, 3, 3, batch=1, table=parse_table(table, "t")) == "masked"
    assert choose_impl("cpu", 196, 768, 12, 64, 3, 3, batch=10, table=parse_table(table, "t")) == "sparse"
    (tmp_path / "t.json").write_text(json.dumps(table))
    monkeypatch.setenv("MOH_VISION_AUTO_CPU", str(tmp_path / "t.json"))
    m = build_attention("moh", 768, 12, activation_ratio=0.5)  # impl auto: reads the table per call
    assert [m.execution_path(torch.zeros(b, 196, 768)) for b in (1, 10)] == ["masked", "sparse"]
    assert m.execution_path(torch.zeros(10, 196, 768, device="meta")) == "masked"  # no table for that device


def test_kernel_rules_can_keep_long_inference_calls_masked(tmp_path, monkeypatch):
    """TransNeXt's stage 1 (3,136 tokens): the sparse aggregated path's forward measured slower than masked while
    its forward and backward were faster, so the CPU table sends inference calls there masked and training calls
    sparse; a module in train mode with autograd off is an inference call."""
    from types import SimpleNamespace
    from moh_vision.attention.sparse import table_auto

    rule = {"min_tokens": 196, "min_batch_tokens": 392, "max_active": 0.67, "inference_max_tokens": 784}
    table = parse_table({"kernels": {"transnext_aggregated": rule}}, "t")
    kernel_rule = table.kernels["transnext_aggregated"]
    assert [kernel_rule.pays(n, 4, 0.5) for n in (196, 784, 3136)] == [True, True, False]
    assert [kernel_rule.pays(n, 4, 0.5, training=True) for n in (196, 784, 3136)] == [True, True, True]
    assert load_table(write_table(table, tmp_path / "w.json")).kernels["transnext_aggregated"] == kernel_rule

    (tmp_path / "t.json").write_text(json.dumps({"kernels": {"transnext_aggregated": rule}}))
    monkeypatch.setenv("MOH_VISION_AUTO_CPU", str(tmp_path / "t.json"))
    auto = table_auto("transnext_aggregated")
    layer = SimpleNamespace(shared_heads=0, topk=1, num_heads=2, training=True)
    x = torch.zeros(4, 3136, 8)
    assert auto(layer, x) == "sparse"
    with torch.no_grad():
        assert auto(layer, x) == "masked"
    layer.training = False
    assert auto(layer, x) == "masked" and auto(layer, torch.zeros(4, 784, 8)) == "sparse"


def test_env_variable_replaces_the_packaged_table(tmp_path, monkeypatch):
    everywhere = {"sdpa": {"overhead": [[1, 0.0]]},
                  "kernels": {"transnext_aggregated": {"min_tokens": 10 ** 6, "min_batch_tokens": 1, "max_active": 1.0}}}
    (tmp_path / "t.json").write_text(json.dumps(everywhere))
    monkeypatch.setenv("MOH_VISION_AUTO_CPU", str(tmp_path / "t.json"))
    assert choose_impl("cpu", 16, 768, 12, 64, 3, 3, batch=1) == "sparse"
    assert auto_table("cpu").kernels["transnext_aggregated"].min_tokens == 10 ** 6
    monkeypatch.setenv("MOH_VISION_AUTO_CUDA", str(tmp_path / "t.json"))
    assert choose_impl("cuda", 16, 768, 12, 64, 3, 3, batch=1) == "sparse"
    monkeypatch.delenv("MOH_VISION_AUTO_CPU")
    assert choose_impl("cpu", 16, 768, 12, 64, 3, 3, batch=1) == "masked"
    monkeypatch.setenv("MOH_VISION_AUTO_CPU", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="missing.json: cannot read"):
        choose_impl("cpu", 16, 768, 12, 64, 3, 3, batch=1)


def bench_row(seqlen, batch, shared, topk, sparse, masked, dim=384, heads=6):
    bound = sparse_flops_ratio(dim, heads, dim // heads, seqlen, shared, topk)
    row = {"seqlen": seqlen, "batch": batch, "dim": dim, "heads": heads, "head_dim": dim // heads, "shared": shared,
           "topk": topk, "bound": bound}
    for mode, (s, mk) in zip(("fwd", "fwdbwd"), zip(sparse, masked)):
        row.update({f"sparse_{mode}": s, f"masked_{mode}": mk})
    return row


def test_fit_takes_the_worst_overhead_rounded_up_and_the_measured_limits():
    rows = [bench_row(196, 10, 1, 2, (0.80, 0.75), (1.04, 1.03)), bench_row(196, 10, 1, 3, (0.95, 0.90), (1.03, 1.02)),
            bench_row(1024, 2, 1, 2, (0.70, 0.66), (1.02, 1.01), dim=768, heads=12)]
    rule = fit_sdpa_rule(rows)
    worst_196 = max(r["sparse_fwd"] - r["bound"] for r in rows[:2])
    assert rule.curves[0].overhead[0][0] == 196 and worst_196 <= rule.curves[0].overhead[0][1] < worst_196 + 0.01 + 1e-9
    assert (rule.min_dim, rule.min_head_dim, rule.min_batch_tokens) == (384, 64, 1960)
    # the prediction is never below what was measured, each width by its own curves
    assert all(r["bound"] + rule.overhead_at(r["seqlen"], dim=r["dim"]) >= r["sparse_fwd"] - 1e-9 for r in rows)
    assert [w.min_dim for w in rule.curves[1:]] == [768] and rule.overhead_at(1024) is not None


def test_each_width_gets_its_own_curves_and_wider_layers_the_widest_they_reach(tmp_path):
    """A high overhead measured at dim 384 must not send a dim-768 layer that measured faster to masked
    (one curve for both widths did); a layer takes the curves of the widest measured width it reaches."""
    narrow = bench_row(196, 10, 1, 2, (0.98, 0.98), (1.07, 1.06))  # bound 0.70: overhead 0.28
    wide = bench_row(196, 10, 3, 3, (0.97, 0.96), (1.04, 1.05), dim=768, heads=12)  # bound 0.73: overhead 0.24-0.25
    rule = fit_sdpa_rule([narrow, wide])
    assert rule.min_dim == 384 and [w.min_dim for w in rule.curves[1:]] == [768]
    assert rule.overhead_at(196, dim=384) == pytest.approx(0.28) and rule.overhead_at(196, dim=1152) == pytest.approx(0.25)
    assert rule.overhead_at(196, training=True, dim=768) == pytest.approx(0.24)
    table = load_table(write_table(dataclasses.replace(auto_table("cpu"), sdpa=rule), tmp_path / "t.json"))
    assert table.sdpa == rule  # the wider curves round-trip through the JSON
    assert choose_impl("cpu", 196, 768, 12, 64, 3, 3, batch=10, table=table) == "sparse"
    assert choose_impl("cpu", 196, 1152, 16, 72, 4, 4, batch=10, table=table) == "sparse"  # 0.73 + 0.25 (768's)
    assert rule.overhead_at(196, dim=512) == pytest.approx(0.28)  # between the widths: the narrower one's
    one_curve = fit_sdpa_rule([dict(r, dim=384, heads=6, head_dim=64) for r in (narrow, wide)])
    assert not one_curve.pays(196, 10, 768, 64, wide["bound"])  # what a single curve decided


def test_fit_overhead_comes_from_the_rows_where_sparse_won():
    win = bench_row(196, 10, 1, 2, (0.95, 0.90), (1.06, 1.05))
    lose = bench_row(196, 10, 2, 3, (1.30, 1.25), (1.05, 1.04))  # many routed heads: far slower
    rule = fit_sdpa_rule([win, lose])
    assert rule.overhead_at(196) < lose["sparse_fwd"] - lose["bound"]  # the loser does not inflate it
    picks = [choose_impl("cpu", 196, 384, 6, 64, r["shared"], r["topk"], batch=10,
                         table=parse_table({"sdpa": {"overhead": [list(p) for p in rule.curves[0].overhead]}}, "t"))
             for r in (win, lose)]
    assert picks == ["sparse", "masked"]
    # a length where sparse never won: every measured row there stays masked, and the overhead is what the
    # closest loser implies, so a layer with fewer active heads goes sparse only where that predicts a win
    loser = bench_row(64, 32, 1, 2, (1.10, 1.08), (1.05, 1.04))
    only_losers = fit_sdpa_rule([loser])
    assert loser["bound"] + only_losers.overhead_at(64) > only_losers.max_predicted
    assert only_losers.overhead_at(64) == pytest.approx(1.10 - loser["bound"], abs=0.01)
    assert only_losers.overhead_at(64, training=True) == pytest.approx(1.08 - loser["bound"], abs=0.01)
    far_slower = fit_sdpa_rule([bench_row(64, 32, 1, 2, (9.0, 7.0), (2.5, 2.0))])  # e.g. a GPU in eager mode
    assert not any(far_slower.pays(64, 32, 384, 64, bound) for bound in (0.0, 0.2, 0.5))


def test_fit_never_picks_a_path_that_measured_slower():
    rng = random.Random(0)
    rows = []
    for seqlen, batch in ((64, 32), (196, 10), (576, 3), (1024, 2)):
        for shared, topk in ((1, 1), (1, 2), (2, 2), (1, 4)):
            bound = sparse_flops_ratio(384, 6, 64, seqlen, shared, topk)
            sparse = [bound + rng.uniform(0.0, 0.3) for _ in range(2)]
            masked = [rng.uniform(0.6, 1.1) for _ in range(2)]  # sometimes below sparse
            rows.append(bench_row(seqlen, batch, shared, topk, sparse, masked))
    assert any(r["sparse_fwd"] > r["masked_fwd"] for r in rows)
    rule = fit_sdpa_rule(rows)
    assert rule.curves[0].training_overhead is not None and rule.curves[0].training_overhead != rule.curves[0].overhead
    table = parse_table({"sdpa": {"overhead": [list(p) for p in rule.curves[0].overhead], "max_predicted": rule.max_predicted,
                                  "min_dim": rule.min_dim, "min_head_dim": rule.min_head_dim,
                                  "min_batch_tokens": rule.min_batch_tokens,
                                  "training_overhead": [list(p) for p in rule.curves[0].training_overhead]}}, "fitted")
    for mode, training in (("fwd", False), ("fwdbwd", True)):  # each kind of call by its own measurements
        picks = [choose_impl("cpu", r["seqlen"], 384, 6, 64, r["shared"], r["topk"], batch=r["batch"], table=table,
                             training=training) for r in rows]
        assert "sparse" in picks
        for r, pick in zip(rows, picks):
            if pick == "sparse":
                assert r[f"sparse_{mode}"] <= r[f"masked_{mode}"] and r[f"sparse_{mode}"] <= rule.max_predicted + 1e-9


def test_training_calls_use_the_training_overhead_where_the_table_has_one(monkeypatch):
    """Sparse's backward saves more than its forward: a row where sparse won training but lost inference
    goes sparse only in training calls (train mode with autograd on), as the benchmark's auto column reports."""
    row = bench_row(196, 10, 2, 2, (1.04, 0.99), (1.06, 1.05))  # a 4-of-6 layer at 196 tokens
    rule = fit_sdpa_rule([row])
    assert row["bound"] + rule.overhead_at(196) > 1.0 >= row["bound"] + rule.overhead_at(196, training=True)
    table = parse_table({"sdpa": {"overhead": [list(p) for p in rule.curves[0].overhead],
                                  "training_overhead": [list(p) for p in rule.curves[0].training_overhead]}}, "t")
    only_inference = parse_table({"sdpa": {"overhead": [list(p) for p in rule.curves[0].overhead]}}, "t")
    args = ("cpu", 196, 384, 6, 64, 2, 2)
    assert choose_impl(*args, batch=10, table=table, training=True) == "sparse"
    assert choose_impl(*args, batch=10, table=table) == "masked"
    assert choose_impl(*args, batch=10, table=only_inference, training=True) == "masked"  # older tables: one curve
    m = build_attention("moh", 384, 6, shared_heads=2, topk=2, impl="auto")
    monkeypatch.setattr("moh_vision.attention.sparse.auto_table", lambda device: table)
    x = torch.randn(10, 196, 384)
    assert m.train().execution_path(x) == "sparse"
    with torch.no_grad():
        assert m.execution_path(x) == "masked"
    assert m.eval().execution_path(x) == "masked"


def test_fit_takes_each_shape_once_with_the_median_of_its_runs():
    """The same layer measured in three runs: one busy run (sparse measured slower) neither vetoes the
    sparse path nor sets the overhead; the median does, and shapes measured once stay as they are."""
    runs = [(0.95, 0.90), (0.97, 0.92), (1.12, 1.10)]  # sparse fwd, fwd+bwd per run; masked ~1.05 in all
    rows = [bench_row(196, 10, 1, 2, sparse, (1.05, 1.04)) for sparse in runs]
    rows.append(bench_row(1024, 2, 1, 2, (0.70, 0.66), (1.02, 1.01), dim=768, heads=12))
    rule = fit_sdpa_rule(rows)
    bound = rows[0]["bound"]
    assert rule.overhead_at(196) == pytest.approx(math.ceil(round((0.97 - bound) * 100, 6)) / 100)
    assert rule.overhead_at(196, training=True) == pytest.approx(math.ceil(round((0.92 - bound) * 100, 6)) / 100)
    assert choose_impl("cpu", 196, 384, 6, 64, 1, 2, batch=10, table=parse_table(
        {"sdpa": {"overhead": [list(p) for p in rule.curves[0].overhead]}}, "t")) == "sparse"
    only_busy = fit_sdpa_rule(rows[2:3])  # that run alone keeps the shape masked
    assert bound + only_busy.overhead_at(196) > only_busy.max_predicted


def test_fit_rejects_rows_without_what_it_needs():
    with pytest.raises(ConfigError, match="no sparse-path timings"):
        fit_sdpa_rule([{"seqlen": 196}])
    row = bench_row(196, 10, 1, 2, (0.8, 0.8), (1.0, 1.0))
    del row["head_dim"]
    with pytest.raises(ConfigError, match="lack head_dim"):
        fit_sdpa_rule([row])
    with pytest.raises(ConfigError, match="one device type"):
        fitted_table([{"device": "cpu", "rows": [row]}, {"device": "cuda", "rows": [row]}])


def test_tool_fits_from_earlier_runs_and_keeps_the_kernel_rules(tmp_path, capsys):
    records = []
    for i, dim in enumerate((384, 768)):
        rows = [bench_row(n, max(1, 2048 // n), 1, 2, (0.7 + 0.1 * i, 0.7), (1.0, 1.0), dim=dim, heads=dim // 64)
                for n in (196, 1024)]
        records.append(tmp_path / f"b{dim}.json")
        records[-1].write_text(json.dumps({"header": "h", "device": "cpu", "machine": "Test CPU 9000, 2 cores",
                                           "torch": "x", "threads": 1, "settings": {"dim": dim}, "rows": rows}))
    out = tmp_path / "auto_cpu.json"
    tool = load_tool("bench_attention")
    assert tool.main([f"fit_from={records[0]},{records[1]}", f"fit={out}"]) == 0
    assert "thresholds written to" in capsys.readouterr().out
    table = load_table(out)
    assert table.sdpa.min_dim == 384 and table.sdpa.min_batch_tokens == 1960
    assert [n for n, _ in table.sdpa.curves[0].overhead] == [196, 1024]
    assert dict(table.kernels) == dict(auto_table("cpu").kernels)
    assert table.provenance["machine"] == ["Test CPU 9000, 2 cores"] and len(table.provenance["runs"]) == 2
    assert table.machines == ("Test CPU 9000",)  # records without "processor": the model from "machine"
    with pytest.raises(SystemExit):  # a user error: one line, exit code 2
        tool.main([f"fit_from={records[0]}"])
    assert "fit_from needs fit=<file>" in capsys.readouterr().err
    (tmp_path / "not_a_run.json").write_text("{}")
    with pytest.raises(SystemExit):
        tool.main([f"fit_from={tmp_path / 'not_a_run.json'}", f"fit={out}"])
    assert "not a bench_attention record" in capsys.readouterr().err
