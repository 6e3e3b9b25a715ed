"""Time a training checkpoint's save (what blocks the loop: at once, or in the background) and load (mmap or not).

    python benchmarks/bench_checkpoint.py                                   # the default model (transnext_nano)
    python benchmarks/bench_checkpoint.py models=transnext_nano,dit_b_2 rounds=5 out=docs/bench/<folder>/checkpoint.json
    python benchmarks/bench_checkpoint.py models=dit_s_2 rounds=1            # a few seconds

For each model (timm's defaults), a state as the trainer saves it (weights, EMA weights, AdamW's moments, progress):
the file's size; the seconds a save blocks the loop with ``trainer.ckpt_async=false`` (``last.pt`` with a linked
``step_N.pt``: one serialisation; beside it the two serialisations of earlier releases) and ``true`` (the host copy);
the background write's whole time; a fixed amount of work on the training thread alone and during a background
write; and a resume's load (the file read and the weights copied in) with and without ``mmap``. Median and
quartiles over the rounds. The files go to a temporary folder (``root``: under that folder).
"""
from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from harness import Spread, machine_description, print_json_record
from moh_vision.checkpoints import BackgroundWriter, atomic_save, host_copy
from moh_vision.cli import Option, integer, list_of, run_tool, text


def training_state(model_name: str) -> Dict[str, Any]:
    """The checkpoint the trainer would save for ``model_name`` (timm's defaults), after one AdamW step."""
    import timm

    import moh_vision.models  # noqa: F401 - registers the models with timm
    model = timm.create_model(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments exist from the first step on
    return {"format": 1, "model": model.state_dict(), "model_ema": copy.deepcopy(model).state_dict(),
            "optimizer": optimizer.state_dict(), "step": 1, "epoch": 0, "batch_in_epoch": 1,
            "config": {"model": {"name": model_name}}, "model_name": model_name}


def _seconds(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _work(seconds_of_work: int = 40) -> Callable[[], None]:
    """A fixed amount of compute on this thread (the training loop's stand-in): matrix products."""
    a = torch.randn(384, 384)

    def run() -> None:
        for _ in range(seconds_of_work):
            a @ a
    return run


def time_checkpoint(state: Dict[str, Any], folder: Path, rounds: int) -> Dict[str, Any]:
    """Per round (after one more, untimed): a sync save (last.pt with a linked step file), two separate saves, an
    async save (what blocks, and the whole write), the same work alone and during a background write, and loads with
    and without mmap."""
    last, numbered = folder / "last.pt", folder / "step_0000001.pt"
    times: Dict[str, List[float]] = {k: [] for k in (
        "sync_save_s", "two_serialisations_s", "async_blocking_s", "async_write_s", "work_alone_s",
        "work_during_write_s", "load_s", "load_mmap_s")}
    writer = BackgroundWriter(threaded=True)
    work = _work()
    for _ in range(rounds + 1):  # the first round warms up (allocations, page cache, first calls), not counted
        times["sync_save_s"].append(_seconds(lambda: atomic_save(state, last, keep_previous=True, also=[numbered])))
        times["two_serialisations_s"].append(_seconds(lambda: (atomic_save(state, last, keep_previous=True),
                                                               atomic_save(state, numbered))))
        start = time.perf_counter()
        copied = host_copy(state)
        writer.submit(lambda: atomic_save(copied, last, keep_previous=True, also=[numbered]))
        times["async_blocking_s"].append(time.perf_counter() - start)
        writer.wait()
        times["async_write_s"].append(time.perf_counter() - start)
        times["work_alone_s"].append(_seconds(work))
        writer.submit(lambda: atomic_save(copied, last, keep_previous=True, also=[numbered]))
        times["work_during_write_s"].append(_seconds(work))
        writer.wait()
        for key, mmap in (("load_s", False), ("load_mmap_s", True)):
            times[key].append(_seconds(lambda: _restore(torch.load(last, map_location="cpu", weights_only=True,
                                                                   mmap=mmap), state)))
    return {"file_mb": last.stat().st_size / 2 ** 20, **{k: Spread.of(v[1:]).as_dict() for k, v in times.items()}}


def _restore(loaded: Dict[str, Any], into: Dict[str, Any]) -> None:
    """What a resume does with the tensors: copy the weights and EMA weights in (every page read)."""
    for part in ("model", "model_ema"):
        for key, tensor in into[part].items():
            tensor.copy_(loaded[part][key])


def bench_checkpoint(models: List[str], rounds: int, root: Optional[str] = None,
                     out: Optional[str] = None) -> Dict[str, Any]:
    """The record: the machine and, per model, :func:`time_checkpoint`'s median and quartiles, printed and, with
    ``out``, written there (JSON). The files go to a temporary folder (under ``root`` if given), then are removed."""
    record: Dict[str, Any] = {"machine": machine_description(), "threads": torch.get_num_threads(), "rounds": rounds,
                              "models": {}}
    for name in models:
        state = training_state(name)
        params = sum(t.numel() for t in state["model"].values())
        with tempfile.TemporaryDirectory(prefix="bench_checkpoint_", dir=root) as folder:
            timed = time_checkpoint(state, Path(folder), rounds)
        timed["blocking_sync_over_async"] = timed["sync_save_s"]["median"] / timed["async_blocking_s"]["median"]
        record["models"][name] = {"params_m": params / 1e6, **timed}
    return print_json_record(record, out)


OPTIONS = (
    Option("models", ["transnext_nano"], list_of(text), "model names (timm's registry, this project's included)"),
    Option("rounds", 3, integer, "timed rounds", minimum=1),
    Option("root", help="write the files under this folder (default: the system's temporary folder)"),
    Option("out", help="write the record (JSON) here"),
)


def bench(opts) -> dict:
    return bench_checkpoint(opts.models, opts.rounds, opts.root, opts.out)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    return run_tool(bench, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
