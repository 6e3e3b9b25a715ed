"""FLOP counting: fvcore counts equal hand-written formulas, active FLOPs follow the routing
configuration, and no op of any registered model family escapes the count."""
import json
import math

import pytest
import timm
import torch

import moh_vision  # noqa: F401  (registers the models)
from helpers import REPO, load_tool
from moh_vision.apps.flops_table import COLUMNS, PUBLISHED_GFLOPS, format_table
from moh_vision.analysis.flop_count import FREE_OPS, count_flops, flop_report, op_handles
from moh_vision.attention import build_attention, record_routing, routed_modules
from moh_vision.cli import parse_options
from moh_vision.models import list_models



# ---------------------------------------------------------------------------------------------
# Hand-written multiply-add counts of one attention layer on N tokens of width C (batch 1)
# ---------------------------------------------------------------------------------------------
def query_work(N, C, h, d):
    """What scales with the active heads: queries, QK^T and AV per query, output projection."""
    return N * C * h * d + 2 * h * N * N * d + N * h * d * C


def mha_flops(N, C, h, d):
    return N * C * 3 * h * d + 2 * h * N * N * d + N * h * d * C


def moh_router_flops(N, C, h, shared, topk):
    routed = h - shared
    return N * C * (routed * (topk > 0) + 2 * (topk > 0 and shared > 0) + shared * (shared > 1))


def moa_flops(N, C, E, d):
    # per-expert queries and outputs, ONE key/value head (expanded to every expert), the router
    return N * C * E * d + N * C * 2 * d + 2 * E * N * N * d + N * E * d * C + N * C * E


N, C, H = 50, 64, 8
D = C // H


def test_mha_matches_formula():
    m = build_attention("mha", C, H)
    out = count_flops(m, (N, C))
    assert out["gflops"] * 1e9 == mha_flops(N, C, H, D)
    assert out["active_gflops"] == out["gflops"] and out["routed_layers"] == 0
    assert out["params"] == sum(p.numel() for p in m.parameters())
    assert "uncounted_ops" not in out


@pytest.mark.parametrize("shared,topk", [(2, 2), (4, 3), (1, 5), (0, 4), (8, 0)])
def test_moh_matches_formula(shared, topk):
    m = build_attention("moh", C, H, shared_heads=shared, topk=topk)
    out = count_flops(m, (N, C))
    dense = mha_flops(N, C, H, D) + moh_router_flops(N, C, H, shared, topk)
    assert out["gflops"] * 1e9 == dense
    f = (shared + topk) / H
    assert out["active_gflops"] * 1e9 == pytest.approx(dense - (1 - f) * query_work(N, C, H, D), rel=1e-12)


@pytest.mark.parametrize("topk", [1, 3, 8])
def test_moa_matches_formula(topk):
    m = build_attention("moa", C, H, topk=topk)
    out = count_flops(m, (N, C))
    dense = moa_flops(N, C, H, D)
    assert out["gflops"] * 1e9 == dense
    f = topk / H
    assert out["active_gflops"] * 1e9 == pytest.approx(dense - (1 - f) * query_work(N, C, H, D), rel=1e-12)


def test_count_is_the_same_under_every_kernels_config():
    """The trace runs one fixed set of implementations (the aggregated attention as its one operator, the rest
    as formulas), so the model's own ``kernels`` change nothing in the count."""
    import timm
    counts = [count_flops(timm.create_model("transnext_nano", attention="moh", kernels=kernels), (3, 32, 32))
              for kernels in (None, {key: "reference" for key in ("aggregated", "routing", "depthwise", "recompute")})]
    assert counts[0] == counts[1] and not counts[0].get("uncounted_ops")


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
FAMILIES = {  # small member of every registered family, its input, extra forward inputs
    "transnext_nano": ((1, 32, 32), None),
    "dit_tiny_2": ((1, 16, 16), {"t": torch.tensor([10]), "y": torch.tensor([3])}),
    "plain_vit_nano": ((3, 32, 32), None),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attention", ["mha", "moh", "moa"])
def test_every_op_of_every_family_is_counted_or_known_free(family, attention):
    shape, kwargs = FAMILIES[family]
    model = timm.create_model(family, attention=attention, in_chans=shape[0]) if "dit" not in family \
        else timm.create_model(family, attention=attention)
    report = flop_report(model, shape, kwargs)
    assert report.uncounted_ops == {}, f"ops with no flop handle: {report.uncounted_ops}"
    assert report.notes == []
    assert report.flops > 0 and report.pointwise > 0
    if attention == "mha":
        assert report.active_flops == report.flops
    else:
        assert report.active_flops < report.flops
        assert len(report.layers) == len(list(routed_modules(model)))


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 1.0])
def test_active_flops_follow_the_activation_ratio(ratio):
    """plain_vit_nano cut to 2 blocks: 65 tokens (class token + 8x8 patches), width 128, 4 heads of 32."""
    model = timm.create_model("plain_vit_nano", attention="moh", activation_ratio=ratio, depth=2)
    out = count_flops(model, (3, 32, 32))
    f = {0.25: 1, 0.5: 2, 0.75: 3, 1.0: 4}[ratio] / 4
    per_layer = query_work(65, 128, 4, 32)
    assert out["active_gflops"] * 1e9 == pytest.approx(out["gflops"] * 1e9 - 2 * (1 - f) * per_layer, rel=1e-12)
    assert out["routed_layers"] == (2 if ratio < 1 else 0)
    if ratio == 1.0:  # every head active: a dense-weighted layer, nothing to skip
        assert out["active_gflops"] == out["gflops"]


