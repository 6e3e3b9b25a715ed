"""The attention registry and the three variants: behaviour that a wrong implementation would break."""
import math

import pytest
import torch
from torch import nn

from moh_vision.attention import (AttentionVariant, build_attention, list_attention, record_routing,
                                  register_attention)
from moh_vision.attention import registry as registry_module
from moh_vision.attention.routing import resolve_moh_heads
from moh_vision.errors import ConfigError


def copy_dense_weights(dst, src):
    with torch.no_grad():
        dst.qkv.weight.copy_(src.qkv.weight)
        dst.qkv.bias.copy_(src.qkv.bias)
        dst.proj.weight.copy_(src.proj.weight)
        dst.proj.bias.copy_(src.proj.bias)


def zero_router(m):
    with torch.no_grad():
        for name in ("wg", "wg_0", "wg_1"):
            if hasattr(m, name):
                getattr(m, name).weight.zero_()


def randomise_router(m, scale=1.0):
    with torch.no_grad():
        for name in ("wg", "wg_0", "wg_1"):
            if hasattr(m, name):
                getattr(m, name).weight.normal_(0, scale)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------
def test_builtin_names_in_order():
    assert list_attention()[:3] == ["mha", "moh", "moa"]


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError) as err:
        build_attention("flash", 64, 4)
    msg = str(err.value)
    assert "flash" in msg and "mha" in msg and "moh" in msg and "moa" in msg and "\n" not in msg


