"""``benchmarks/bench_backbones.py``: our backbones beside timm peers in one interleaved run (the timings are for a
quiet machine; here: the plumbing, the consistency of the figures, and the saved-for-backward counter)."""
import json
import math

import pytest
import torch
from torch import nn

from helpers import load_benchmark
from bench_backbones import PAIR_SETS, parse_pairs, saved_tensor_bytes
from moh_vision.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def numbers(value):
    """Every number in a nested record."""
    if isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_quick_run_gives_finite_consistent_rows_eager_and_compiled(tmp_path, monkeypatch):
    from moh_vision.attention import recorder

    compiled = []

    def compile_model(model, mode):  # the plumbing only: no code generation in a unit test
        compiled.append((type(model).__name__, mode))
        return model

    monkeypatch.setattr(recorder, "compile_model", compile_model)
    out = tmp_path / "b.md"
    rows = load_benchmark("bench_backbones").main(["quick=true", "warmup=0", "compile=false,true",
                                                   "compile_mode=reduce-overhead", f"out={out}"])
    assert [(r["pair"], r["compiled"]) for r in rows] == [(PAIR_SETS["quick"][0], False),
                                                          (PAIR_SETS["quick"][0], True)]
    assert compiled == [("TransNeXt", "reduce-overhead"), ("PyramidVisionTransformerV2", "reduce-overhead")]
    for r in rows:
        ours, peer = r["ours"], r["peer"]
        assert all(math.isfinite(v) for v in numbers(r)), r
        assert r["img_size"] == 64 and r["batch"] == 1 and r["train_ratio"]["n"] == 2
        assert r["gflops_ratio"] == pytest.approx(ours["gflops"] / peer["gflops"])
        assert r["saved_ratio"] == pytest.approx(ours["saved_mib_per_image"] / peer["saved_mib_per_image"])
        for mode in ("train", "infer"):
            for key in ("median", "q1", "q3"):
                assert r[f"{mode}_ratio_per_gflop"][key] == pytest.approx(r[f"{mode}_ratio"][key] / r["gflops_ratio"])
            for side in (ours, peer):
                assert side[f"{mode}_img_s"] == pytest.approx(1e3 * r["batch"] / side[f"{mode}_ms"]["median"])
        for side in (ours, peer):  # the trainer's convention: 2 FLOPs a multiply-add, 3x the active forward
            assert side["train_tflops"] == pytest.approx(6 * side["active_gflops"] * side["train_img_s"] / 1e3)
            assert "train_utilisation" not in side  # no peak on a CPU
        assert 0 < ours["gflops"] and 0 < peer["gflops"] and ours["saved_mib_per_image"] > 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["rows"] == rows and record["torch"] == torch.__version__ and record["device"] == "cpu"
    assert record["options"]["compile"] == [False, True] and record["resolved"]["rounds"] == 2
    assert "cores" in record["machine"]
    table = out.read_text()
    assert "eager and torch.compile'd (mode reduce-overhead)" in table.splitlines()[0]
    assert "| transnext_nano / pvt_v2_b0 | no |" in table and "| transnext_nano / pvt_v2_b0 | yes |" in table