def test_dit_counts_with_its_extra_inputs_and_matches_the_paper():
    """DiT-S/8 at 256 px (32x32 latent): the DiT paper's 0.36 GFLOPs (Table 4)."""
    model = timm.create_model("dit_s_8")
    out = count_flops(model, (4, 32, 32), {"t": torch.tensor([500]), "y": torch.tensor([1])})
    assert round(out["gflops"], 2) == 0.36
    # analytic: 12 blocks of (12 C^2 N + 2 N^2 C) + adaLN 6 C^2 per block, N = 16 tokens, C = 384
    blocks = 12 * (12 * 384 ** 2 * 16 + 2 * 16 ** 2 * 384 + 6 * 384 ** 2)
    assert out["gflops"] * 1e9 == pytest.approx(blocks, rel=0.02)


def test_keyword_only_inputs_and_layer_names():
    """Inputs that can only be passed by keyword go through a wrapper; routed layers keep their names."""
    class KeywordModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = build_attention("moh", C, H, shared_heads=2, topk=2)

        def forward(self, x, *, scale):
            return self.attn(x * scale)

    report = flop_report(KeywordModel(), (N, C), {"scale": torch.tensor(2.0), "unused": None})
    assert [layer.name for layer in report.layers] == ["attn"]
    assert report.flops == mha_flops(N, C, H, D) + moh_router_flops(N, C, H, 2, 2)
    assert report.active_flops == pytest.approx(report.flops - 0.5 * query_work(N, C, H, D), rel=1e-12)


def test_training_mode_and_routing_state_are_restored():
    model = timm.create_model("plain_vit_nano", attention="moh").train()
    with record_routing(model) as routing:  # counting inside a caller's recorder
        count_flops(model, (3, 32, 32))
    assert model.training
    assert list(routed_modules(model))
    for name, m in routed_modules(model):  # no per-forward state: only parameters, buffers and configuration
        leftover = [k for k, v in vars(m).items() if isinstance(v, torch.Tensor)]
        assert not leftover, (name, leftover)
    assert routing.records == [], "the traced forwards go to the counter's own recorder, not the caller's"


def test_a_custom_op_is_reported_until_it_has_a_handle(monkeypatch):
    """An op the counter does not know (here an autograd.Function) is never silently dropped."""
    from moh_vision.analysis import flop_count as flops

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * x * x

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Model(torch.nn.Module):
        def forward(self, x):
            return Cube.apply(x)

    report = flop_report(torch.nn.Sequential(torch.nn.Linear(C, C), Model()), (N, C))
    assert report.uncounted_ops == {"prim::PythonOp.Cube": 1}
    assert "prim::PythonOp.Cube x1" in report.as_dict()["uncounted_ops"]
    monkeypatch.setitem(flops._EXTRA_HANDLES, "prim::PythonOp.Cube", lambda inputs, outputs: 2 * N * C)
    report = flop_report(torch.nn.Sequential(torch.nn.Linear(C, C), Model()), (N, C))
    assert report.uncounted_ops == {} and report.flops == N * C * C + 2 * N * C


def test_free_ops_and_handles_do_not_overlap():
    assert not set(FREE_OPS) & set(op_handles())
    assert "aten::scaled_dot_product_attention" in op_handles()
    assert all(reason for reason in FREE_OPS.values())