@pytest.mark.parametrize("name,kwargs,fragment", [
    ("mha", dict(num_heads=5), "does not divide dim=64"),
    ("moh", dict(num_heads=4, shared_heads=5, topk=0), "outside 0..num_heads=4"),
    ("moh", dict(num_heads=8, shared_heads=2, topk=7), "exceeds the routed pool"),
    ("moh", dict(num_heads=4, activation_ratio=0.0), "outside (0, 1]"),
    ("moh", dict(num_heads=4, activation_ratio=1.5), "outside (0, 1]"),
    ("moh", dict(num_heads=4, shared_heads=2, topk=0), "topk=0 routes nothing"),
    ("moa", dict(num_heads=4, topk=5), "outside 1..num_experts=4"),
    ("mha", dict(num_heads=4, activation_ratio=0.5), "unknown option(s) activation_ratio"),
])
def test_invalid_options_give_one_line_errors(name, kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        build_attention(name, 64, **kwargs)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_head_dim_decouples_width_from_heads():
    m = build_attention("moh", 48, 5, head_dim=8, shared_heads=2, topk=2)
    assert m.qkv.out_features == 3 * 40 and m.proj.in_features == 40
    assert m(torch.randn(2, 7, 48)).shape == (2, 7, 48)


def test_new_variant_registers_and_builds():
    @register_attention("test_halfheads")
    class HalfHeads(AttentionVariant):
        def forward(self, x):
            o = self.heads(x)
            gates = x.new_ones(*x.shape[:-1], self.num_heads)
            gates[..., self.num_heads // 2:] = 0
            return self.output(o, gates)

    try:
        assert "test_halfheads" in list_attention()
        m = build_attention("test_halfheads", 32, 4)
        assert m(torch.randn(1, 3, 32)).shape == (1, 3, 32)
    finally:
        registry_module._VARIANTS.pop("test_halfheads")


# ---------------------------------------------------------------------------------------------
# MoH
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads,shared,topk", [(4, 0, 4), (4, 1, 3), (6, 2, 4), (6, 6, 0), (8, 3, 5)])
def test_moh_with_zero_router_and_all_heads_equals_mha(num_heads, shared, topk):
    torch.manual_seed(0)
    dense = build_attention("mha", 48, num_heads)
    moh = build_attention("moh", 48, num_heads, shared_heads=shared, topk=topk)
    copy_dense_weights(moh, dense)
    zero_router(moh)
    x = torch.randn(3, 11, 48)
    torch.testing.assert_close(moh(x), dense(x), rtol=1e-5, atol=1e-6)


def test_moh_ratio_one_is_dense_weighted_and_equals_mha_at_zero_router():
    dense = build_attention("mha", 32, 4)
    moh = build_attention("moh", 32, 4, activation_ratio=1.0)
    assert (moh.shared_heads, moh.topk) == (4, 0) and hasattr(moh, "wg_1") and not hasattr(moh, "wg")
    copy_dense_weights(moh, dense)
    zero_router(moh)
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(moh(x), dense(x), rtol=1e-5, atol=1e-6)


def _head_rows(m, head):
    """Row slices of qkv (q, k, v) and column slice of proj that belong to one head."""
    d, inner = m.head_dim, m.inner_dim
    rows = [slice(part * inner + head * d, part * inner + (head + 1) * d) for part in range(3)]
    return rows, slice(head * d, (head + 1) * d)


def test_unselected_head_does_not_affect_token_but_selected_does():
    torch.manual_seed(1)
    m = build_attention("moh", 32, 8, shared_heads=2, topk=2).eval()
    randomise_router(m)
    x = torch.randn(1, 16, 32)
    index = m.route(x).index
    routed_pool = m.num_heads - m.shared_heads
    token = 5
    chosen = set((index[0, token] + m.shared_heads).tolist())
    unchosen = [h for h in range(m.shared_heads, m.num_heads) if h not in chosen]
    assert len(unchosen) == routed_pool - 2

    base = m(x)
    for head, expect_change in [(unchosen[0], False), (sorted(chosen)[0], True), (0, True)]:
        edited = build_attention("moh", 32, 8, shared_heads=2, topk=2).eval()
        edited.load_state_dict(m.state_dict())
        rows, cols = _head_rows(edited, head)
        with torch.no_grad():
            for r in rows:
                edited.qkv.weight[r] += 0.5
            edited.proj.weight[:, cols] += 0.5
        out = edited(x)
        changed = not torch.allclose(out[0, token], base[0, token], atol=1e-6)
        assert changed == expect_change, f"head {head}: expected change={expect_change}"


def test_gates_sum_and_load_balance_loss_by_hand():
    torch.manual_seed(2)
    h, h_s, k = 6, 2, 2
    m = build_attention("moh", 24, h, shared_heads=h_s, topk=k).train()
    randomise_router(m)
    x = torch.randn(2, 5, 24)
    with record_routing(m) as routing:
        gates = m.route(x).gates
    (record,) = routing.records

    # by hand from the router weights
    flat = x.reshape(-1, 24)
    p = torch.softmax(flat @ m.wg.weight.T, dim=-1)
    top = p.topk(k, dim=-1).indices
    mask = torch.zeros_like(p).scatter(1, top, 1.0)
    mix = 2 * torch.softmax(flat @ m.wg_0.weight.T, dim=-1)
    expected_sum = h_s * mix[:, 0] + k * mix[:, 1]
    torch.testing.assert_close(gates.reshape(-1, h).sum(-1), expected_sum)
    E = h - h_s
    loss = E * (p.mean(0) * mask.mean(0)).sum()
    torch.testing.assert_close(record.aux_loss, loss)
    # the official formula written the official way
    torch.testing.assert_close(record.aux_loss, torch.mean(p.mean(0) * mask.mean(0)) * E * E)
    # unselected routed heads have gate exactly zero
    routed_gates = gates.reshape(-1, h)[:, h_s:]
    assert torch.equal(routed_gates > 0, mask.bool())


def test_shared_only_single_head_gate_is_mix_weight():
    m = build_attention("moh", 16, 4, shared_heads=1, topk=2)
    assert not hasattr(m, "wg_1")
    randomise_router(m)
    x = torch.randn(1, 3, 16)
    gates = m.route(x).gates
    mix = 2 * torch.softmax(x @ m.wg_0.weight.T, dim=-1)
    torch.testing.assert_close(gates[..., 0], mix[..., 0])


def test_explicit_topk_wins_over_activation_ratio():
    # the YAMLs keep activation_ratio=0.75, so attention.shared_heads=2 attention.topk=2 must not need it nulled
    moh = build_attention("moh", 64, 8, activation_ratio=0.75, shared_heads=2, topk=2)
    assert (moh.shared_heads, moh.topk, moh.active_heads()) == (2, 2, 4)
    moa = build_attention("moa", 64, 8, activation_ratio=0.75, topk=3)
    assert (moa.topk, moa.active_heads()) == (3, 3)
    assert build_attention("moa", 64, 8, activation_ratio=0.5).topk == 4


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.6, 0.75, 0.8, 0.9, 1.0])
def test_activation_ratio_policy_realises_request(num_heads, ratio):
    shared, topk = resolve_moh_heads(num_heads, activation_ratio=ratio)
    assert 0 <= shared <= num_heads and 0 <= topk <= num_heads - shared
    realised = (shared + topk) / num_heads
    assert abs(realised - ratio) <= 1.0 / num_heads + 1e-9 or shared + topk == 1
    if ratio == 1.0:
        assert (shared, topk) == (num_heads, 0)


