"""The Triton kernels on the CPU, under Triton's interpreter, against their formulas: the aggregated attention, the
depthwise convolution, MoH's fused routing and merge, and the routing's fallback when its backward kernel fails.
Triton decides at import whether its language is interpreted, so the checks run in a process of their own with
``TRITON_INTERPRET=1``, one for all four (each kernel's check lives beside the kernel's other tests, as a script)."""
import pytest

from helpers import run_in_triton_interpreter
from test_aggregated_attention import TRITON_SCRIPT as AGGREGATED
from test_depthwise import SCRIPT as DEPTHWISE
from test_fused_routing import TRITON_MERGE_SCRIPT as ROUTE_MERGE
from test_kernel_fallback import ROUTING_BACKWARD_SCRIPT as ROUTING_FALLBACK

SCRIPTS = {"aggregated": AGGREGATED, "depthwise": DEPTHWISE, "route_merge": ROUTE_MERGE,
           "routing_fallback": ROUTING_FALLBACK}  # the fallback last: it replaces a kernel in the process


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    return run_in_triton_interpreter(SCRIPTS, tmp_path_factory.mktemp("interpreter"))


def test_the_aggregated_attention_kernels_equal_the_formula(failures):
    assert failures["aggregated"] is None, failures["aggregated"]


def test_the_depthwise_kernels_equal_conv2d(failures):
    assert failures["depthwise"] is None, failures["depthwise"]


def test_the_route_merge_kernel_equals_the_formulas_and_merge_heads(failures):
    assert failures["route_merge"] is None, failures["route_merge"]


def test_the_fused_routings_backward_kernel_takes_the_formulas_gradients(failures):
    assert failures["routing_fallback"] is None, failures["routing_fallback"]


def test_a_failing_check_is_reported_with_its_traceback(tmp_path):
    """The runner itself: a check that fails is that check's failure, and the next still runs."""
    got = run_in_triton_interpreter({"bad": "assert 1 == 2, 'told'", "good": "import sys; assert sys.argv[1]"},
                                    tmp_path)
    assert got["good"] is None and "AssertionError: told" in got["bad"]