# ---------------------------------------------------------------------------------------------
# tools/flops.py
# ---------------------------------------------------------------------------------------------
def test_tool_table(capsys, tmp_path):
    tool = load_tool("flops")
    rows = tool.main(["model=dit_tiny_2,plain_vit_nano", "attention=moh", "attention.activation_ratio=0.5",
                      f"out={tmp_path / 't.md'}"])
    printed = capsys.readouterr().out
    assert "| dit_tiny_2 | moh @0.5 | 16px |" in printed and "| plain_vit_nano | moh @0.5 | 32px |" in printed
    assert (tmp_path / "t.md").read_text() == printed
    record = json.loads((tmp_path / "t.json").read_text())  # the record docs/bench quotes from
    assert record["rows"] == rows and record["attention"]["activation_ratio"] == 0.5
    for row in rows:
        assert 0 < row["active_ratio"] < 1 and row["active_gflops"] < row["gflops"]
    csv_text = format_table(rows, "csv")
    assert csv_text.splitlines()[0] == ",".join(COLUMNS) and len(csv_text.splitlines()) == 3


@pytest.mark.parametrize("argv,message", [
    (["dit_b_2"], "key=value"), (["model=dit_b_2", "attention.activation_ratio=0.5"], "needs attention"),
    (["model=dit_b_2", "attention=moh", "attention.bogus=1"], "no option(s) bogus"),
    (["model=dit_b_2", "in_chans=0"], "in_chans=0: must be at least 1"),
    (["model=dit_b_2", "img_size=x"], "expected int")])
def test_tool_errors_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        load_tool("flops").main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_published_table_covers_dense_models_only():
    assert set(PUBLISHED_GFLOPS) <= set(list_models())
    assert not any(name.startswith("moh_") for name in PUBLISHED_GFLOPS)
    assert math.isclose(PUBLISHED_GFLOPS["dit_xl_2"], 118.64)


def test_tool_counts_the_input_channels_and_reads_them_from_a_run(tmp_path):
    """Digits runs are 1-channel: the tool must count what the run's summary.json reports."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moh_vision.models import build_model
    tool = load_tool("flops")
    one = tool.main(["model=transnext_nano", "in_chans=1"])[0]
    stem = build_model("transnext_nano", in_chans=1)
    assert one["gflops"] == pytest.approx(count_flops(stem, (1, 32, 32))["gflops"], rel=1e-12)
    assert "x1ch" in one["input"]

    # a run directory: its config.yaml (as train.py writes it) decides model, attention, channels and size
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["model=transnext_nano", "attention.activation_ratio=0.5"])
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    trained = build_model("transnext_nano", attention=OmegaConf.to_container(cfg.attention), in_chans=1,
                          img_size=32, num_classes=10)
    expected = count_flops(trained, (1, 32, 32))
    row = tool.main([f"run={tmp_path}"])[0]
    assert row["model"] == "transnext_nano" and row["attention"] == "moh @0.526 (requested 0.5)"
    assert row["gflops"] == pytest.approx(expected["gflops"], rel=1e-12)
    assert row["active_gflops"] == pytest.approx(expected["active_gflops"], rel=1e-12)
    assert parse_options(["model=transnext_nano", "data.in_chans=1"], tool.OPTIONS)[0]["in_chans"] == 1  # train.py's
    with pytest.raises(SystemExit):
        tool.main([f"run={tmp_path / 'nope'}"])


@pytest.mark.parametrize("name,attention,label", [
    ("transnext_nano", dict(name="moh", activation_ratio=0.75), "moh @0.789 (requested 0.75)"),
    ("transnext_nano", dict(name="random_heads", activation_ratio=0.75), "random_heads @0.789 (requested 0.75)"),
    ("plain_vit_nano", dict(name="moh", activation_ratio=0.5), "moh @0.5"),           # realised = requested
    ("plain_vit_nano", dict(name="moh", activation_ratio=0.9), "moh @1 (requested 0.9)"),  # 0.9 of 4 heads: all
    ("transnext_nano", dict(name="moa", topk=1), "moa @0.263"),                         # explicit heads: realised
    ("moh_transnext_small_80", None, "moh @0.8 (preset)"),
    ("plain_vit_nano", dict(name="mha"), "mha"),
])
def test_flops_labels_say_realised_and_requested_ratio_the_same_way_for_every_variant(name, attention, label):
    from moh_vision.apps.flops_table import attention_label
    from moh_vision.models import build_model
    with torch.device("meta"):
        model = build_model(name, attention=attention)
    assert attention_label(model, attention) == label
