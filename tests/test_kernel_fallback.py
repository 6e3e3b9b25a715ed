"""An implementation that fails (raises where the op's formula, on the same arguments, does not: a kernel that does not
compile or launch) falls back to the formula for the rest of the process, with one warning naming the op, the
implementation and the error's first line; ``summary.json``'s ``kernels_in_use`` says so. In an eager call, in the
aggregated attention's operator (so in a compiled graph too) and in a backward (the formula's gradients for that call).
An error the formula raises too, running out of memory and the package's one-line errors are raised as they were.
The failures are injected into the CPU's implementations (``tests/failing_kernels.py`` for a real ``train.py``)."""
import dataclasses
import logging

import pytest
import torch
from helpers import FAST_TRAIN, read_summary, run_entry, run_in_triton_interpreter

from moh_vision.errors import ConfigError
from moh_vision.ops import (OPS, Kernels, aggregated_attention, aggregated_attention_reference, depthwise_conv,
                            failures, kernels_in_use, reset_failures)
from moh_vision.ops import aggregated as ops_aggregated

pytestmark = pytest.mark.usefixtures("one_thread")
DISPATCH_LOG = "moh_vision.ops.dispatch"


@pytest.fixture(autouse=True)
def no_failures_before_or_after():
    reset_failures()
    yield
    reset_failures()


class Failing:
    """A kernel that raises a two-line error (or ``error``) on every call, counting them."""

    def __init__(self, error=None):
        self.calls, self.error = 0, error

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise self.error or RuntimeError("PTX JIT compilation failed: ptxas fatal\nsecond line, not in the warning")


def failing_impl(monkeypatch, op: str, name: str, error=None) -> Failing:
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


def test_a_failing_kernel_gives_the_formulas_result_says_so_once_and_is_not_tried_again(monkeypatch, caplog):
    kernel = failing_impl(monkeypatch, "depthwise_conv", "channels_last")  # the CPU's auto pick
    x, weight, bias, H, W = conv_inputs()
    expected = OPS["depthwise_conv"].reference.fn(x, weight, bias, H, W)
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        for _ in range(3):
            torch.testing.assert_close(depthwise_conv(x, weight, bias, H, W), expected, rtol=0, atol=0)
    assert kernel.calls == 1, "a failed implementation is not tried again"
    [warning] = fallback_warnings(caplog)
    assert "depthwise_conv: implementation channels_last (kernels.depthwise=auto's pick) failed (RuntimeError: PTX " \
           "JIT compilation failed: ptxas fatal)" in warning and "second line" not in warning
    line = "reference (channels_last failed: RuntimeError: PTX JIT compilation failed: ptxas fatal)"
    assert kernels_in_use(Kernels(), "cpu")["depthwise_conv"] == line
    assert kernels_in_use(Kernels(), "cpu")["aggregated_attention"] == "fused", "the other ops are untouched"
    assert kernels_in_use(Kernels(depthwise="reference"), "cpu")["depthwise_conv"] == "reference"
    assert failures() == {"depthwise_conv": {"channels_last": line[len("reference (channels_last failed: "):-1]}}
    assert OPS["depthwise_conv"].choose("auto", x).name == "reference"


def test_an_explicit_choice_falls_back_too_and_the_warning_says_it_was_asked_for(monkeypatch, caplog):
    kernel = failing_impl(monkeypatch, "depthwise_conv", "written_grad")
    x, weight, bias, H, W = conv_inputs()
    x.requires_grad_()
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        out = depthwise_conv(x, weight, bias, H, W, kernel="written_grad")
        out.sum().backward()  # the formula's graph
        depthwise_conv(x, weight, bias, H, W, kernel="written_grad")
    torch.testing.assert_close(out, OPS["depthwise_conv"].reference.fn(x, weight, bias, H, W))
    assert kernel.calls == 1 and x.grad is not None
    [warning] = fallback_warnings(caplog)
    assert "implementation written_grad (asked for explicitly: kernels.depthwise=written_grad) failed" in warning
    assert kernels_in_use(Kernels(depthwise="written_grad"), "cpu")["depthwise_conv"].startswith(
        "reference (written_grad failed: RuntimeError: PTX JIT")


