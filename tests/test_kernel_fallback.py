"""A kernel that fails on its first call on a device (a Triton kernel that does not compile or launch) falls back to the
op's reference formula for the rest of the run, with one warning naming the op, the implementation and the error's
first line, and ``summary.json`` says what ran (``kernels_ran``, ``kernel_fallbacks``); an error the formula raises too
is the caller's and is raised as it was. The failures are made on the CPU: an implementation (or an operator's kernel)
replaced by one that raises as Triton does when it cannot compile, in a test of the kernels and in a real ``train.py``
run."""
import dataclasses
import json
import logging

import pytest
import timm
import torch
from helpers import FAST_TRAIN, read_summary

from moh_vision.attention import record_routing
from moh_vision.ops import OPS, depthwise_conv
from moh_vision.ops import aggregated as ops_aggregated
from moh_vision.ops.depthwise import depthwise_conv_reference
from moh_vision.ops.dispatch import RUNS

pytestmark = pytest.mark.usefixtures("one_thread")
DISPATCH_LOG = "moh_vision.ops.dispatch"
COMPILE_ERROR = "CompilationError: at 12:8: ptxas fatal: unresolved extern function\nsecond line, not in the warning"


@pytest.fixture(autouse=True)
def fresh_record():
    RUNS.reset()
    yield
    RUNS.reset()


class Failing:
    """A kernel that raises (``error``; by default a two-line compile error) at every call, counting the calls."""

    def __init__(self, error=None):
        self.calls, self.error = 0, error

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise self.error if self.error is not None else RuntimeError(COMPILE_ERROR)


def failing_impl(monkeypatch, op: str, name: str, error=None) -> Failing:
    """Implementation ``name`` of ``op`` made to fail (for this test)."""
    kernel = Failing(error)
    impls = OPS[op].impls
    monkeypatch.setitem(impls, name, dataclasses.replace(impls[name], fn=kernel))
    return kernel


def conv_inputs(channels=6, height=4, width=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, height * width, channels, generator=g), torch.randn(channels, 1, 3, 3, generator=g),
            torch.randn(channels, generator=g), height, width)


def fallback_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == DISPATCH_LOG and r.levelno == logging.WARNING]


def test_a_failing_kernel_gives_the_formulas_result_warns_once_and_is_not_tried_again(monkeypatch, caplog):
    kernel = failing_impl(monkeypatch, "depthwise_conv", "channels_last")  # the CPU's auto pick
    x, weight, bias, H, W = conv_inputs()
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        outs = [depthwise_conv(x, weight, bias, H, W) for _ in range(3)]
    expected = depthwise_conv_reference(x, weight, bias, H, W)
    assert all(torch.equal(out, expected) for out in outs)
    assert kernel.calls == 1, "later calls run the formula without trying the kernel"
    (line,) = fallback_warnings(caplog)
    assert "depthwise_conv" in line and "channels_last" in line and "\n" not in line
    assert "RuntimeError: CompilationError: at 12:8: ptxas fatal" in line and "second line" not in line
    assert RUNS.fallbacks("cpu") == {"depthwise_conv": {
        "channels_last": "RuntimeError: CompilationError: at 12:8: ptxas fatal: unresolved extern function"}}
    assert RUNS.kernels_ran("cpu") == {"depthwise_conv": ["reference"]}
    assert RUNS.kernels_ran("cuda") == {} and RUNS.fallbacks("cuda") == {}, "per device"


def test_an_explicit_choice_falls_back_too_and_a_working_kernel_is_recorded(monkeypatch, caplog):
    failing_impl(monkeypatch, "depthwise_conv", "written_grad")
    x, weight, bias, H, W = conv_inputs()
    depthwise_conv(x, weight, bias, H, W)  # auto: channels_last, which works
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        out = depthwise_conv(x, weight, bias, H, W, kernel="written_grad")
    assert torch.equal(out, depthwise_conv_reference(x, weight, bias, H, W))
    assert len(fallback_warnings(caplog)) == 1
    assert RUNS.kernels_ran("cpu") == {"depthwise_conv": ["channels_last", "reference"]}
    assert list(RUNS.fallbacks("cpu")["depthwise_conv"]) == ["written_grad"]