def test_aux_loss_reaches_the_recorder_and_reduces_as_official_mean():
    torch.manual_seed(3)
    a = nn.Sequential(build_attention("moh", 16, 4, shared_heads=1, topk=2),
                      build_attention("moh", 16, 4, shared_heads=4, topk=0),
                      build_attention("moh", 16, 8, shared_heads=2, topk=3)).train()
    b = build_attention("moh", 16, 4, shared_heads=1, topk=2).train()
    for m in list(a) + [b]:
        randomise_router(m)
    x = torch.randn(2, 7, 16)
    with record_routing(a) as routing:
        a(x)
    with record_routing(b) as other:
        b(x)
    assert [r.module for r in other.records] == [b], "a closed recorder must not see later forwards"
    assert all(r.module is not b for r in routing.records), "one model's recorder must not see another's"
    by_name = {name: record for name, record in routing.named_records()}
    assert set(by_name) == {"0", "1", "2"}
    layer_losses = [by_name["0"].aux_loss, by_name["2"].aux_loss]
    assert by_name["1"].aux_loss is None  # nothing routed in a dense-weighted layer
    torch.testing.assert_close(routing.aux_loss(), 0.01 * torch.stack(layer_losses).mean())
    torch.testing.assert_close(routing.aux_loss(coef=0.5), 0.5 * torch.stack(layer_losses).mean())
    # outside a recorder nothing is recorded, and nothing is left on the modules
    a(x)
    for m in list(a) + [b]:
        assert not any(isinstance(v, torch.Tensor) for k, v in vars(m).items() if not k.startswith("_")), vars(m)
    a.eval()
    with record_routing(a) as routing:
        a(x)
    assert len(routing.records) == 3 and all(r.aux_loss is None for r in routing.records)
    assert routing.aux_loss().item() == 0.0


def test_moh_and_moa_losses_reduce_per_variant():
    """Official totals: MoH layers' losses are averaged, MoA layers' losses are summed; a model
    mixing both adds the two parts."""
    torch.manual_seed(8)
    m = nn.Sequential(build_attention("moh", 16, 4, shared_heads=1, topk=2),
                      build_attention("moh", 16, 8, shared_heads=2, topk=3),
                      build_attention("moa", 16, 4, topk=2), build_attention("moa", 16, 4, topk=3)).train()
    for layer in m:
        randomise_router(layer)
    with torch.no_grad():
        m[2].w_gate.weight.normal_()
        m[3].w_gate.weight.normal_()
    with record_routing(m) as routing:
        m(torch.randn(2, 7, 16))
    losses = {name: record.aux_loss for name, record in routing.named_records()}
    expected = torch.stack([losses["0"], losses["1"]]).mean() + losses["2"] + losses["3"]
    torch.testing.assert_close(routing.aux_loss(coef=0.01), 0.01 * expected)


