"""Run ``train.py`` with every Trainer it builds observed, and write what this process saw to ``<out>.rank<r>.pt``.

``python tests/rank_probe.py <out> <script> <args...>`` (under torchrun: one file per rank). The record holds plain
tensors and lists: the final model and EMA weights, each training step's images (a hash per image, with the epoch and
the sampler's ``(index, copy)`` keys of the rank), the number of training forwards per epoch, and the host reads made
while validating. What the tests of many ranks compare across processes (``tests/test_many_ranks.py``)."""
from __future__ import annotations

import hashlib
import os
import runpy
import sys
from typing import Any, Dict


def observing(trainer_class: type, record: Dict[str, Any]) -> type:
    import torch

    class Observed(trainer_class):
        def fit(self, task, data):
            step = task.training_step

            def training_step(model, batch, device):
                x = batch[0]
                record["images"].append((self.epoch, [hashlib.sha1(img.numpy().tobytes()).hexdigest() for img in x]))
                record["forwards"][self.epoch] = record["forwards"].get(self.epoch, 0) + 1
                return step(model, batch, device)

            task.training_step = training_step
            try:
                return super().fit(task, data)
            finally:
                parts = self.parts
                record["model"] = {k: v.clone() for k, v in parts.model.state_dict().items()}
                if parts.ema is not None:
                    record["ema"] = {k: v.clone() for k, v in parts.ema.state_dict().items()}
                sampler, record["keys"] = parts.loaders.sampler, {}
                for epoch in range(self.epoch if hasattr(sampler, "indices") else 0):  # (a stream has no keys)
                    sampler.set_epoch(epoch)
                    keyed = getattr(sampler, "keyed", None)  # (the sampler before copy numbers: indices alone)
                    record["keys"][epoch] = keyed() if keyed else [(i, 0) for i in sampler.indices()]
                record["steps_per_epoch"] = parts.loaders.steps_per_epoch
                record["accum"], record["per_rank_batch"] = parts.loaders.accum, parts.loaders.per_rank_batch

        def evaluate_model(self, model, prefix="val"):
            reads = [0]
            originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "cpu")}

            def counted(original):
                def read(tensor, *args, **kwargs):
                    reads[0] += 1
                    return original(tensor, *args, **kwargs)
                return read

            for name, original in originals.items():
                setattr(torch.Tensor, name, counted(original))
            try:
                return super().evaluate_model(model, prefix)
            finally:
                for name, original in originals.items():
                    setattr(torch.Tensor, name, original)
                record["val_reads"].append(reads[0])
                record["val_batches"] = len(self.parts.loaders.val)

    return Observed


def main(out: str, script: str, *args: str) -> None:
    import torch

    import moh_vision.apps.run as run
    record: Dict[str, Any] = {"images": [], "forwards": {}, "val_reads": []}
    run.Trainer = observing(run.Trainer, record)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        torch.save(record, f"{out}.rank{os.environ.get('RANK', '0')}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
