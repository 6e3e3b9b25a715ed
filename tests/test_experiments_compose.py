"""Every experiment (``configs/experiment/**``, the comparison arms included) and every sweep composes and
passes the schema's checks, as ``python train.py experiment=<name> --cfg job`` does, and composes what its
file says: the model, attention, data and task its defaults list (and the experiments it extends) choose."""
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from moh_vision.config import compose, validate
from moh_vision.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT_DIR = REPO / "configs" / "experiment"
EXPERIMENTS = sorted(p.relative_to(EXPERIMENT_DIR).with_suffix("").as_posix() for p in EXPERIMENT_DIR.rglob("*.yaml"))
SWEEPS = sorted(p.stem for p in (REPO / "configs" / "sweep").glob("*.yaml"))
ARMS = sorted(n.split("/", 1)[1] for n in EXPERIMENTS if n.startswith("compare/"))
GROUPS = ("model", "attention", "data", "task")
DATA_NAME = {"digits_diffusion": "digits"}  # a data option whose data.name is its parent's
# What a user must give (``???`` in the experiment): the ImageNet / latents experiments and the recipes need
# data.root (an existing directory), the continue-tuning experiments model.init_from (a readable checkpoint).
USER_GIVEN = {"data.root", "model.init_from"}
# The official drop-path rates of the TransNeXt / MoH-ViT ImageNet runs (all else: transnext_imagenet_recipe).
DROP_PATH = {"transnext_micro": 0.15, "transnext_tiny": 0.25, "transnext_small": 0.45, "transnext_base": 0.60,
             "moh_transnext_small_75": 0.45, "moh_transnext_small_80": 0.45, "moh_transnext_base_50": 0.60,
             "moh_transnext_base_75": 0.60}


@pytest.fixture(scope="module")
def given(tmp_path_factory):
    """USER_GIVEN's values: a data directory and a dense checkpoint (validation reads only its format)."""
    root = tmp_path_factory.mktemp("experiments")
    torch.save({"model": {}}, root / "dense.pt")
    return {"data.root": str(root), "model.init_from": str(root / "dense.pt")}


def _defaults(path: Path) -> list:
    return (yaml.safe_load(path.read_text()) or {}).get("defaults", [])


def _choices(name: str) -> dict:
    """group -> option that ``experiment=<name>`` picks: the experiments it extends first, then its overrides."""
    chosen = {}
    for entry in _defaults(EXPERIMENT_DIR / f"{name}.yaml"):
        if isinstance(entry, str):
            if entry != "_self_":
                chosen.update(_choices(entry))
        else:
            (key, value), = entry.items()
            assert key.startswith("override /"), (name, key)
            chosen[key[len("override /"):]] = value
    return chosen


def _selection(name: str):
    """The overrides that select experiment <name>, and what its group choices should be. A comparison arm
    (compare/<arm>) sets only the attention: it is meant to run inside experiment=compare_attention, which
    sweeps +experiment/compare=<arm>, and is composed that way."""
    expected = {k: v for e in _defaults(REPO / "configs" / "train.yaml") if isinstance(e, dict) for k, v in e.items()}
    if name.startswith("compare/"):
        expected.update(_choices("compare_attention"))
        overrides = ["experiment=compare_attention", f"+experiment/compare={name.split('/', 1)[1]}"]
    else:
        overrides = [f"experiment={name}"]
    expected.update(_choices(name))
    return overrides, {g: expected[g] for g in GROUPS}


def test_every_experiment_file_is_collected():
    assert "transnext_imagenet_recipe" in EXPERIMENTS and "compare_attention" in EXPERIMENTS
    assert ARMS == ["mha", "moa_matched", "moh_50", "moh_75", "moh_90"]
    assert len(EXPERIMENTS) == len(list(EXPERIMENT_DIR.rglob("*.yaml"))) >= 30


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_validates_and_picks_what_its_file_says(name, given):
    overrides, expected = _selection(name)
    cfg = compose("train", overrides)
    needed = OmegaConf.missing_keys(cfg)
    assert needed <= USER_GIVEN, f"{name} leaves {sorted(needed - USER_GIVEN)} unset"
    if needed:  # without them: one line naming what to give
        with pytest.raises(ConfigError, match="is required: give"):
            validate(cfg.copy())
    for key in needed:  # as data.root=<dir> / model.init_from=<file> on the command line would
        OmegaConf.update(cfg, key, given[key])
    run = validate(cfg)
    assert run.model.name == expected["model"]
    assert run.attention["name"] == (None if expected["attention"] == "preset" else expected["attention"])
    assert run.data.name == DATA_NAME.get(expected["data"], expected["data"])
    assert run.task.name == expected["task"]
    if name.startswith("moh_"):  # an official MoH run trains its preset's own per-stage / per-layer heads
        assert run.model.name == name and run.attention["name"] is None
    if name in DROP_PATH:
        assert run.model.kwargs["drop_path_rate"] == DROP_PATH[name]


def test_transnext_experiments_share_one_recipe(given):
    names = sorted(DROP_PATH)
    runs = {n: validate(compose("train", [f"experiment={n}", f"data.root={given['data.root']}"])) for n in names}
    recipe = {n: repr((r.trainer, r.optim, r.sched, r.logger, r.data, r.task, r.seed)) for n, r in runs.items()}
    assert len(set(recipe.values())) == 1, recipe
    run = runs["transnext_base"]
    assert (run.trainer.batch_size, run.trainer.epochs, run.optim.lr, run.data.img_size, run.data.name) == \
        (1024, 300, 1.0e-3, 224, "imagenet")
    for name in names:  # each file extends the recipe and sets only its model, attention and drop path
        text = yaml.safe_load((EXPERIMENT_DIR / f"{name}.yaml").read_text())
        assert "transnext_imagenet_recipe" in text["defaults"] and set(text) == {"defaults", "model"}


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes_and_sweeps_existing_options(name):
    """A sweep is a multirun over options the composed config has (a typo would sweep nothing)."""
    cfg = compose("train", [f"sweep={name}"])
    validate(cfg)
    sweep = yaml.safe_load((REPO / "configs" / "sweep" / f"{name}.yaml").read_text())["hydra"]
    assert sweep["mode"] == "MULTIRUN"
    swept = [key for key in sweep["sweeper"]["params"] if not key.startswith("+")]
    missing = object()
    assert swept and all(OmegaConf.select(cfg, key, default=missing) is not missing for key in swept), swept


def test_train_py_cfg_job_prints_the_composed_experiment(train_in_process):
    """The real entry point (Hydra's own command line, the schema's registration)."""
    code, err = train_in_process("experiment=compare_attention", "--cfg", "job")
    assert code == 0, err
    printed = yaml.safe_load(train_in_process.stdout)
    assert printed["model"]["name"] == "plain_vit_nano" and printed["model"]["kwargs"]["num_heads"] == 8
    assert printed["data"]["name"] == "digits" and printed["attention"]["name"] == "moh"
