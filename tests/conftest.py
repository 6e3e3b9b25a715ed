"""Shared test set-up.

The suite runs in parallel (``-n 2 --dist loadfile`` in pyproject.toml: pytest-xdist, one test file per
worker at a time, so module-scoped fixtures and files a test module writes stay within one process).
Each worker then uses one intra-op thread: two workers with two threads each on a 2-core machine would
fight for the cores, and the tests' tensors are small enough that one thread is faster anyway.
"""
import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    from moh_vision.config import register_configs
    register_configs()  # the schema and the model presets, for tests that compose with Hydra's own API
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # subprocesses the tests start inherit it


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny models (thread start-up and spinning cost more than they give on a
    busy 2-core machine); the previous setting is restored. Use: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def entry_in_process(script, monkeypatch, capsys):
    """``run(*words)``: ``python <script> <words>`` in this process (Hydra, the schema, the run); returns (exit
    code, stderr), 0 when it finished. Hydra's logging set-up for the job is undone afterwards."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)

    def run(*words):
        monkeypatch.setattr(sys, "argv", [script, *words])
        capsys.readouterr()
        try:
            entry.main()
            code = 0
        except SystemExit as stop:
            code = stop.code
        return code, capsys.readouterr().err
    return run


@pytest.fixture
def train_in_process(monkeypatch, capsys):
    """``train_in_process(*words)`` runs ``python train.py <words>`` in this process: (exit code, stderr)."""
    return entry_in_process("train.py", monkeypatch, capsys)


@pytest.fixture
def eval_in_process(monkeypatch, capsys):
    """``eval_in_process(*words)`` runs ``python eval.py <words>`` in this process: (exit code, stderr)."""
    return entry_in_process("eval.py", monkeypatch, capsys)
