"""Shared test set-up.

The suite runs in parallel (``-n 2 --dist loadfile`` in pyproject.toml: pytest-xdist, one test file per
worker at a time, so module-scoped fixtures and files a test module writes stay within one process).
Each worker then uses one intra-op thread: two workers with two threads each on a 2-core machine would
fight for the cores, and the tests' tensors are small enough that one thread is faster anyway.
"""
import os

import torch


def pytest_configure(config):
    from moh_vision.config import register_configs
    register_configs()  # the schema and the model presets, for tests that compose with Hydra's own API
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # subprocesses the tests start inherit it