def test_routing_stats_load_sums_to_active_heads():
    m = nn.Sequential(build_attention("moh", 16, 8, shared_heads=3, topk=2),
                      build_attention("moa", 16, 4, topk=3))
    for layer in m:
        randomise_router(layer)
    with torch.no_grad():
        m[1].w_gate.weight.normal_()
    with record_routing(m) as routing:
        m(torch.randn(2, 10, 16))
    stats = routing.stats()
    assert set(stats) == {"0", "1"}
    assert math.isclose(stats["0"]["load"].sum().item(), 5.0, rel_tol=1e-5)
    assert math.isclose(stats["1"]["load"].sum().item(), 3.0, rel_tol=1e-5)
    assert (stats["0"]["active_heads"], stats["1"]["active_heads"]) == (5, 3)
    assert torch.all(stats["0"]["load"][:3] == 1.0)
    ent = stats["0"]["entropy"].item()
    assert 0.0 < ent <= math.log(5) + 1e-6


# ---------------------------------------------------------------------------------------------
# MoA
# ---------------------------------------------------------------------------------------------
def test_moa_identical_experts_all_selected_is_single_head_attention():
    torch.manual_seed(4)
    dim, E, d = 24, 4, 6
    m = build_attention("moa", dim, E, topk=E)
    with torch.no_grad():
        wq, wo = torch.randn(d, dim), torch.randn(dim, d)
        m.q_proj.weight.copy_(wq.repeat(E, 1))
        m.proj.weight.copy_(wo.repeat(1, E))
        m.w_gate.weight.normal_()  # any router: all experts are selected and gates sum to 1
    x = torch.randn(2, 9, dim)
    kv = m.kv_proj(x)
    k, v = kv[..., :d], kv[..., d:]
    q = x @ wq.T
    attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
    expected = (attn @ v) @ wo.T
    torch.testing.assert_close(m(x), expected, rtol=1e-4, atol=1e-5)


def test_moa_aux_losses_by_hand():
    torch.manual_seed(5)
    E, k = 5, 2
    m = build_attention("moa", 20, E, topk=k, switch_weight=1.0, zloss_weight=0.0).train()
    with torch.no_grad():
        m.w_gate.weight.normal_()
    x = torch.randn(3, 4, 20)
    with record_routing(m) as routing:
        m(x)
    logits = x.reshape(-1, 20) @ m.w_gate.weight.T
    p = logits.softmax(-1)
    top = p.topk(k, dim=-1).indices
    counts = torch.zeros(E).index_add_(0, top.reshape(-1), torch.ones(top.numel()))
    switch = E * (p.mean(0) * counts / counts.sum()).sum()
    torch.testing.assert_close(routing.records[0].aux_loss, switch)

    m.switch_weight, m.zloss_weight = 0.0, 1.0
    with record_routing(m) as routing:
        m(x)
    z = (torch.log(torch.exp(logits).sum(dim=1)) ** 2).mean()
    torch.testing.assert_close(routing.records[0].aux_loss, z)


def test_moa_shared_key_value_projection_has_no_bias_by_default():
    # the released MoA code has no bias on the shared key/value head; kv_bias=True restores one
    assert build_attention("moa", 16, 4, topk=2).kv_proj.bias is None
    assert build_attention("moa", 16, 4, topk=2, kv_bias=True).kv_proj.bias is not None


def test_moa_zero_router_is_uniform_and_noisy_gating_only_in_training():
    m = build_attention("moa", 16, 4, topk=2, noisy_gating=True)
    assert torch.count_nonzero(m.w_gate.weight) == 0
    with torch.no_grad():
        m.w_noise.weight.normal_()
    x = torch.randn(1, 6, 16)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    m.train()
    torch.manual_seed(0)
    y1 = m(x)
    torch.manual_seed(1)
    y2 = m(x)
    assert not torch.allclose(y1, y2)


