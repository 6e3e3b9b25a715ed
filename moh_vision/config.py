"""The one typed configuration of ``train.py`` and ``eval.py``: every option's type, default and allowed values.

Why Hydra structured configs (dataclasses) and not pydantic: Hydra composes the config groups, experiments and sweeps; a
dataclass registered in Hydra's ConfigStore types every option *while* Hydra composes (``trainer.epochs=abc`` never
reaches Python), ``--cfg job`` prints the typed result, and it adds no dependency. What types cannot say (``>= 1``, a
choice, a readable file) is each field's metadata, checked by :func:`validate` before anything is built or written.

A group option, ``configs/<group>/<option>.yaml``, extends its schema (``defaults: [/schema/<group>/<schema>@_here_,
_self_]``) and sets only what differs. Every group's ``name`` selects what Python builds (:data:`DATA_CLASSES`,
:data:`TASK_CLASSES`; the attention registry, the optimizer and schedule by their names). Models are data: one file per
family in ``configs/model/family/`` (not an option: it names no model) and one generated option per registered preset
(:func:`register_configs`), so ``model=<preset>`` lists every model the package registers and nothing else; a timm
name is pointed at the preset its checkpoints load into.

Errors: :func:`explain` (Hydra's composition errors) and :func:`validate` (values) give one line naming the key, the
bad value and what is allowed (:class:`~moh_vision.errors.ConfigError`, exit 2)."""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from omegaconf import MISSING, DictConfig, OmegaConf

from moh_vision.cli import CONFIG_DIR, run_cli
from moh_vision.checkpoints import run_name
from moh_vision.errors import ConfigError, os_error_line


# ---- Field metadata: what a type cannot say --------------------------------------------------
def option(default: Any = MISSING, *, at_least: Optional[float] = None, above: Optional[float] = None,
           at_most: Optional[float] = None, below: Optional[float] = None, choices: Sequence[Any] = (),
           path: Optional[str] = None, help: str = "") -> Any:
    """A dataclass field with its allowed values. ``path``: ``"checkpoint"`` (a readable weights file),
    ``"resume"`` (auto | never | a checkpoint), ``"dir"`` (an existing directory)."""
    meta = {key: value for key, value in dict(at_least=at_least, above=above, at_most=at_most, below=below,
                                             choices=tuple(choices), path=path, help=help).items()
            if value not in (None, ())}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def allowed_text(meta: Dict[str, Any]) -> str:
    """The allowed values of a field in words, e.g. ``at least 1`` or ``one of none, bf16, fp16``."""
    parts = []
    if "choices" in meta:
        parts.append("one of " + ", ".join(_word(c) for c in meta["choices"]))
    for key, words in (("at_least", "at least"), ("above", "above"), ("at_most", "at most"), ("below", "below")):
        if key in meta:
            parts.append(f"{words} {meta[key]:g}")
    if "path" in meta:
        parts.append({"checkpoint": "a readable checkpoint file", "resume": "auto, never or a checkpoint file",
                      "dir": "an existing directory"}[meta["path"]])
    return " and ".join(parts)


