"""The benchmark tools run end to end (their timings are for a quiet machine, not for tests)."""
import importlib.util

from helpers import REPO


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_models_quick_compares_moh_with_its_dense_twin(tmp_path, capsys):
    rows = load_tool("bench_models").main(["--quick", "--iters", "1", "--warmup", "0", "--impl", "auto", "sparse",
                                           "--out", str(tmp_path / "t.md")])
    assert [(r["model"], r["impl"]) for r in rows] == [("dit_s_2", "-"), ("moh_dit_s_2_75", "auto"),
                                                       ("moh_dit_s_2_75", "sparse")]
    assert rows[0]["infer_x_dense"] == 1.0
    assert all(r["infer_img_s"] > 0 and r["train_img_s"] > 0 for r in rows)
    assert "| moh_dit_s_2_75 | sparse |" in (tmp_path / "t.md").read_text()


def test_bench_models_skips_an_impl_the_model_cannot_run(capsys):
    rows = load_tool("bench_models").main(["--pairs", "moh_transnext_small_75:transnext_small", "--img-size", "32",
                                           "--iters", "1", "--warmup", "0", "--impl", "sparse", "masked"])
    assert [r["impl"] for r in rows] == ["-", "masked"]
    assert "skip moh_transnext_small_75 impl=sparse" in capsys.readouterr().err
