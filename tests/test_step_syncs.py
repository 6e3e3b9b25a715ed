"""``tests/step_syncs.py`` (``tools/gpu_checks.sh sync``) on the CPU, where CUDA's sync debug mode does not exist: it
stops a run after its warm-up and checked steps, records a failure of those steps with its stack (as it records the
error torch raises at a synchronising call on CUDA), and leaves failures of the set-up or the warm-up to the run."""
import pytest
import torch
from step_syncs import SYNC_ERROR, watching_trainer


class Loop:
    """A trainer's loop in miniature: ``fit`` takes optimizer steps; ``fail_in`` makes that step's forward raise."""

    def __init__(self, fail_in=None):
        self.step, self.device, self.fail_in = 0, torch.device("cpu"), fail_in

    def _optimizer_step(self, loss_ok):
        self.step += 1

    def fit(self, task, data):
        for _ in range(20):
            if self.step + 1 == self.fail_in:
                read_on_the_host()
            self._optimizer_step(None)
        return {"steps": self.step}


def read_on_the_host():
    raise RuntimeError(f"{SYNC_ERROR}\n(torch's second line)")


def test_the_run_stops_after_the_checked_steps():
    record = {}
    assert watching_trainer(Loop, 3, 2, record)().fit(None, None) == {}
    assert record == {"device": "cpu", "sync_debug_mode": False, "checking": True, "passed": True, "steps": 5}


def test_a_sync_in_a_checked_step_is_recorded_with_its_stack():
    record = {}
    watching_trainer(Loop, 3, 2, record)(fail_in=5).fit(None, None)
    assert record["passed"] is False and record["sync"] is True and record["steps"] == 4
    assert record["error"] == SYNC_ERROR
    assert "in read_on_the_host" in record["stack"] and "in fit" in record["stack"]


def test_a_failure_before_the_checked_steps_is_the_runs_own():
    record = {}
    with pytest.raises(RuntimeError, match=SYNC_ERROR):
        watching_trainer(Loop, 3, 2, record)(fail_in=2).fit(None, None)
    assert "passed" not in record