# ---------------------------------------------------------------------------------------------
# All variants
# ---------------------------------------------------------------------------------------------
VARIANTS = [("mha", {}), ("moh", dict(shared_heads=1, topk=2)), ("moh", dict(activation_ratio=1.0)),
            ("moa", dict(topk=2))]


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_fused_and_manual_paths_agree(name, opts):
    torch.manual_seed(6)
    fused = build_attention(name, 32, 4, fused_attn=True, **opts)
    manual = build_attention(name, 32, 4, fused_attn=False, **opts)
    manual.load_state_dict(fused.state_dict())
    for m in (fused, manual):
        randomise_router(m)
    manual.load_state_dict(fused.state_dict())
    x = torch.randn(2, 13, 32)
    torch.testing.assert_close(fused(x), manual(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_gradients_reach_every_parameter_including_routers(name, opts):
    torch.manual_seed(7)
    m = build_attention(name, 32, 4, **opts).train()
    randomise_router(m)
    if name == "moa":
        with torch.no_grad():
            m.w_gate.weight.normal_()
    x = torch.randn(2, 10, 32, requires_grad=True)
    with record_routing(m) as routing:
        y = m(x)
    loss = y.square().mean() + routing.aux_loss(coef=1.0)
    loss.backward()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"no gradient reached {pname}"


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_bfloat16_autocast_forward_backward(name, opts):
    m = build_attention(name, 32, 4, **opts).train()
    x = torch.randn(2, 10, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with record_routing(m) as routing:
            y = m(x)
        loss = y.float().square().mean() + routing.aux_loss()
    loss.backward()
    assert y.dtype == torch.bfloat16
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("options", [dict(activation_ratio=0.75), dict(activation_ratio=0.75, shared_heads="learned"),
                                     dict(shared_heads=1, topk=2)])
def test_routers_are_called_as_the_modules_they_are(options):
    """A MoH layer's routers (wg, wg_0, wg_1) run as their modules, eagerly and traced (a FLOP-counting trace
    attributes by child module): a hook on a router fires, and the layer's output is what its routers' logits give."""
    torch.manual_seed(0)
    m = build_attention("moh", 48, 6, **options)
    randomise_router(m)
    x = torch.randn(2, 10, 48)
    calls = []
    for name, router in m.routers():
        router.register_forward_hook((lambda n: lambda *_: calls.append(n))(name))
    names = sorted(name for name, _ in m.routers())
    assert len(names) >= 2
    m(x)
    assert sorted(calls) == names
    calls.clear()
    torch.jit.trace(m.eval(), (x,), check_trace=False)
    assert sorted(calls) == names


@pytest.mark.parametrize("name,opts", [("moh", dict(activation_ratio=0.75)), ("moh", dict(activation_ratio=1.0)),
                                       ("moh", dict(activation_ratio=0.5, shared_heads="learned")), ("moa", {})])
def test_routed_layers_compile_as_one_graph(name, opts):
    """``trainer.compile=true``: a routed layer (default kernels) traces as one graph, with no break at the gated
    head merge or the kernel dispatch, and computes what eager does."""
    torch.manual_seed(0)
    m = build_attention(name, 32, 4, **opts)
    randomise_router(m)
    x = torch.randn(2, 9, 32)

    def run(fn):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.square().sum().backward()
        grads = [xi.grad] + [p.grad.clone() for p in m.parameters() if p.grad is not None]
        m.zero_grad(set_to_none=True)
        return y, grads

    torch._dynamo.reset()
    compiled = run(torch.compile(m, fullgraph=True, backend="aot_eager"))  # fullgraph: a break raises
    eager = run(m)
    torch.testing.assert_close(compiled[0], eager[0])
    assert len(compiled[1]) == len(eager[1])
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e)


def test_compile_captures_the_recorder_in_the_graph():
    """With a recorder open, the compiled layer still hands over its aux loss (the recorder lookup is traced,
    not a graph break: fullgraph), equal to eager's."""
    torch.manual_seed(0)
    m = build_attention("moh", 32, 4, activation_ratio=0.5)
    randomise_router(m)
    x = torch.randn(2, 9, 32)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    losses = []
    for fn in (compiled, m):
        with record_routing(m) as routing:
            fn(x)
        losses.append(routing.aux_loss(coef=1.0))
    assert losses[0].item() > 0
    torch.testing.assert_close(losses[0], losses[1])
