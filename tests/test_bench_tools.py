"""The benchmark tools run end to end (their timings are for a quiet machine, not for tests)."""
import json
import subprocess

import pytest
import torch

from helpers import REPO, load_benchmark


def test_bench_models_quick_compares_moh_with_its_dense_twin(tmp_path, capsys):
    rows = load_benchmark("bench_models").main(["quick=true", "img_size=32", "rounds=1", "warmup=0",
                                                "kernels.routing=reference", f"out={tmp_path / 't.md'}"])
    assert [r["model"] for r in rows] == ["dit_s_2", "moh_dit_s_2_75"]
    assert rows[0]["infer_x_dense"]["median"] == 1.0 and rows[0]["train_x_dense"]["n"] == 1
    assert all(r["infer_img_s"] > 0 and r["train_img_s"] > 0 and r["train_peak_mb"] > 0 for r in rows)
    assert "| moh_dit_s_2_75 |" in (tmp_path / "t.md").read_text()
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["kernels"]["routing"] == "reference" and [r["model"] for r in saved["rows"]] == ["dit_s_2",
                                                                                                  "moh_dit_s_2_75"]
    assert " threads, " in saved["header"] and "kernels routing=reference" in saved["header"]  # machine, kernels
    err = capsys.readouterr().err  # a progress bar per pair and mode, on stderr (the table goes to stdout)
    assert "moh_dit_s_2_75 vs dit_s_2, inference" in err and "moh_dit_s_2_75 vs dit_s_2, training" in err


def test_bench_models_counts_what_each_step_launches(tmp_path):
    """``launches=true``: on the CPU, the ATen operators a step calls at top level. MoH's routing adds
    operators to every layer, inference and training alike; the table gets the two columns."""
    from harness import launches

    rows = load_benchmark("bench_models").main(["quick=true", "img_size=32", "rounds=1", "warmup=0", "launches=true",
                                                f"out={tmp_path / 't.md'}"])
    dense, moh = rows
    for mode in ("infer", "train"):
        assert 0 < dense[f"{mode}_launches"]["aten_ops"] < moh[f"{mode}_launches"]["aten_ops"]
    assert dense["infer_launches"]["aten_ops"] < dense["train_launches"]["aten_ops"]
    assert "| inference launches | training launches |" in (tmp_path / "t.md").read_text()
    x = torch.randn(3, 3)
    assert launches(lambda: (x @ x).relu().sum(), torch.device("cpu")) == {"aten_ops": 3}  # nested ops not counted


def test_bench_kernels_times_one_model_under_each_kernels_variant(tmp_path):
    """``benchmarks/bench_kernels.py``: one model per variant with the same weights, the ratio to the first variant,
    and the bytes kept for backward, which the recomputing pieces lower."""
    rows = load_benchmark("bench_kernels").main(["model=transnext_nano", "batch=2", "rounds=1", "warmup=0",
                                                 "variants=auto,recompute=reference+routing=reference", "attention=moh",
                                                 f"out={tmp_path / 'k.md'}"])
    assert [r["kernels"] for r in rows] == ["auto", "recompute=reference+routing=reference"]
    assert rows[1]["resolved"] == {"aggregated": "auto", "routing": "reference", "depthwise": "auto",
                                   "recompute": "reference"}
    assert rows[0]["train_x_base"]["median"] == 1.0 and rows[1]["infer_x_base"]["n"] == 1
    assert rows[0]["saved_mib_per_image"] < rows[1]["saved_mib_per_image"]
    record = json.loads((tmp_path / "k.json").read_text())
    assert [r["kernels"] for r in record["rows"]] == ["auto", "recompute=reference+routing=reference"]
    assert "| recompute=reference+routing=reference |" in (tmp_path / "k.md").read_text()
    with pytest.raises(SystemExit):
        load_benchmark("bench_kernels").main(["model=transnext_nano", "variants=auto,routing=cuda"])


def test_cpu_peak_memory_replays_allocations_and_frees_in_order():
    """Two 4 MiB tensors held together inside one profiled range (as in a backward node, which frees
    its saved tensors after allocating the gradients): the peak is both, not their net zero."""
    import torch

    from harness import peak_memory

    n = 1 << 20

    def call():
        with torch.autograd.profiler.record_function("node"):
            a, b = torch.ones(n), torch.ones(n)
            del a, b

    assert peak_memory(call, torch.device("cpu")) == 2 * 4 * n