def test_wrong_shapes_are_the_callers_error_not_a_kernel_failure(monkeypatch, caplog):
    x, weight, bias, H, W = conv_inputs()
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        with pytest.raises(RuntimeError, match="shape"):  # the working kernel: N != H * W
            depthwise_conv(x, weight, bias, H + 1, W)
        kernel = failing_impl(monkeypatch, "depthwise_conv", "channels_last", error=ValueError("kernel: bad shape"))
        with pytest.raises(ValueError, match="kernel: bad shape"):  # the formula rejects it too: the kernel's error
            depthwise_conv(x, weight, bias, H + 1, W)
    assert fallback_warnings(caplog) == [] and RUNS.fallbacks("cpu") == {}
    assert kernel.calls == 1
    depthwise_conv(x, weight, bias, H, W)  # right shapes: still its first good call, so a failure now falls back
    assert kernel.calls == 2 and list(RUNS.fallbacks("cpu")) == ["depthwise_conv"]


def test_running_out_of_memory_is_not_a_kernel_failure(monkeypatch):
    failing_impl(monkeypatch, "depthwise_conv", "channels_last", error=torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        depthwise_conv(*conv_inputs())
    assert RUNS.fallbacks("cpu") == {}


def test_a_training_step_with_checkpointing_falls_back_and_equals_the_formulas(monkeypatch, caplog):
    """MoH TransNeXt-nano with gradient checkpointing, its ConvGLU tails' kernel failing: the first block's forward
    falls back, its recomputation in backward makes the same choice (torch's checkpoint counts the saved tensors),
    and loss and gradients are those of ``kernels.recompute=reference``."""
    torch.manual_seed(0)
    model = timm.create_model("transnext_nano", attention="moh", activation_ratio=0.5, in_chans=1, img_size=32,
                              num_classes=10).train()
    model.set_grad_checkpointing(True)
    reference = timm.create_model("transnext_nano", attention="moh", activation_ratio=0.5, in_chans=1, img_size=32,
                                  num_classes=10, kernels={"recompute": "reference"}).train()
    reference.load_state_dict(model.state_dict())  # the same weights, every tail on its formula
    reference.set_grad_checkpointing(True)
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    kernel = failing_impl(monkeypatch, "gated_tail", "recompute")
    results = []
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        for net in (model, reference):
            torch.manual_seed(2)
            with record_routing(net) as routing:
                loss = net(x).square().mean() + routing.aux_loss(coef=0.01)
            loss.backward()
            results.append((loss.detach(), [p.grad for p in net.parameters()]))
    assert kernel.calls == 1
    assert len(fallback_warnings(caplog)) == 1
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    for ours, theirs in zip(results[0][1], results[1][1]):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_aggregated_operators_kernels_take_their_formulas_forward_and_backward(monkeypatch, caplog):
    """The operator's own kernels (what a compiled graph and backward call) fall back inside the operator."""
    if not ops_aggregated.cpu_kernels_available():
        pytest.skip("no C++ compiler: the operator runs its formulas anyway")
    forward, backward = Failing(), Failing()
    monkeypatch.setattr(ops_aggregated, "_cpu_forward", forward)
    monkeypatch.setattr(ops_aggregated, "_cpu_backward", backward)
    g = torch.Generator().manual_seed(0)
    B, h, H, W, d, P, window = 1, 2, 4, 4, 8, 4, 3
    N, L = H * W, window * window
    shapes = [(B, h, N, d), (B, h, N, d), (B, h, N, d), (B, h, P, d), (B, h, P, d), (h, N, P), (h, L), (B, h, N, L)]
    inputs = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    grads = []
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        for fn in (ops_aggregated.aggregated_attention_fused, ops_aggregated.aggregated_attention_reference):
            for _ in range(2):
                out = fn(*inputs, (H, W), window)
                grads.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    assert (forward.calls, backward.calls) == (1, 1)
    assert len(fallback_warnings(caplog)) == 2
    assert set(RUNS.fallbacks("cpu")["aggregated_attention"]) == {"fused forward kernel", "fused backward kernel"}
    for out, grad in grads[:2]:
        torch.testing.assert_close(out, grads[2][0])
        for ours, theirs in zip(grad, grads[2][1]):
            torch.testing.assert_close(ours, theirs)


# The routing's Triton forward in the interpreter, its backward kernel failing: the gradients of the formulas
# (run by tests/test_triton_interpreter.py, last: it replaces the backward kernel in its process)
ROUTING_BACKWARD_SCRIPT = r"""
import logging, sys
sys.path.insert(0, sys.argv[1])
import torch
from moh_vision.ops import routing_triton as kernels
from moh_vision.ops.dispatch import RUNS
from moh_vision.ops.routing import route_merge_reference

calls = []
def failing(*args):
    calls.append(1)
    raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared memory\nmore")
kernels._backward_kernel = failing
records = []
logging.getLogger("moh_vision.ops.dispatch").addHandler(logging.Handler())
logging.getLogger("moh_vision.ops.dispatch").handlers[-1].emit = records.append
g = torch.Generator().manual_seed(0)
heads, shared, topk = 6, 2, 2
B, N, d, L = 2, 5, 4, 4 + 2 + 2
for step in range(2):
    h = torch.randn(B, heads, N, d, generator=g, requires_grad=True)
    z = torch.randn(B, N, L, generator=g, requires_grad=True)
    merged, _, _, _, _, loss = kernels.triton_route_merge(h, z, heads - shared, shared, topk, True,
                                                               formula=route_merge_reference)
    fused = torch.autograd.grad((merged.square().sum(), loss), (h, z))
    m, routing = route_merge_reference(h, z, heads - shared, shared, topk, True)
    formula = torch.autograd.grad((m.square().sum(), routing.loss), (h, z))
    for ours, theirs in zip(fused, formula):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)  # the kernel's forward is not the formulas'
assert len(calls) == 1, calls
assert len(records) == 1 and "moh_routing" in records[0].getMessage() and "OutOfResources" in records[0].getMessage()
assert list(RUNS.fallbacks("cpu")["moh_routing"]) == ["fused backward kernel"]
"""


def test_a_train_py_run_reports_the_fallback_in_summary_json(tmp_path, monkeypatch, train_in_process):
    """The default run (MoH TransNeXt-nano on the digits, CPU), its depthwise convolution's kernel and the aggregated
    attention's backward kernel failing: the run trains, warns once for each in its log, and summary.json says what
    ran."""
    out = tmp_path / "run"
    injected = lambda target: RuntimeError(f"injected failure of {target}\n(a second line)")  # noqa: E731
    failing_impl(monkeypatch, "depthwise_conv", "channels_last", injected("depthwise_conv/channels_last"))
    monkeypatch.setattr(ops_aggregated, "_cpu_backward", Failing(injected("_cpu_backward")))
    assert train_in_process(*FAST_TRAIN, "trainer.count_flops=false", f"hydra.run.dir={out}")[0] == 0
    summary = read_summary(out)
    warnings = [line for line in (out / "train.log").read_text().splitlines() if "kernel fallback" in line]
    assert len(warnings) == 2, warnings
    assert summary["steps"] == 3
    assert summary["kernel_fallbacks"]["depthwise_conv"] == {
        "channels_last": "RuntimeError: injected failure of depthwise_conv/channels_last"}
    ran = summary["kernels_ran"]
    assert ran["depthwise_conv"] == ["reference"] and ran["aggregated_attention"] == ["fused"]
    assert ran["moh_routing"] == ["reference"]
    if ops_aggregated.cpu_kernels_available():
        assert list(summary["kernel_fallbacks"]["aggregated_attention"]) == ["fused backward kernel"]
    json.dumps(summary)  # plain JSON


def test_the_gpu_checks_step_of_each_recipe_runs_on_the_cpu_and_records_what_ran(tmp_path, monkeypatch):
    """``tools/gpu_checks.sh`` part ``steps`` (``moh_vision.apps.step_check``), as its ``quick`` dry run: each recipe
    with a tiny model (the recipe's AMP, scaler, clipping, EMA, mixup and task kept), a warm-up step and the checked
    step (CUDA's sync debug mode needs CUDA: on the CPU the steps just run); with a kernel failing, the record names
    the fallback, and a recipe that cannot be built is a failed entry, not a crash."""
    from moh_vision.apps import step_check
    failing_impl(monkeypatch, "depthwise_conv", "channels_last")
    out = tmp_path / "steps.json"
    status = step_check.main([str(out), "2",
                              "moh_transnext_small_80+model=transnext_nano+attention=moh+data.img_size=32",
                              "moh_dit_xl_2_90+model=dit_tiny_2+attention=moh", "moh_dit_xl_2_90+model=no_such_model"])
    classification, diffusion, broken = json.loads(out.read_text())
    assert status == 1 and (classification["passed"], diffusion["passed"], broken["passed"]) == (True, True, False)
    assert classification["amp"] == "fp16" and diffusion["ema"] and diffusion["task"] == "diffusion"
    assert classification["sync_debug_mode"] is None and classification["stage"] == "done"
    assert classification["kernels_ran"]["depthwise_conv"] == ["reference"]
    assert list(classification["kernel_fallbacks"]) == ["depthwise_conv"]
    assert classification["kernels_ran"]["moh_routing"] == ["reference"] and "aggregated_attention" in \
        classification["kernels_ran"]
    assert diffusion["kernels_ran"] == {"moh_routing": ["reference"]} and diffusion["kernel_fallbacks"] == {}
    assert broken["stage"] == "build" and broken["error"] and "Traceback" in broken["stack"]