def _word(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ---- The schema ------------------------------------------------------------------------------
AMP = ("none", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EmaConfig:
    enabled: bool = False
    decay: float = option(0.9999, above=0.0, below=1.0)
    warmup: bool = option(False, help="decay min(decay, (1+n)/(10+n)) for short runs")


@dataclass
class DdpConfig:
    broadcast_buffers: Any = option("auto", choices=("auto", True, False),
                                    help="rank 0's buffers before every forward; auto: only if training changes them "
                                    "(batch norms)")
    gradient_as_bucket_view: bool = option(True, help="gradients as views of DDP's buckets: one copy fewer")
    comm_hook: str = option("none", choices=("none", "bf16", "fp16"),
                            help="compress gradients for the all-reduce (torch's hooks): half the bytes, for "
                            "communication-bound recipes")
    bucket_cap_mb: Optional[float] = option(None, above=0.0, help="DDP's bucket size (default: torch's 25 MB)")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainerConfig:
    epochs: int = option(15, at_least=1)
    max_steps: Optional[int] = option(None, at_least=1, help="stop earlier than epochs x steps per epoch")
    batch_size: int = option(64, at_least=1, help="global: split over ranks and grad_accum")
    val_batch_size: Optional[int] = option(None, at_least=1, help="default: the per-rank training batch")
    grad_accum: int = option(1, at_least=1)
    clip_grad: float = option(1.0, at_least=0.0, help="max global grad norm; 0 disables")
    amp: str = option("none", choices=AMP, help="fp16 uses a grad scaler")
    compile: bool = False
    compile_mode: str = option("default", choices=COMPILE_MODES,
                               help="torch.compile's mode with compile=true (reduce-overhead: CUDA graphs)")
    throughput_warmup_steps: int = option(1, at_least=0, help="optimizer steps per process left out of "
                                          "summary images_per_sec (with compile=true the first step compiles)")
    ema: EmaConfig = field(default_factory=EmaConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)
    device: str = option("auto", choices=DEVICES)
    num_workers: int = option(0, at_least=0)
    log_every: int = option(10, at_least=1, help="steps")
    val_every_epochs: int = option(1, at_least=1)
    val_at_start: Any = option("auto", choices=("auto", True, False),
                               help="validate the initial weights (epoch -1); auto: when the model starts from weights")
    ckpt_every_steps: int = option(0, at_least=0, help="0: only at epoch ends")
    ckpt_history_every_steps: int = option(0, at_least=0, help="a numbered checkpoints/step_<step>.pt every N steps")
    ckpt_history_every_epochs: int = option(0, at_least=0, help="a numbered checkpoint at every Nth epoch end")
    ckpt_keep: int = option(0, at_least=0, help="numbered checkpoints kept, the newest (0: all)")
    ckpt_async: bool = option(True, help="write checkpoints in a background thread from a host copy of the state "
                              "(the loop waits only for the copy; false: less host memory)")
    profile: Optional[str] = option(None, help="<first>:<last> optimizer steps (from 1): a torch.profiler trace and "
                                    "the time by kind of work in <run dir>/profile/")
    resume: str = option("auto", path="resume", help="auto: last.pt of this output dir; never; or a checkpoint")
    extend: bool = option(False, help="resume with options that change the training (more epochs, another lr): "
                          "the schedule is recomputed for the new length")
    deterministic: bool = option(False, help="deterministic kernels; on CUDA also no cuDNN benchmarking")
    tf32: bool = option(True, help="CUDA: fp32 matmuls and convolutions on TF32 tensor cores (DiT's train.py)")
    grad_checkpointing: bool = option(False, help="recompute each block's activations in backward (the model's "
                                      "set_grad_checkpointing): less memory, one more forward per step")
    max_nonfinite_in_a_row: int = option(10, at_least=1)
    requeue_on_preempt: bool = option(True, help="inside a plain sbatch job: scontrol requeue after preemption")
    dist_timeout_s: float = option(1800.0, above=0.0, help="DDP: how long joining the process group and each "
                                   "collective may wait (a rank-0-only phase included) before the run stops")
    progress: Any = option("auto", choices=("auto", True, False), help="the progress bar; auto: on a terminal only "
                           "(none in a SLURM log)")
    count_flops: bool = True


def _kernel_choices(key: str) -> Tuple[str, ...]:
    from moh_vision.ops import choices
    return choices(key)


@dataclass
class KernelsConfig:
    """Which implementation each op runs (:class:`moh_vision.ops.Kernels`): ``auto`` is the recorded winner on the
    run's device, ``reference`` the plain formula (``kernels=reference`` sets every entry)."""
    aggregated: str = option("auto", choices=_kernel_choices("aggregated"),
                             help="TransNeXt's aggregated attention (fused: C++ / Triton; flex: CUDA candidate)")
    routing: str = option("auto", choices=_kernel_choices("routing"),
                          help="MoH's routing and gated merge (fused: one kernel each way, C++ / Triton)")
    depthwise: str = option("auto", choices=_kernel_choices("depthwise"), help="TransNeXt's depthwise convolution "
                            "(channels_last on the CPU; candidates: triton, written_grad)")
    recompute: str = option("auto", choices=_kernel_choices("recompute"),
                            help="eager training: TransNeXt pieces keep only their inputs for backward")


@dataclass
class OptimConfig:
    name: str = option("adamw", help="any of timm's optimizers (timm.optim.list_optimizers()): adamw, lamb, sgd, ...")
    lr: float = option(2.0e-3, above=0.0)
    weight_decay: float = option(0.05, at_least=0.0, help="not on 1-D params, biases and the model's no-decay list")
    betas: List[float] = option([0.9, 0.999], help="optimizers with betas (the Adam family, lamb, ...)")
    eps: float = option(1.0e-8, above=0.0, help="optimizers with eps")
    momentum: float = option(0.9, at_least=0.0, help="optimizers with momentum (sgd: Nesterov, momentum, ...)")
    layer_decay: Optional[float] = option(None, above=0.0, at_most=1.0,
                                          help="lr x layer_decay per layer below the head (the model's group_matcher)")
    no_weight_decay_keywords: List[str] = option([], help="extra name fragments to exclude from weight decay")
    kwargs: Dict[str, Any] = option({}, help="the optimizer's other arguments, e.g. {nesterov: false}")


@dataclass
class ScheduleOptions:
    """What every schedule has: a linear warm-up from ``warmup_lr`` over ``warmup_epochs`` plus ``warmup_steps``
    (timm's schedulers, stepped per optimizer step)."""
    name: str = MISSING
    warmup_epochs: float = option(0, at_least=0.0)
    warmup_steps: int = option(0, at_least=0, help="optimizer steps of warm-up added to warmup_epochs")
    warmup_lr: float = option(1.0e-6, at_least=0.0)


@dataclass
class ConstantSched(ScheduleOptions):
    name: str = option("constant", choices=("constant",))


@dataclass
class DecayingSched(ScheduleOptions):
    """A decay to ``min_lr`` over the steps between the warm-up and the cool-down (``min_lr`` held)."""
    min_lr: float = option(1.0e-5, at_least=0.0)
    cooldown_epochs: float = option(0, at_least=0.0, help="epochs at min_lr at the end")


@dataclass
class CosineSched(DecayingSched):
    name: str = option("cosine", choices=("cosine", "tanh"))
    warmup_epochs: float = option(2, at_least=0.0)


@dataclass
class PolySched(DecayingSched):
    name: str = option("poly", choices=("poly",))
    power: float = option(1.0, above=0.0, help="1: linear")


@dataclass
class WsdSched(DecayingSched):
    name: str = option("wsd", choices=("wsd",))
    decay_fraction: float = option(0.2, above=0.0, at_most=1.0, help="share of the schedule after the warm-up spent "
                                   "decaying (the rest stable)")
    decay_fn: str = option("1-sqrt", choices=("1-sqrt", "linear", "cosine"))


@dataclass
class StepSched(ScheduleOptions):
    name: str = option("step", choices=("step",))
    decay_epochs: float = option(30, above=0.0, help="the rate x decay_rate every decay_epochs after the warm-up")
    decay_rate: float = option(0.1, above=0.0)


@dataclass
class MultiStepSched(ScheduleOptions):
    name: str = option("multistep", choices=("multistep",))
    decay_milestones: List[float] = option([30, 60, 90], help="epochs after the warm-up where the rate x decay_rate "
                                           "(timm's convention: from the optimizer step before each)")
    decay_rate: float = option(0.1, above=0.0)


@dataclass
class CsvLogger:
    name: str = option("csv", choices=("csv",))


@dataclass
class NoneLogger:
    name: str = option("none", choices=("none",))


@dataclass
class WandbLogger:
    name: str = option("wandb", choices=("wandb",))
    project: str = "moh-vision"
    entity: Optional[str] = None
    group: Optional[str] = option(None, help="default: the experiment / sweep / tag name")
    tags: List[str] = option([])
    mode: str = option("auto", choices=("auto", "online", "offline", "disabled"))


@dataclass
class ModelConfig:
    name: str = option(MISSING, help="a registered model (model=<name> picks one)")
    checkpoint_path: Optional[str] = option(
        None, path="checkpoint", help="this model's weights (official or ours) to fine-tune from: classifier, "
                                      "input channels and position embeddings adapted to the data")
    init_from: Optional[str] = option(None, path="checkpoint",
                                      help="a dense checkpoint of this backbone to continue-tune from "
                                           "(adapted to the data like checkpoint_path; routers start dense)")
    kwargs: Dict[str, Any] = option({}, help="extra constructor arguments, e.g. {drop_path_rate: 0.1}")


@dataclass
class DigitsData:
    name: str = option("digits", choices=("digits",))
    img_size: int = option(32, at_least=8)
    in_chans: int = option(1, choices=(1, 3))
    val_fraction: float = option(0.2, above=0.0, below=1.0)
    split_seed: int = option(0, at_least=0)
    augment: bool = True
    max_shift: float = option(0.1, at_least=0.0, below=1.0)
    max_rotate: float = option(10.0, at_least=0.0, at_most=180.0)
    max_scale: float = option(0.1, at_least=0.0, below=1.0)


@dataclass
class ImageFolderData:
    name: str = option("imagefolder", choices=("imagefolder", "imagenet"))
    root: str = option(MISSING, path="dir")
    img_size: int = option(224, at_least=8)
    in_chans: int = option(3, choices=(1, 3))
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    color_jitter: Optional[float] = option(0.4, at_least=0.0)
    interpolation: str = option("bicubic", choices=("bicubic", "bilinear", "nearest"))
    re_prob: Optional[float] = option(0.25, at_least=0.0, at_most=1.0)
    mixup: Optional[float] = option(0.8, at_least=0.0)
    cutmix: Optional[float] = option(1.0, at_least=0.0)
    mixup_switch_prob: float = option(0.5, at_least=0.0, at_most=1.0)
    mixup_prob: float = option(1.0, at_least=0.0, at_most=1.0)
    label_smoothing: Optional[float] = option(0.1, at_least=0.0, below=1.0)
    repeated_aug: Any = option("auto", help="auto: 3 with more than one process (DeiT), 1 in a single process")
    eval_crop_pct: Optional[float] = option(0.875, above=0.0, at_most=1.0)
    on_bad_image: str = option("skip", choices=("skip", "raise"))
    index_cache: Optional[str] = option("auto", help="where the file index is kept between runs: auto "
                                        "(~/.cache/moh_vision/file_index), a directory, or null (scan every time)")
    source: str = option("auto", choices=("auto", "folder", "tar", "hfds", "wds"),
                         help="class folders, tars, a Hugging Face dataset on disk, or webdataset shards streamed "
                              "(wds: never inferred); auto: what the root's form says")
    class_order: str = option("natural", choices=("natural", "sorted"),
                              help="class indices: timm's natural sort of the class names, or the plain string sort "
                                   "(runs saved before this option: sorted)")
    class_map: Optional[str] = option(None, help="a text file of class names, one a line (its line number the index)")
    val_labels: Optional[str] = option(None, help="labels of a flat val split (LOC_val_solution.csv, the ILSVRC2012 "
                                                  "devkit, or '<image id> <class>' lines); null: found next to it")


@dataclass
class LatentsData:
    name: str = option("latents", choices=("latents",))
    root: str = option(MISSING, path="dir")
    flip: bool = True
    sample_posterior: bool = True
    val_size: int = option(1000, at_least=1)
    val_holdout: bool = False


@dataclass
class CustomData:
    """Your own data class (the Data protocol), by import path: ``data=custom data.name=my_pkg.data:MyData
    +data.kwargs.root=/x``; its constructor checks its own arguments."""
    name: str = option(MISSING, help="module:Class")
    kwargs: Dict[str, Any] = option({}, help="constructor arguments")


@dataclass
class ClassificationTask:
    name: str = option("classification", choices=("classification",))


@dataclass
class SampleConfig:
    every_epochs: int = option(20, at_least=0, help="a labelled grid every N epochs (0: only the final one)")
    steps: str = option("ddim50", help="respaced steps: '250' (DDPM), 'ddim50'; sampler=dpm++(sde): solver steps, '25'")
    sampler: str = option("ddim", choices=("ddpm", "ddim", "dpm++", "dpm++sde"))
    cfg_scale: float = option(2.0, at_least=1.0)
    guidance_channels: Optional[int] = option(None, at_least=1, help="null: guide every channel; 3: DiT's")
    per_class: int = option(8, at_least=0, help="grid columns (0: no grid)")
    grid_classes: int = option(10, at_least=1)
    eval_per_class: int = option(20, at_least=0, help="samples per class for the digits' sample metrics")
    clip_denoised: Optional[bool] = option(None, help="null: clip pixels to [-1, 1], never latents")
    seed: int = option(0, at_least=0)
    batch_size: int = option(250, at_least=1)
    decode_batch_size: int = option(32, at_least=1)
    # FID (sFID, IS, precision, recall) during training, of the EMA weights (the model's without EMA)
    fid_every_steps: int = option(0, at_least=0, help="FID every N optimizer steps (0: off)")
    fid_at_checkpoints: bool = option(False, help="FID at every numbered checkpoint (trainer.ckpt_history_every_*)")
    fid_samples: int = option(10000, at_least=1, help="samples per FID, shared by the ranks (10000: DiT's ablations)")
    fid_ref: Optional[str] = option(None, help="ADM reference batch .npz (or folder of real images) to compare with")
    inception_weights: Optional[str] = option(None, help="local torch-fidelity Inception weights file for the FID")
    fid_sampler: str = option("dpm++", choices=("ddpm", "ddim", "dpm++", "dpm++sde"))
    fid_steps: str = option("25", help="the FID sampler's steps (dpm++: solver steps; ddpm/ddim: respacing)")
    fid_cfg_scale: Optional[float] = option(None, at_least=1.0, help="null: cfg_scale")
    fid_metrics_batch_size: int = option(64, at_least=1, help="images per Inception call")


@dataclass
class VaeConfig:
    path: Optional[str] = option(None, path="dir", help="a local diffusers AutoencoderKL directory")
    scale_factor: float = option(0.18215, above=0.0)


@dataclass
class DiffusionTask:
    name: str = option("diffusion", choices=("diffusion",))
    diffusion_steps: int = option(1000, at_least=2)
    noise_schedule: str = option("linear", choices=("linear", "squaredcos_cap_v2"))
    learn_sigma: bool = True
    class_dropout_prob: float = option(0.1, at_least=0.0, below=1.0)
    sample: SampleConfig = field(default_factory=SampleConfig)
    vae: VaeConfig = field(default_factory=VaeConfig)


@dataclass
class TrainConfig:
    """``python train.py``: the root of the composed config."""
    attention: Dict[str, Any] = MISSING
    model: ModelConfig = MISSING
    data: Any = MISSING
    optim: OptimConfig = MISSING
    sched: Any = MISSING
    trainer: TrainerConfig = MISSING
    logger: Any = MISSING
    task: Any = MISSING
    kernels: KernelsConfig = MISSING
    seed: int = option(0, at_least=0)
    tag: Optional[str] = option(None, help="free-form run tag (the wandb group when set)")


@dataclass
class EvalOptions:
    use_ema: bool = False
    batch_size: int = option(128, at_least=1)
    num_workers: int = option(2, at_least=0)
    device: str = option("auto", choices=DEVICES)
    amp: str = option("none", choices=AMP)
    sets: List[str] = option([], help="evaluation sets besides data's val: in1k, real, v2, a, r")
    roots: Dict[str, str] = option({}, help="each set's folder, e.g. {v2: <dir>} (in1k and real: data.root's val)")


@dataclass
class EvalConfig:
    """``python eval.py``: a checkpoint and, optionally, other data; or released weights (``model=<preset>
    pretrained=<file | hub id | true>``) on ``data``."""
    ckpt: Optional[str] = option(None, path="checkpoint", help="a checkpoint written by train.py")
    model: Any = None
    pretrained: Optional[str] = option(None, help="released weights of model=<preset>: a local file, a Hugging Face "
                                                  "hub id (owner/repo) or true (those its registered cfg names)")
    data: Any = None
    logger: Any = MISSING
    eval: EvalOptions = field(default_factory=EvalOptions)


# What each group's ``name`` builds.
DATA_CLASSES = {"digits": "moh_vision.data.digits:DigitsData",
                "imagefolder": "moh_vision.data.imagefolder:ImageFolderData",
                "imagenet": "moh_vision.data.imagefolder:ImageNetData",
                "latents": "moh_vision.data.latents:LatentsData"}
TASK_CLASSES = {"classification": "moh_vision.tasks.classification:ClassificationTask",
                "diffusion": "moh_vision.tasks.diffusion:DiffusionTask"}
# The model families each task trains (``model_family`` of the model's name).
TASK_MODEL_FAMILIES = {"classification": ("transnext", "vit"), "diffusion": ("dit",)}
SCHEMAS = {"data": {"digits": DigitsData, "imagefolder": ImageFolderData, "latents": LatentsData,
                    "custom": CustomData},
           "task": {"classification": ClassificationTask, "diffusion": DiffusionTask},
           "sched": {"cosine": CosineSched, "constant": ConstantSched, "poly": PolySched, "wsd": WsdSched,
                     "step": StepSched, "multistep": MultiStepSched},
           "logger": {"csv": CsvLogger, "none": NoneLogger, "wandb": WandbLogger},
           "model": {"model": ModelConfig}, "optim": {"optim": OptimConfig}, "trainer": {"default": TrainerConfig},
           "kernels": {"default": KernelsConfig}}


def register_configs() -> None:
    """Put the schema and the model presets into Hydra's ConfigStore, once (the entry points and :func:`compose` call
    it before composing; storing every node again costs ~40 ms)."""
    from hydra.core.config_store import ConfigStore

    from moh_vision.models import list_models, model_family

    if not OmegaConf.has_resolver("run_name"):  # hydra.run.dir's (configs/hydra/default.yaml)
        OmegaConf.register_new_resolver("run_name", run_name)
    store = ConfigStore.instance()
    if "train_schema.yaml" in store.repo:
        return
    store.store(name="train_schema", node=TrainConfig)
    store.store(name="eval_schema", node=EvalConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=schema)
    for name in list_models():  # a preset is data: its family's file plus its name
        store.store(group="model", name=name,
                    node={"defaults": [f"family/{model_family(name)}@_here_", "_self_"], "name": name})


# ---- Composition (the entry points' Hydra, tools and tests) and its errors -------------------
def compose(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """``configs/<config_name>.yaml`` composed with Hydra overrides, as the entry points see it; a bad override is a
    one-line :class:`ConfigError`."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - explain() decides what is a user error
        message = explain(err)
        if message is None:
            raise
        raise ConfigError(message) from None


def hydra_main(config_name: str) -> Callable[[Callable[[Any], Any]], Callable[[], Any]]:
    """``@hydra_main("train")``: what ``train.py``/``eval.py`` use instead of ``@hydra.main``. The schema and the
    model presets are registered first; a bad override, an unknown option or group choice is one ``error:`` line and
    exit status 2 before Hydra creates anything; the decorated function (the Hydra task: its file names the job and
    its log) runs under :func:`run_cli`."""
    import functools
    import os
    import sys

    import hydra

    def decorate(fn: Callable[[Any], Any]) -> Callable[[], Any]:
        @functools.wraps(fn)
        def task(cfg: Any) -> Any:
            return run_cli(fn, cfg)

        hydra_task = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=config_name)(task)

        def entry() -> Any:
            register_configs()
            os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises; this entry decides what the user sees
            try:
                return hydra_task()
            except Exception as err:
                message = explain(err) or os_error_line(err)  # Hydra could not write .hydra/ into the run dir
                if message is None:
                    raise
                print(f"error: {message}", file=sys.stderr)
                sys.exit(2)
        return entry
    return decorate


def explain(err: BaseException) -> Optional[str]:
    """One line for a composition error the user caused (a bad override, an unknown group option or key); else None."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(err, MissingConfigException):
        first = str(err).strip().splitlines()[0]
        found = re.search(r"Could not find '([^']+)/([^'/]+)'", first)
        if found:
            group, name = found.groups()
            hint = ""
            if group == "model":
                from moh_vision.models.families import suggest_model
                hint = suggest_model(name)
            return f"{group}={name} is unknown; {hint + '; ' if hint else ''}options: {', '.join(group_options(group))}"
        return first
    if isinstance(err, OverrideParseException):
        return f"cannot parse an override: {str(err).strip().splitlines()[0]}"
    if not isinstance(err, HydraException):  # errors inside a run are the run's (moh_vision.cli.run_cli)
        return None
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    key = getattr(cause, "full_key", None)
    given = re.search(r"override (\S+?)=(.*)$", str(err).splitlines()[0])
    value = given.group(2) if given else None
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and key:
        parent, _, leaf = str(key).rpartition(".")
        known = known_keys(parent)
        return f"unknown option {key}" + (f"; {parent or 'the config'} has: {', '.join(known)}" if known else "")
    if isinstance(cause, ValidationError) and key:
        meta, annotation = schema_field(str(key))
        expects = type_words(annotation) if annotation is not None else "another value"
        allowed = allowed_text(meta)
        shown = f"{key}={value}" if value is not None else str(key)
        return f"{shown}: expected {expects}" + (f" ({allowed})" if allowed else "")
    return " ".join(str(err).split())[:400]


def group_options(group: str) -> List[str]:
    """The options of a config group: its YAML files and what :func:`register_configs` stored (the presets)."""
    from hydra.core.config_store import ConfigStore

    stored = ConfigStore.instance().repo
    for part in group.split("/"):
        stored = stored.get(part, {}) if isinstance(stored, dict) else {}
    names = {p.stem for p in (CONFIG_DIR / group).glob("*.yaml")}
    return sorted(names | {name[:-len(".yaml")] for name in stored if name.endswith(".yaml")})


def _schemas_at(parts: Sequence[str]) -> List[type]:
    """The schema dataclasses that can sit at the dotted path ``parts`` ([]: the root); for a group whose schema
    depends on its option (data, task, ...), every option's."""
    if parts and parts[0] in SCHEMAS:
        schemas, parts = list(SCHEMAS[parts[0]].values()), parts[1:]
    else:
        schemas = [EvalConfig if parts and parts[0] in ("ckpt", "eval", "pretrained") else TrainConfig]
    for part in parts:
        hints = [typing.get_type_hints(schema).get(part) for schema in schemas]
        schemas = [hint for hint in hints if dataclasses.is_dataclass(hint)]
    return schemas


def schema_field(key: str) -> Tuple[Dict[str, Any], Any]:
    """(metadata, type annotation) of the schema field at dotted ``key``; ({}, None) when unknown."""
    *parent, leaf = key.split(".")
    for schema in _schemas_at(parent):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        if leaf in fields:
            return dict(fields[leaf].metadata), typing.get_type_hints(schema)[leaf]
    return {}, None


def known_keys(parent: str) -> List[str]:
    """The option names under ``parent`` ('' = the root) in the schema."""
    schemas = _schemas_at(parent.split(".") if parent else [])
    return sorted({f.name for schema in schemas for f in dataclasses.fields(schema)})


def type_words(annotation: Any) -> str:
    """A type annotation in words: ``an integer``, ``a number or null``, ``true or false``..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        words = " or ".join(type_words(a) for a in inner)
        return f"{words} or null" if len(inner) < len(args) else words
    if origin in (list, List):
        return f"a list of {type_words(args[0]).split(' ', 1)[-1]}s" if args else "a list"
    if origin in (dict, Dict):
        return "a mapping {key: value}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(annotation, "a value")


# ---- Values: what types cannot check ---------------------------------------------------------
def validate(cfg: DictConfig) -> Any:
    """Check every value of a composed ``train``/``eval`` config against the schema (ranges, choices, files, the
    attention's options, the model with its arguments) and return it as typed objects (``OmegaConf.to_object``).
    Raises a one-line :class:`ConfigError`; nothing has been built or written."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        OmegaConf.resolve(cfg)
        typed = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        key = getattr(err, "full_key", "") or "a value"
        meta, annotation = schema_field(str(key))
        what = allowed_text(meta) or (type_words(annotation) if annotation is not None else "a value")
        raise ConfigError(f"{key} is required: give {key}=<{what}>") from None
    _check_fields(typed, "")
    if isinstance(getattr(typed, "data", None), CustomData):
        data_class(typed.data.name)
    if isinstance(typed, EvalConfig):
        check_eval_source(typed)
    if isinstance(typed, TrainConfig):
        parse_steps(typed.trainer.profile)
        check_optimizer(typed.optim.name)
        check_attention(typed.attention)
        check_model(typed.model, typed.attention, typed.task.name)
        check_task_model(typed.task.name, typed.model.name)
    return typed


def parse_steps(text: Optional[str], key: str = "trainer.profile") -> Optional[Tuple[int, int]]:
    """``"2:3"`` -> ``(2, 3)``; None or empty -> None; anything else a one-line :class:`ConfigError`."""
    if text is None or str(text).strip() == "":
        return None
    first, sep, last = str(text).partition(":")
    if sep and first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise ConfigError(f"{key}={text}: expected <first>:<last>, optimizer steps counted from 1 with first <= last "
                      f"(e.g. {key}=100:102)")


def check_optimizer(name: str) -> None:
    """``optim.name`` names one of timm's optimizers (``lookahead_<name>`` too), or a one-line error."""
    from timm.optim import list_optimizers

    words, known = name.lower().split("_"), list_optimizers()
    if words[-1] not in known or len(words) > 2 or (len(words) == 2 and words[0] != "lookahead"):
        raise ConfigError(f"optim.name={name} is unknown; timm's optimizers (or lookahead_<name>): {', '.join(known)}")


def check_eval_source(run: EvalConfig) -> None:
    """``eval.py`` evaluates a train.py checkpoint (``ckpt=``) or released weights (``model=`` with ``pretrained=``)."""
    released = "model=<preset> pretrained=<file | hub id | true> data=<imagenet | imagefolder> data.root=<dir>"
    if run.ckpt is None and run.pretrained is None:
        raise ConfigError(f"ckpt is required: give ckpt=<a checkpoint written by train.py>, or {released} "
                          f"for released weights")
    if run.ckpt is not None and (run.pretrained is not None or run.model is not None):
        raise ConfigError("give ckpt=<checkpoint> (its model travels inside it) or model=<preset> "
                          "pretrained=<weights>, not both")
    if run.pretrained is not None and run.model is None:
        raise ConfigError(f"pretrained={run.pretrained} needs the model it belongs to: {released}")


def _check_fields(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_fields(value, key + ".")
            continue
        _check_value(key, value, dict(f.metadata))


def _check_value(key: str, value: Any, meta: Dict[str, Any]) -> None:
    if value is None or not meta:
        return
    bad = "choices" in meta and value not in meta["choices"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bad = bad or ("at_least" in meta and value < meta["at_least"]) or ("above" in meta and value <= meta["above"]) \
            or ("at_most" in meta and value > meta["at_most"]) or ("below" in meta and value >= meta["below"])
    if bad:
        raise ConfigError(f"{key}={_word(value)}: must be {allowed_text(meta)}")
    if meta.get("path"):
        check_path(key, str(value), meta["path"])


def check_path(key: str, value: str, kind: str) -> None:
    """A path option names what it should: an existing directory, or a file a checkpoint loader can read."""
    from moh_vision.checkpoints import check_checkpoint_file, previous_path

    if kind == "resume" and value in ("auto", "never"):
        return
    path = Path(value).expanduser()
    if kind == "resume" and not path.exists() and previous_path(path).exists():
        path = previous_path(path)  # the run stopped while replacing it: its previous copy resumes
    if kind == "dir":
        if not path.is_dir():
            raise ConfigError(f"{key}={value}: {'not a directory' if path.exists() else 'no such directory'}")
        return
    problem = check_checkpoint_file(path)
    if problem:
        raise ConfigError(f"{key}={value}: {problem}")


def check_attention(attention: Dict[str, Any]) -> None:
    """The ``attention`` group: a registered variant (or null: the model preset's own), known options of the right
    types; their ranges are checked when the model is built (:func:`check_model`)."""
    from moh_vision.attention import attention_class, attention_options, list_attention, list_forms

    name = attention.get("name")
    weight = attention.get("aux_loss_weight")
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
        raise ConfigError(f"attention.aux_loss_weight={_word(weight)}: must be a number at least 0")
    if name is None:
        extra = sorted(k for k, v in attention.items() if k not in ("name", "aux_loss_weight") and v is not None)
        if extra:
            raise ConfigError(f"attention=preset keeps the model's own attention; remove attention.{extra[0]}")
        return
    if name not in list_attention():
        raise ConfigError(f"attention.name={name} is unknown; registered: {', '.join(list_attention())}")
    known: List[str] = []
    hints: Dict[str, Any] = {}
    for form in list_forms():
        known += [o for o in attention_options(name, form) if o not in known]
        for klass in attention_class(name, form).__mro__:
            if "__init__" in vars(klass):
                hints = {**typing.get_type_hints(klass.__init__), **hints}
    for key, value in attention.items():
        if key in ("name", "aux_loss_weight"):
            continue
        if key not in known:
            raise ConfigError(f"unknown option attention.{key} for attention={name}; it has: {', '.join(known)}")
        per_layer = value if isinstance(value, (list, tuple)) else [value]  # a list: one value per layer
        if key in hints and not all(v is None or _matches(v, hints[key]) for v in per_layer):
            raise ConfigError(f"attention.{key}={_word(value)}: expected {type_words(hints[key])} "
                              f"(or a list of them, one per layer)")


def _matches(value: Any, annotation: Any) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if origin in (list, List, typing.Sequence, Sequence) or annotation in (list, List):
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value) if args else True
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is type(None):
        return value is None
    return isinstance(value, annotation) if isinstance(annotation, type) else True


def check_model(model: ModelConfig, attention: Dict[str, Any], task: Optional[str] = None) -> None:
    """Build the model once on the meta device (no memory, no weights): a bad model name, a constructor argument it
    does not take, one given twice (in ``model.kwargs`` and by the ``task`` or the attention group) or an attention
    option out of range fails here, before the run starts."""
    import torch

    from moh_vision.models.build import build_model, check_model_kwargs

    if task is not None:
        check_model_kwargs(model.kwargs, _load(TASK_CLASSES[task]).model_arguments, task)

    if model.checkpoint_path and model.init_from:
        raise ConfigError("give model.checkpoint_path (this model's own weights) or model.init_from (a dense "
                          "checkpoint to continue-tune from), not both")
    try:
        with torch.device("meta"):
            build_model(model.name, attention=attention, **dict(model.kwargs))
    except ConfigError as err:
        raise ConfigError(f"model={model.name} with attention={attention.get('name') or 'preset'}: {err}") from None


def check_task_model(task: str, model: str) -> None:
    """A task trains the model families it knows (:data:`TASK_MODEL_FAMILIES`)."""
    from moh_vision.models import model_family

    families = TASK_MODEL_FAMILIES[task]
    if model_family(model) not in families:
        hint = " (experiment=diffusion sets a DiT, the digits and their recipe)" if task == "diffusion" else ""
        raise ConfigError(f"task={task} trains {' or '.join(families)} models, not model={model} "
                          f"({model_family(model)}){hint}")


# ---- Building what a group names -------------------------------------------------------------
def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _options(group_cfg: Any) -> Dict[str, Any]:
    values = dataclasses.asdict(group_cfg) if dataclasses.is_dataclass(group_cfg) else dict(group_cfg)
    values.pop("name", None)
    return values


# Configs saved by earlier releases dispatch data and task by ``_target_``.
_LEGACY_TARGETS = {target.replace(":", "."): name for table in (DATA_CLASSES, TASK_CLASSES)
                   for name, target in table.items()}


def group_name(group_cfg: Any) -> str:
    """The ``name`` a data/task config dispatches on (a config saved by an earlier release: its ``_target_``)."""
    values = group_cfg if isinstance(group_cfg, dict) else vars(group_cfg)
    if "_target_" in values:
        return _LEGACY_TARGETS[values["_target_"]]
    return values["name"]


def build_data(data_cfg: Any, splits: Optional[Tuple[str, ...]] = None) -> Any:
    """The data object a ``data`` config names (``data=custom``: the class at ``module:Class``); ``splits``
    (``("val",)`` for evaluation) reads only those splits where the data class can (image folders)."""
    name = group_name(data_cfg)
    values = {k: v for k, v in _options(data_cfg).items() if k != "_target_"}
    if ":" in name:
        return data_class(name)(**values["kwargs"])
    if splits is not None and name in ("imagefolder", "imagenet"):
        values["splits"] = tuple(splits)
    return _load(DATA_CLASSES[name])(**values)


def data_class(path: str) -> type:
    """The class ``module:Class`` names, or a one-line error."""
    try:
        return _load(path)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"data.name={path}: cannot import it ({err}); give module:Class") from None


def build_task(task_cfg: Any, model: Dict[str, Any], attention: Dict[str, Any],
               kernels: Optional[Dict[str, Any]] = None) -> Any:
    """The task a ``task`` config names, for ``model``, ``attention``, ``kernels`` (dicts; kernels None: all auto)."""
    values = {k: v for k, v in _options(task_cfg).items() if k != "_target_"}
    return _load(TASK_CLASSES[group_name(task_cfg)])(model=model, attention=attention, kernels=kernels, **values)