def test_bench_models_times_a_dense_model_as_moh_against_itself():
    from harness import build_for_bench
    from moh_vision.attention import find_attention

    rows = load_benchmark("bench_models").main(["pairs=dit_s_2:dit_s_2", "img_size=32", "rounds=1", "warmup=0",
                                                "attention=moh", "attention.activation_ratio=0.5"])
    assert [r["model"] for r in rows] == ["dit_s_2", "dit_s_2 (moh 0.5)"]
    model = build_for_bench("dit_s_2", 32, torch.device("cpu"), {"name": "moh", "activation_ratio": 0.5})
    layers = [m for _, m in find_attention(model)]
    assert layers and all(m.active_heads() == m.num_heads // 2 for m in layers)


@pytest.mark.slow  # every model through torch.compile: 14 s (benchmarks/, not the library)
def test_bench_models_compiles_every_model_and_leaves_compilation_untimed(monkeypatch):
    compiled = []

    def compile_fast(model, mode):  # dynamo's graph capture only: the plumbing, not inductor's code generation
        assert mode == "reduce-overhead"
        compiled.append(model)
        return torch._dynamo.optimize("eager")(model)

    import harness as benchmark

    warmups = []

    def interleave(calls, **kwargs):
        warmups.append(kwargs["warmup"])
        return real_interleave(calls, **kwargs)

    real_interleave = benchmark.interleave
    monkeypatch.setattr(torch, "compile", compile_fast)
    monkeypatch.setattr(benchmark, "interleave", interleave)
    torch._dynamo.reset()
    rows = load_benchmark("bench_models").main(["quick=true", "rounds=1", "warmup=0", "compile=true",
                                                "compile_mode=reduce-overhead"])
    assert [(type(m).__name__, r["model"], r["compiled"]) for m, r in zip(compiled, rows)] == [
        ("DiT", "dit_s_2", True), ("DiT", "moh_dit_s_2_75", True)]
    assert warmups == [1, 1]  # inference, training: the call that compiles is never a timed one
    assert all(r["infer_ms"]["n"] == 1 and r["train_ms"]["n"] == 1 for r in rows)


def test_gpu_checks_script_parses_and_names_its_parts():
    """``tools/gpu_checks.sh`` runs on lent GPU machines only; here: bash accepts it, and its parts are the
    ones its usage line names."""
    script = REPO / "tools" / "gpu_checks.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode != 0
    assert "usage: bash tools/gpu_checks.sh <out_dir> [steps,backbones,tests,models,routing,train]" in usage.stderr
    text = script.read_text()
    assert all(f"*,{part},*" in text for part in ("steps", "backbones", "tests", "models", "routing", "train"))


def test_bench_data_quick_times_both_loaders_on_a_generated_tree(tmp_path, capsys):
    """``benchmarks/bench_data.py quick=true``: a tiny JPEG tree, this project's loaders and timm's, one interleaved
    round; the table and its JSON record. A tree that exists is read, not written to."""
    record = load_benchmark("bench_data").main(["quick=true", f"root={tmp_path / 'tree'}", f"out={tmp_path / 'd.md'}"])
    assert [(r["split"], r["workers"]) for r in record["rows"]] == [("train", 0), ("val", 0)]
    assert record["tree"] == {"classes": 2, "train_images": 16, "val_images": 8,
                              "mean_jpeg_bytes": record["tree"]["mean_jpeg_bytes"]}
    for row in record["rows"]:
        assert row["images"] == (16 if row["split"] == "train" else 8)
        assert row["moh_vision"]["median"] > 0 and row["timm"]["median"] > 0
        assert row["moh_vision_over_timm"]["median"] == pytest.approx(row["moh_vision"]["median"] / row["timm"]["median"])
    assert "| train | 0 (in-process) | 16 |" in (tmp_path / "d.md").read_text()
    assert json.loads((tmp_path / "d.json").read_text())["rows"] == record["rows"]
    assert "timm" in capsys.readouterr().out
    files = sorted((tmp_path / "tree").rglob("*.JPEG"))
    load_benchmark("bench_data").main(["quick=true", f"root={tmp_path / 'tree'}", "splits=val"])
    assert sorted((tmp_path / "tree").rglob("*.JPEG")) == files