@pytest.mark.parametrize("case", ["input the formula rejects too", "out of memory", "a one-line error"])
def test_what_is_not_a_kernels_failure_is_raised_as_the_kernel_raised_it(monkeypatch, caplog, case):
    x, weight, bias, H, W = conv_inputs()
    error = {"input the formula rejects too": RuntimeError("the kernel's own message"),
             "out of memory": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
             "a one-line error": ConfigError("kernels.depthwise=channels_last needs channels in multiples of 8")}[case]
    kernel = failing_impl(monkeypatch, "depthwise_conv", "channels_last", error)
    if case == "input the formula rejects too":
        weight = torch.randn(7, 1, 3, 3)  # 7 filters for 6 channels: F.conv2d refuses
    for call in (1, 2):
        with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG), pytest.raises(type(error)) as raised:
            depthwise_conv(x, weight, bias, H, W)
        assert raised.value is error and raised.value.__context__ is None, "the kernel's error, not the formula's"
        assert failures() == {} and fallback_warnings(caplog) == []
        assert kernel.calls == call, "not marked failed: tried again"


def aggregated_case(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    B, h, H, W, d, P, window = 2, 2, 4, 5, 4, 3, 3
    N, L = H * W, window * window
    shapes = [(B, h, N, d), (B, 1, N, d), (B, 1, N, d), (B, 1, P, d), (B, 1, P, d), (h, N, P), (h, L), (B, h, N, L)]
    tensors = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(requires_grad) for s in shapes]
    return tensors, (H, W), window


def test_a_failing_backward_takes_the_formulas_gradients_for_that_call_and_the_formula_runs_after(monkeypatch,
                                                                                                     caplog):
    """The aggregated attention's operator (``fused``, the CPU's and CUDA's default): its backward kernel raises; the
    step's gradients are the formula's and the next call runs the formula."""
    backward = Failing()
    monkeypatch.setattr(ops_aggregated, "_cpu_backward", backward)
    tensors, size, window = aggregated_case()
    grad = torch.randn(tensors[0].shape, dtype=torch.float64)

    def gradients(fn, **kw):
        for t in tensors:
            t.grad = None
        out = fn(*tensors, size, window, **kw)
        (out * grad).sum().backward()
        return [out.detach()] + [t.grad.clone() for t in tensors]

    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        fused = gradients(aggregated_attention)
        assert OPS["aggregated_attention"].choose("auto", tensors[0]).name == "reference"
        again = gradients(aggregated_attention)
    expected = gradients(aggregated_attention_reference)
    for got, want, after in zip(fused, expected, again):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(after, want)
    assert backward.calls == 1
    [warning] = fallback_warnings(caplog)
    assert warning.startswith("aggregated_attention: implementation fused failed (RuntimeError: PTX JIT")
    assert kernels_in_use(Kernels(), "cpu")["aggregated_attention"].startswith("reference (fused failed: RuntimeError")


def test_in_a_compiled_graph_the_operators_kernel_falls_back_when_the_graph_runs(monkeypatch, caplog):
    """Compiled, the dispatch is traced, not run: the graph calls the operator, whose kernel falls back by itself."""
    forward = Failing()
    monkeypatch.setattr(ops_aggregated, "_cpu_forward", forward)
    tensors, size, window = aggregated_case(requires_grad=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: aggregated_attention(*t, size, window), backend="eager", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger=DISPATCH_LOG):
        first, second = compiled(*tensors), compiled(*tensors)
    torch._dynamo.reset()
    expected = aggregated_attention_reference(*tensors, size, window)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert forward.calls == 1 and len(fallback_warnings(caplog)) == 1
    assert "aggregated_attention" in failures()