class Tiny(nn.Module):
    """Saves for backward: ``x`` (the linear layer's input, for the weight's gradient), ``h`` (twice: ``h * h``)
    and ``h * h`` (for ``scale``'s gradient); ``weight.t()`` and ``scale`` are parameters."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16, bias=False)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        h = self.lin(x)
        return (h * h) * self.scale


@pytest.mark.parametrize("input_grad", [False, True])  # with it, mm also saves weight.t(): a parameter's storage
def test_saved_tensor_bytes_counts_each_storage_once_and_no_parameter(input_grad):
    model = Tiny()
    x = torch.randn(3, 8, requires_grad=input_grad)
    h_bytes = 3 * 16 * 4
    assert saved_tensor_bytes(lambda: model(x).sum().backward(), model.parameters()) == x.nbytes + 2 * h_bytes
    linear = nn.Linear(8, 4)
    assert saved_tensor_bytes(lambda: linear(x), linear.parameters()) == x.nbytes
    assert saved_tensor_bytes(lambda: x * x) == (x.nbytes if input_grad else 0)  # saved twice, once counted
    with torch.no_grad():
        assert saved_tensor_bytes(lambda: model(x), model.parameters()) == 0


def test_saved_tensor_bytes_leaves_out_autocasts_copies_of_parameters():
    """Under bf16 autocast a linear layer saves the bf16 copies of its input and (the input needing a gradient)
    of its weight: the input's counts (it grows with the batch; a leaf, but no parameter), the weight's does
    not (one per step)."""
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert saved_tensor_bytes(lambda: linear(x), linear.parameters()) == x.numel() * 2
        assert saved_tensor_bytes(lambda: linear(x)) == x.numel() * 2 + linear.weight.numel() * 2  # not named


def test_pair_sets_expand():
    assert parse_pairs(["default"]) == [("transnext_micro", "pvt_v2_b1"),
                                        ("transnext_tiny", "swin_tiny_patch4_window7_224")]
    assert parse_pairs(["big"])[2:] == [("transnext_small", "swin_small_patch4_window7_224"),
                                        ("transnext_base", "swin_base_patch4_window7_224")]


@pytest.mark.parametrize("spec, message", [
    ("transnext_micro", "pairs wants ours:peer"),
    ("transnext_micro:pvt_v2_b1:x", "pairs wants ours:peer"),
    (":pvt_v2_b1", "pairs wants ours:peer"),
    ("transnext_micro:no_such_net", "unknown model 'no_such_net'"),
    ("pvt_v2_b1:transnext_micro", "'pvt_v2_b1' is a timm model, not one of moh-vision's"),
])
def test_a_bad_pair_is_one_config_error_line(spec, message, capsys):
    with pytest.raises(ConfigError, match=message):
        parse_pairs([spec])
    with pytest.raises(SystemExit) as exited:
        load_benchmark("bench_backbones").main([f"pairs={spec}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_profile_lists_where_a_step_goes(tmp_path):
    from bench_backbones import bench_backbones

    rows = bench_backbones(quick=True, rounds=1, warmup=0, saved=False, profile=True, out=str(tmp_path / "b.md"))
    profiled = rows[0]["ours"]["top_ops"]
    ops, by_kind = profiled["ops"], profiled["by_kind"]
    assert ops and all(op["ms"] >= 0 and op["calls"] >= 1 for op in ops)
    assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
    # every operator counted once: the kinds sum to at least the listed operators, and a TransNeXt step does
    # GEMMs, convolutions and its aggregated attention
    assert sum(by_kind.values()) == pytest.approx(profiled["total_ms"])
    assert profiled["total_ms"] >= sum(op["ms"] for op in ops) - 1e-6
    assert {"gemm", "convolution", "attention"} <= set(by_kind) and all(ms > 0 for ms in by_kind.values())
    text = (tmp_path / "b.md").read_text()
    assert "self time by kind" in text and "| gemm |" in text


def test_components_land_in_the_record_beside_the_pairs(tmp_path):
    from bench_backbones import bench_backbones

    out = tmp_path / "b.md"
    rows = bench_backbones(quick=True, rounds=1, warmup=0, saved=False, with_components=True, out=str(out),
                           kernels={"depthwise": "written_grad"})
    record = json.loads(out.with_suffix(".json").read_text())
    ours = rows[0]["ours"]["model"]
    assert record["rows"][0]["pair"] == rows[0]["pair"] and [r["stage"] for r in record["components"][ours]]
    assert f"Pieces of {ours}'s aggregated stages" in out.read_text()
    assert record["kernels"]["depthwise"] == "written_grad"  # the record says what ours ran
    assert "ours with kernels depthwise=written_grad" in record["header"]


def test_components_time_each_aggregated_stage_piece():
    from bench_backbones import component_table, component_times

    rows = component_times("transnext_nano", 1, 1, torch.device("cpu"), torch.float32)
    assert [r["stage"] for r in rows] == [1, 2, 3]  # stage 4 attends fully
    pieces = ["dwconv_reference", "dwconv_written_grad", "aggregated_reference", "aggregated_fused"]
    for r in rows:
        assert all(r[p]["n"] == 1 and r[p]["median"] > 0 for p in pieces)
    assert component_table(rows, "h").count("\n| ") == 4  # the header row and one per stage
    assert not any("aggregated_flex" in r or "dwconv_triton" in r for r in rows)  # CUDA-only candidates
    # a piece that could not run on a stage is said, not a crash
    rows[0]["aggregated_flex_error"] = "NotImplementedError: no"
    rows[1]["aggregated_flex"] = dict(rows[1]["aggregated_fused"])
    table = component_table(rows, "h")
    assert "aggregated_flex |" in table and "Stage 1: aggregated_flex did not run (NotImplementedError: no)" in table
