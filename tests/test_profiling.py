"""Profiles on demand (issue 53): ``trainer.profile=<first>:<last>`` writes a Chrome / Perfetto trace of those
optimizer steps and the time they took by kind of work, data wait included; the kinds are the ones
``benchmarks/bench_backbones.py`` sorts by (``moh_vision.analysis.profile_kinds``)."""
import json

import pytest
import torch

from helpers import ATTENTION_PRESET, model_config, trainer_config
from moh_vision.analysis.profile_kinds import op_category
from moh_vision.config import ConstantSched, OptimConfig, compose, validate
from moh_vision.data.digits import DigitsData
from moh_vision.engine.distributed import DistInfo
from moh_vision.engine.loggers import Loggers
from moh_vision.engine.profiling import DATA_WAIT, parse_steps
from moh_vision.engine.trainer import Trainer
from moh_vision.errors import ConfigError
from moh_vision.tasks.classification import ClassificationTask

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(out_dir, **overrides):
    cfg = trainer_config(**{"epochs": 1, "batch_size": 32, "log_every": 1, **overrides})
    task = ClassificationTask(model_config("plain_vit_nano"), ATTENTION_PRESET)
    trainer = Trainer(cfg, out_dir, DistInfo(), Loggers(out_dir), optim=OptimConfig(lr=1e-3),
                      sched=ConstantSched(warmup_epochs=0), config={"attention": ATTENTION_PRESET,
                                                                    "model": task.model_cfg}, seed=0)
    trainer.fit(task, DigitsData(img_size=16))
    return out_dir / "profile"


def test_profile_of_chosen_steps_writes_a_trace_and_the_time_by_kind(tmp_path):
    folder = _fit(tmp_path, max_steps=5, profile="2:3")
    assert sorted(p.name for p in folder.iterdir()) == [
        "time_by_kind_steps2-3_rank0.json", "time_by_kind_steps2-3_rank0.md", "trace_steps2-3_rank0.json"]
    trace = json.loads((folder / "trace_steps2-3_rank0.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in events}
    assert {"optimizer step 2", "optimizer step 3", DATA_WAIT, "aten::addmm"} <= names
    assert not {"optimizer step 1", "optimizer step 4"} & names  # only the steps asked for
    waits = [e for e in events if e["name"] == DATA_WAIT]
    assert len(waits) == 2  # one fetch a step (no accumulation)

    record = json.loads((folder / "time_by_kind_steps2-3_rank0.json").read_text())
    ms = record["ms"]
    assert record["steps"] == [2, 3] and record["clock"] == "cpu" and record["wall_ms"] > 0
    assert {"gemm", "attention", "elementwise", "copies", "data_wait", "rest"} <= set(ms)
    assert all(value >= 0 for value in ms.values()) and ms["gemm"] > 0
    assert ms["data_wait"] == pytest.approx(sum(e["dur"] for e in waits) / 1e3, rel=1e-3)  # the trace's ranges
    # one thread: the operators' own time, the waits and the rest make up the wall time
    assert ms["rest"] > 0 and sum(ms.values()) == pytest.approx(record["wall_ms"], rel=1e-9)
    table = (folder / "time_by_kind_steps2-3_rank0.md").read_text()
    assert "| gemm |" in table and "| data wait |" in table and "Optimizer steps 2-3" in table


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path):
    folder = _fit(tmp_path, max_steps=2, profile="2:9")
    record = json.loads((folder / "time_by_kind_steps2-2_rank0.json").read_text())
    assert record["steps"] == [2, 2] and record["ms"]["gemm"] > 0


@pytest.mark.parametrize("text", ["3:2", "0:1", "a:b", "5", "1:2:3", "-1:2"])
def test_a_bad_window_is_one_line_before_anything_is_built(text):
    with pytest.raises(ConfigError, match=r"trainer.profile=.*expected <first>:<last>"):
        parse_steps(text)
    with pytest.raises(ConfigError, match="expected <first>:<last>"):
        validate(compose("train", [f"trainer.profile='{text}'"]))
    assert parse_steps("7:7") == (7, 7) and parse_steps(None) is None


@pytest.mark.parametrize("name, kind", [
    ("aten::addmm", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nhwc", "convolution"),
    ("aten::convolution_backward", "convolution"), ("moh_aggregated::backward", "attention"),
    ("pytorch_flash::flash_fwd_kernel", "attention"), ("triton_poi_fused_gelu_mul_3", "compiled_pointwise"),
    ("## Call CompiledFxGraph f6zppxk724", "compiled_pointwise"), ("aten::native_layer_norm", "normalisation"),
    ("aten::copy_", "copies"), ("Memcpy DtoD (Device -> Device)", "copies"),
    ("cpp_fused_aggregated_attention_clamp_min_div_3", "compiled_pointwise"),
    ("triton_poi_fused_convolution_backward_gelu_7", "compiled_pointwise"),
    ("aten::gelu", "elementwise"), ("aten::gelu_backward", "elementwise"), ("aten::add_", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "elementwise"),
    ("aten::_foreach_lerp_", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("c10d::allreduce_", "communication"), ("gloo:all_reduce", "communication"),
    ("aten::sum", "other"), ("aten::_softmax", "other"), ("autograd::engine::evaluate_function: AddBackward0", "other"),
])
def test_operators_are_sorted_into_kinds_of_work(name, kind):
    assert op_category(name) == kind