# The Triton kernels' backward (MoH's routing, the CUDA default; the depthwise candidate) under Triton's interpreter:
# the backward kernel raises, the call returns the formulas' gradients, and the implementation is marked failed.
TRITON_BACKWARD_SCRIPT = r"""
import logging, sys, torch
sys.path.insert(0, sys.argv[1])
from test_fused_routing import heads_of, width
from moh_vision.ops import depthwise_triton, failures, routing_triton
from moh_vision.ops.depthwise import depthwise_conv_reference
from moh_vision.ops.routing import route_merge_reference
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s", stream=sys.stdout)

def fail(grid):
    def launch(*args, **kwargs):
        raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared memory\nsecond line")
    return launch

class Unlaunchable:
    def __getitem__(self, grid):
        return fail(grid)

torch.manual_seed(0)
routing_triton._route_backward = Unlaunchable()
heads, shared, topk, B, N, d = 6, 2, 2, 2, 37, 5
z = (torch.randn(B, N, width(heads, shared, topk), dtype=torch.float64) * 2).requires_grad_()
o = heads_of(B, heads, N, d, torch.float64, True).requires_grad_()
grad = torch.randn(B, N, heads * d, dtype=torch.float64)
outs = []
for fn in (routing_triton.triton_route_merge, None):
    z.grad = o.grad = None
    if fn is None:
        merged, routing = route_merge_reference(o, z, heads - shared, shared, topk, True)
        loss = routing.loss
    else:
        merged, *_, loss = fn(o, z, heads - shared, shared, topk, True)
    ((merged * grad).sum() + 0.7 * loss).backward()
    outs.append((o.grad.clone(), z.grad.clone()))
for got, want in zip(*outs):
    torch.testing.assert_close(got, want)

depthwise_triton._weight_grads = Unlaunchable()
x = torch.randn(2, 20, 8, dtype=torch.float64, requires_grad=True)
weight = torch.randn(8, 1, 3, 3, dtype=torch.float64, requires_grad=True)
bias = torch.randn(8, dtype=torch.float64, requires_grad=True)
grad, grads = torch.randn(2, 20, 8, dtype=torch.float64), []
for fn in (depthwise_triton.depthwise_conv_triton, depthwise_conv_reference):
    for t in (x, weight, bias):
        t.grad = None
    (fn(x, weight, bias, 4, 5) * grad).sum().backward()  # every gradient from the formula, in float64
    grads.append([t.grad.clone() for t in (x, weight, bias)])
for got, want in zip(*grads):
    torch.testing.assert_close(got, want)
assert set(failures()) == {"moh_routing", "depthwise_conv"}, failures()
print("backward fell back")
"""


def test_a_triton_backward_that_fails_gives_the_formulas_gradients():
    out = run_in_triton_interpreter(TRITON_BACKWARD_SCRIPT)
    warnings = [line for line in out.splitlines() if line.startswith(DISPATCH_LOG)]
    assert len(warnings) == 2 and all("failed (RuntimeError: triton.runtime.errors.OutOfResources: out of resource: "
                                      "shared memory)" in line for line in warnings), out
    assert "moh_routing: implementation fused failed" in warnings[0]
    assert "depthwise_conv: implementation triton failed" in warnings[1]


def test_a_run_whose_kernels_fail_finishes_on_the_formulas_and_its_summary_says_so(tmp_path):
    """``python train.py`` (the default run, shrunk) with the depthwise convolution's CPU default failing in its
    forward and the aggregated attention's operator failing in its first backward."""
    run_dir = tmp_path / "run"
    proc = run_entry("tests/failing_kernels.py", "depthwise_conv/channels_last,moh_vision.ops.aggregated:_cpu_backward",
                     "train.py", *FAST_TRAIN, "trainer.count_flops=false", f"hydra.run.dir={run_dir}")
    summary = read_summary(run_dir)
    assert summary["steps"] == 3 and summary["kernels"]["depthwise"] == "auto"
    assert summary["kernels_in_use"]["depthwise_conv"] == \
        "reference (channels_last failed: RuntimeError: injected failure of depthwise_conv/channels_last)"
    assert summary["kernels_in_use"]["aggregated_attention"] == \
        "reference (fused failed: RuntimeError: injected failure of moh_vision.ops.aggregated:_cpu_backward)"
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if "the reference formula runs instead" in line]
    assert len(warnings) == 2, output[-3000:]
    assert "second line" not in output
