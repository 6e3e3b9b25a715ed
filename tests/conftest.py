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
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        # a suite run inside a SLURM job: runs land in outputs/.../<date>/<time> as the tests expect (not in the job's
        # directory), and a preemption test must not requeue the job it runs in (tests/test_slurm_requeue.py sets them)
        del os.environ[name]
    from moh_vision.config import register_configs
    register_configs()  # the schema and the model presets, for tests that compose with Hydra's own API
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        # numpy's OpenBLAS too (the Frechet distances' 2048-d eigensolves): it read the thread count when numpy
        # was imported, before this hook, and two spinning BLAS threads a worker doubled those tests' CPU time
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=1, user_api="blas")
        os.environ["OMP_NUM_THREADS"] = "1"  # subprocesses the tests start inherit it (OpenBLAS reads it too)


# The files whose tests start processes or train for long, heaviest first, handed out before the rest
# (``--no-loadscope-reorder`` in pyproject.toml keeps this order): the workers then end close together. xdist's own
# order, the files with the most tests first, put test_many_ranks and test_dist_timeout (4 and 2 tests, 2 minutes)
# last, and one worker ran them alone for the last 30-50 s. Only the order changes; within a file it is the file's own.
FIRST = ("test_many_ranks.py", "test_reliability.py", "test_checkpoint_io.py", "test_train.py", "test_add_variant.py",
         "test_run_dir.py", "test_dist_timeout.py", "test_checkpoint_history.py", "test_torchrun_preemption.py",
         "test_slurm_requeue.py", "test_compare_pipelines.py", "test_config.py", "test_sample.py", "test_clients.py",
         "test_triton_interpreter.py", "test_docs.py", "test_generative_metrics.py", "test_bench_tools.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory):
    """The suite's own MOH_VISION_CACHE_DIR (the digits classifier, file indexes), empty at the start as on a fresh
    machine: no test reads what an earlier run left in ~/.cache, or leaves anything there."""
    from moh_vision.data import CACHE_ENV
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny models (thread start-up and spinning cost more than they give on a
    busy 2-core machine); the previous setting is restored. Use: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def entry_in_process(script, monkeypatch, capsys=None):
    """``run(*words)``: ``python <script> <words>`` in this process (Hydra, the schema, the run); returns (exit
    code, stderr), 0 when it finished (stderr is "" without ``capsys``: a module-scoped fixture's run, with
    ``pytest.MonkeyPatch.context()``). Hydra's logging set-up for the job and its config are undone afterwards."""
    from hydra.core.hydra_config import HydraConfig

    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    # the run's Hydra config, which Hydra keeps in a process-wide singleton, is the run's alone: it is dropped after
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)

    def run(*words):
        monkeypatch.setattr(sys, "argv", [script, *words])
        if capsys is not None:
            capsys.readouterr()
        deterministic = (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled())
        try:
            entry.main()
            code = 0
        except SystemExit as stop:
            code = stop.code
        finally:  # trainer.deterministic=true is the run's, not the rest of the test process's
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        captured = capsys.readouterr() if capsys is not None else None
        run.stdout = captured.out if captured else ""  # what it printed (``--cfg job``)
        return code, captured.err if captured else ""
    return run


@pytest.fixture
def train_in_process(monkeypatch, capsys):
    """``train_in_process(*words)`` runs ``python train.py <words>`` in this process: (exit code, stderr)."""
    return entry_in_process("train.py", monkeypatch, capsys)


@pytest.fixture
def eval_in_process(monkeypatch, capsys):
    """``eval_in_process(*words)`` runs ``python eval.py <words>`` in this process: (exit code, stderr)."""
    return entry_in_process("eval.py", monkeypatch, capsys)


@pytest.fixture(scope="session")
def random_inception_weights(tmp_path_factory):
    """A randomly initialised torch-fidelity InceptionV3 saved as a local weights file: the real file is 91 MB and
    must not be downloaded, and the metrics' plumbing does not depend on trained weights."""
    from torch import nn

    import torch_fidelity.feature_extractor_inceptionv3 as tf_inception

    patch = pytest.MonkeyPatch()
    patch.setattr(tf_inception, "load_state_dict_from_url", lambda *args, **kwargs: {})
    patch.setattr(tf_inception.FeatureExtractorInceptionV3, "load_state_dict", lambda self, state, **kw: None)
    try:
        torch.manual_seed(0)
        model = tf_inception.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    finally:
        patch.undo()
    for module in model.modules():  # He init keeps activations O(1) through the ~90 layers
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    path = tmp_path_factory.mktemp("inception") / "random_inception.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture
def tiny_inception(random_inception_weights, monkeypatch):
    """The random Inception's weights file, with the network's input side cut from 299 to 75 px (the smallest it
    takes: the spatial map is then 3 x 3, 63-d) so that a CPU test is fast; any download attempt fails the test."""
    import torch_fidelity.feature_extractor_inceptionv3 as tf_inception

    def download(*args, **kwargs):
        raise AssertionError("torch-fidelity tried to download weights")

    monkeypatch.setattr(tf_inception.FeatureExtractorInceptionV3, "INPUT_IMAGE_SIZE", 75)
    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", download)
    return random_inception_weights
