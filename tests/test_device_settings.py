"""The anchors' GPU settings as options (issue 53): TF32 and cuDNN benchmarking on CUDA (off where asked, restored
after the fit), fused AdamW, gradient checkpointing; in the composed config and in summary.json."""
import pytest
import torch

from helpers import ATTENTION_PRESET, model_config, trainer_config
from moh_vision.config import ConstantSched, OptimConfig, compose, validate
from moh_vision.data.digits import DigitsData
from moh_vision.engine.fit_setup import device_settings, optimizer_kernel, optimizer_kernel_of
from moh_vision.engine.distributed import DistInfo
from moh_vision.engine.loggers import Loggers
from moh_vision.engine.trainer import Trainer
from moh_vision.tasks.classification import ClassificationTask

pytestmark = pytest.mark.usefixtures("one_thread")

FLAGS = ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
         (torch.backends.cudnn, "benchmark"))


def flags():
    return [getattr(owner, name) for owner, name in FLAGS]


def test_the_composed_config_has_the_anchors_defaults(tmp_path):
    trainer = validate(compose("train", [])).trainer
    assert trainer.tf32 is True and trainer.grad_checkpointing is False and trainer.deterministic is False
    recipe = validate(compose("train", ["experiment=dit_imagenet256_recipe", f"data.root={tmp_path}"])).trainer
    assert recipe.tf32 is True and recipe.amp == "none", "DiT trains in fp32 with TF32 matmuls"


@pytest.mark.parametrize("tf32,deterministic", [(True, False), (False, True)])
def test_cuda_settings_hold_while_entered_and_are_restored(tf32, deterministic):
    """The flags can be set without a GPU: what a CUDA run sets is checked here on any machine."""
    before = flags()
    with device_settings(tf32, deterministic, torch.device("cuda", 0)) as used:
        assert flags() == [tf32, tf32, not deterministic]
        assert used == {"tf32": tf32, "cudnn_benchmark": not deterministic}
        if tf32:
            assert torch.get_float32_matmul_precision() == "high", "what the run's precision (tf32) is read from"
    assert flags() == before


def test_a_cpu_run_changes_no_flag():
    before = flags()
    with device_settings(True, False, torch.device("cpu")) as used:
        assert flags() == before
    assert used == {"tf32": False, "cudnn_benchmark": False}


def test_fused_adamw_where_torch_has_it():
    assert optimizer_kernel(torch.device("cuda")) == {"fused": True} == optimizer_kernel(torch.device("cpu"))
    assert optimizer_kernel(torch.device("mps")) == {"foreach": True}
    params = [torch.nn.Parameter(torch.ones(2))]
    assert optimizer_kernel_of(torch.optim.AdamW(params, fused=True)) == "fused"
    assert optimizer_kernel_of(torch.optim.AdamW(params, foreach=True)) == "foreach"
    assert optimizer_kernel_of(torch.optim.AdamW(params)) == "for-loop"


def _fit(out_dir, **overrides):
    task = ClassificationTask(model_config("plain_vit_nano"), {**ATTENTION_PRESET, "name": "moh",
                                                               "activation_ratio": 0.5})
    cfg = trainer_config(epochs=1, max_steps=3, batch_size=32, log_every=1, deterministic=True, **overrides)
    trainer = Trainer(cfg, out_dir, DistInfo(), Loggers(out_dir), optim=OptimConfig(lr=1e-3), sched=ConstantSched(),
                      config={"attention": dict(task.attention_cfg), "model": dict(task.model_cfg)})
    return trainer, trainer.fit(task, DigitsData(img_size=16))


def test_summary_records_the_settings_and_checkpointing_trains_the_same_weights(tmp_path):
    plain, summary = _fit(tmp_path / "plain")
    assert {k: summary[k] for k in ("tf32", "cudnn_benchmark", "optimizer_impl", "grad_checkpointing")} == \
        {"tf32": False, "cudnn_benchmark": False, "optimizer_impl": "fused", "grad_checkpointing": False}
    checkpointed, summary = _fit(tmp_path / "checkpointed", grad_checkpointing=True)
    assert summary["grad_checkpointing"] is True and checkpointed.parts.model.grad_checkpointing
    for (name, a), b in zip(plain.parts.model.state_dict().items(), checkpointed.parts.model.state_dict().values()):
        assert torch.equal(a, b), name  # recomputing the blocks' forwards changes no value
