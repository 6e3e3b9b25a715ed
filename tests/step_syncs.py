"""A recipe's real training steps under ``torch.cuda.set_sync_debug_mode("error")``: does a step make the host wait for
the device? (``tools/gpu_checks.sh``, part ``sync``; ``tests/step_waits.py`` counts the same on the CPU, by the reads.)

``python tests/step_syncs.py <record.json> <warmup> <checked> <script> <args...>`` runs ``<script>`` (train.py) with its
Trainer watched: after ``warmup`` optimizer steps (Triton's compiles, cuDNN's benchmarks, the allocator's growth) the
sync debug mode is ``error`` for the next ``checked`` steps (loading, forward, backward, clipping, optimizer, EMA, and the
loop between steps; no log or checkpoint interval may fall among them), then the run stops: validation, checkpoints
and summary.json may read the device and are not run. The record: ``passed``, the first synchronising call's stack
(torch raises there), or any other error of those steps, with torch's version and the device. On the CPU there is no
such mode: the steps just run (a dry run of the check).

``python tests/step_syncs.py data <dir>`` writes what the recipes read: a class-folder tree of random images
(``<dir>/images/{train,val}``) and a latents directory of random encoder moments (``<dir>/latents``, 32x32x4, as
ImageNet-256 gives them) with an empty folder as its VAE (the run stops before it would decode).
"""
from __future__ import annotations

import json
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, Optional

import torch

SYNC_ERROR = "synchronizing CUDA operation"  # in the error torch raises under set_sync_debug_mode("error")


class _Checked(Exception):
    """The checked steps are done: the run stops here."""


def watching_trainer(trainer_class: type, warmup: int, checked: int, record: Dict[str, Any]) -> type:
    """A subclass of ``trainer_class`` whose ``fit`` runs ``warmup`` steps, then ``checked`` steps in CUDA's sync debug
    mode ``error``, and stops; ``record`` gets the outcome."""
    class Watching(trainer_class):
        def _optimizer_step(self, loss_ok):
            result = super()._optimizer_step(loss_ok)
            if self.step == warmup:
                record["checking"] = True
                if self.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
            elif self.step == warmup + checked:
                _sync_debug_off(self.device)
                raise _Checked
            return result

        def fit(self, task, data):
            record["device"] = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            record["sync_debug_mode"] = self.device.type == "cuda"
            try:
                return super().fit(task, data)
            except _Checked:
                record.update(passed=True, steps=self.step)
            except Exception as error:  # noqa: BLE001 - the record says what it was
                _sync_debug_off(self.device)
                if not record.get("checking"):
                    raise  # set-up or warm-up failed: not this check's question
                record.update(passed=False, steps=self.step, error=str(error).strip().splitlines()[0],
                              sync=SYNC_ERROR in str(error),
                              stack="".join(traceback.format_exception(type(error), error, error.__traceback__)))
            return {}
    return Watching


def _sync_debug_off(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)


def check(out: str, warmup: str, checked: str, script: str, *args: str) -> None:
    import moh_vision.engine.run as run
    record: Dict[str, Any] = {"args": list(args), "warmup_steps": int(warmup), "checked_steps": int(checked),
                              "torch": torch.__version__, "passed": None}
    run.Trainer = watching_trainer(run.Trainer, int(warmup), int(checked), record)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # hydra's exit; a one-line error of the entry point
        if stop.code:
            record.setdefault("error", f"{script} exited {stop.code}")
    finally:
        from moh_vision.ops import failures
        record["kernels_failed"] = failures()  # implementations that fell back to their formula in this run
        Path(out).write_text(json.dumps(record, indent=1))
    print(f"{'passed' if record['passed'] else 'FAILED'}: {record.get('error', 'no sync')} ({out})")
    sys.exit(0 if record["passed"] else 1)


def write_data(root: str, images_per_class: int = 64, classes: int = 2, latents: int = 64) -> None:
    """Random images (a class-folder tree) and random latents (a latents directory) under ``root``."""
    import numpy as np
    from PIL import Image

    from moh_vision.data.latents import FORMAT, FORMAT_VERSION, INDEX_FILE, SCALE_FACTOR, shard_name

    rng = np.random.default_rng(0)
    out = Path(root)
    for split, count in (("train", images_per_class), ("val", 4)):
        for c in range(classes):
            folder = out / "images" / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    lat = out / "latents"
    (lat / "vae").mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(latents, 2, 1, 4, 32, 32, generator=g)
    std = torch.rand(latents, 2, 1, 4, 32, 32, generator=g) * 0.1 + 0.01
    shard = {"moments": torch.cat([mean, std], dim=2).half(), "labels": torch.arange(latents) % classes,
             "source_index": torch.arange(latents), "skipped": [], "meta": {"format": FORMAT, "version": FORMAT_VERSION}}
    torch.save(shard, lat / shard_name(0))
    index = {"format": FORMAT, "version": FORMAT_VERSION, "num_images": latents, "num_classes": classes,
             "class_names": [f"class{c}" for c in range(classes)], "image_size": 256, "latent_size": 32,
             "latent_channels": 4, "scale_factor": SCALE_FACTOR, "vae_path": str((lat / "vae").resolve()),
             "flip": True, "dtype": "float16", "shards": [{"file": shard_name(0), "count": latents}], "skipped": []}
    (lat / INDEX_FILE).write_text(json.dumps(index, indent=1))


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "data":
        write_data(argv[1])
    else:
        check(*argv)


if __name__ == "__main__":
    main()
