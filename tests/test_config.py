"""The typed configuration (moh_vision/config.py): every bad value of every option is one line naming the key,
the value and what is allowed, before anything is built or written.

The sweep is generated from the schema itself, so an option added to it is swept too: each numeric option
with a non-number, and with zero and a negative where its range forbids them; each choice with an unknown
name; each path option with a missing and a garbage file; each group with an unknown option name.
"""
import copy
import dataclasses
import logging
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from moh_vision import config as schema
from moh_vision.cli import run_cli
from moh_vision.config import ConfigError, compose, validate

REPO = Path(__file__).resolve().parents[1]

# The group option whose schema holds a field, and what that option needs to compose on its own.
GROUP_SETUP = {
    "trainer": [], "optim": [], "model": [], "": [],
    "sched": {name: [f"sched={name}"] for name in ("cosine", "constant", "poly", "wsd", "step", "multistep")},
    "logger": {"csv": ["logger=csv"], "none": ["logger=none"], "wandb": ["logger=wandb"]},
    "data": {"digits": ["data=digits"], "imagefolder": ["data=imagefolder", "data.root={dir}"],
             "latents": ["experiment=latent_diffusion", "data.root={dir}"],
             "custom": ["data=custom", "data.name=moh_vision.data.digits:DigitsData"]},
    "task": {"classification": [], "diffusion": ["experiment=diffusion"]},
}
ROOT_GROUPS = {"trainer": schema.TrainerConfig, "optim": schema.OptimConfig, "model": schema.ModelConfig}


def _leaves(cls, prefix=""):
    """(dotted key, field, type) of every leaf option of a schema dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _leaves(hint, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hint


def _schema_options():
    """(group, option or None, schema) for every schema the train config composes."""
    yield "", None, None  # the root's own leaves (seed, tag)
    for group, cls in ROOT_GROUPS.items():
        yield group, None, cls
    for group in ("sched", "logger", "data", "task"):
        for option, cls in schema.SCHEMAS[group].items():
            yield group, option, cls


def _cases():
    """(id, overrides, key, bad value) for every bad value the sweep tries."""
    for group, option, cls in _schema_options():
        setup = GROUP_SETUP[group] if option is None else GROUP_SETUP[group][option]
        leaves = ([(f.name, f, typing.get_type_hints(schema.TrainConfig)[f.name])
                   for f in dataclasses.fields(schema.TrainConfig) if f.name in ("seed", "tag")]
                  if cls is None else list(_leaves(cls)))
        for sub, f, hint in leaves:
            key = f"{group}.{sub}" if group else sub
            meta = dict(f.metadata)
            inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            kind = inner[0]
            if sub == "name":
                continue  # the group's option, swept as a group choice below
            if kind in (int, float):
                yield f"{key}=abc", setup, key, "abc"
                low = meta.get("at_least", meta.get("above"))
                if low is not None and (low > 0 or "above" in meta):
                    yield f"{key}=0", setup, key, "0"
                if low is not None and low >= 0:
                    yield f"{key}=-1", setup, key, "-1"
            if kind is bool:
                yield f"{key}=maybe", setup, key, "maybe"
            if meta.get("choices") and kind is not bool:
                bad = "2" if kind is int else "bogus"
                yield f"{key}={bad}", setup, key, bad
            if meta.get("path") in ("checkpoint", "resume"):
                yield f"{key}=missing", setup, key, "{missing}"
                yield f"{key}=garbage", setup, key, "{garbage}"
            if meta.get("path") == "dir":
                yield f"{key}=missing-dir", setup, key, "{missing}"
                yield f"{key}=a-file", setup, key, "{garbage}"
        if group:
            yield f"{group}.unknown", setup, f"{group}.no_such_option", "1"
    for group in ("attention", "model", "data", "optim", "sched", "trainer", "logger", "task", "experiment", "sweep"):
        yield f"{group}=bogus", [], group, "bogus"


CASES = list(_cases())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    garbage = root / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint\n" * 10)
    return {"dir": str(root), "missing": str(root / "absent.pt"), "garbage": str(garbage)}


def _fill(text: str, files) -> str:
    return text.format(**files)


def test_the_sweep_covers_every_group_and_kind():
    keys = {key for _, _, key, _ in CASES}
    assert {"trainer.epochs", "trainer.clip_grad", "optim.lr", "seed", "sched.warmup_epochs", "data.img_size",
            "data.root", "task.sample.cfg_scale", "task.vae.path", "model.checkpoint_path", "model.init_from",
            "trainer.resume", "trainer.amp", "logger.mode", "trainer.ema.decay"} <= keys
    assert len(CASES) > 150


@pytest.fixture(scope="module")
def composed(files):
    """The composed config of each setup, composed once (Hydra's composition takes ~0.2 s)."""
    cache = {}

    def get(setup):
        key = tuple(_fill(s, files) for s in setup)
        if key not in cache:
            cache[key] = compose("train", list(key))
        return copy.deepcopy(cache[key])
    return get


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_bad_value_is_one_line_naming_key_and_value(case, files, composed):
    """Values a type rejects (a non-number, an unknown key or group option) go through Hydra's composition as
    on the command line; values of the right type (zero, negative, an unknown choice, a bad file) are set on
    the composed config, which is what the composition would hand over."""
    _, setup, key, value = case
    value = _fill(value, files)
    with pytest.raises(ConfigError) as err:
        parsed = yaml.safe_load(value)
        is_group = "." not in key
        if is_group or key.endswith("no_such_option") or not isinstance(parsed, (int, float, str)) \
                or isinstance(parsed, bool) or value in ("abc", "maybe"):
            validate(compose("train", [_fill(s, files) for s in setup] + [f"{key}={value}"]))
        else:
            cfg = composed(setup)
            OmegaConf.update(cfg, key, parsed)
            validate(cfg)
    message = str(err.value)
    assert "\n" not in message
    leaf = key.split(".")[-1]
    assert leaf in message, message
    if key not in ("attention", "model", "data", "optim", "sched", "trainer", "logger", "task", "experiment", "sweep") \
            and not key.endswith("no_such_option"):
        assert value in message or value.rsplit("/", 1)[-1] in message, message


def test_good_values_pass_and_come_back_typed():
    run = validate(compose("train", ["trainer.epochs=3", "optim.lr=1e-3", "attention.activation_ratio=0.5"]))
    assert isinstance(run.trainer, schema.TrainerConfig) and run.trainer.epochs == 3
    assert isinstance(run.data, schema.DigitsData) and run.optim.lr == 1e-3
    assert run.attention["activation_ratio"] == 0.5


@pytest.mark.parametrize("overrides,words", [
    (["attention.activation_ratio=2"], "activation_ratio=2"),
    (["attention.topk=abc"], "attention.topk=abc"),
    (["attention=moa", "attention.noisy_gating=3"], "attention.noisy_gating=3"),
    (["+attention.bogus=1"], "attention.bogus"),
    (["attention.aux_loss_weight=-1"], "aux_loss_weight=-1"),
    (["model.kwargs={no_such_arg: 1}"], "no_such_arg"),
    (["attention=preset", "+attention.topk=2"], "attention.topk"),
    (["data=imagefolder"], "data.root is required"),
    (["experiment=diffusion", "model=transnext_nano"], "task=diffusion"),
    (["data=custom", "data.name=no_such_module:Data"], "data.name=no_such_module:Data"),
])
def test_attention_model_and_required_values(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("{", r"\{")):
        validate(compose("train", overrides))


def test_eval_config(files):
    with pytest.raises(ConfigError, match="ckpt is required"):
        validate(compose("eval", []))
    for bad in (files["missing"], files["garbage"]):
        with pytest.raises(ConfigError, match="ckpt="):
            validate(compose("eval", [f"ckpt={bad}"]))
    good = Path(files["dir"]) / "good.pt"
    torch.save({"model": {}}, good)
    with pytest.raises(ConfigError, match="eval.batch_size=0"):
        validate(compose("eval", [f"ckpt={good}", "eval.batch_size=0"]))


def test_a_failed_run_logs_its_traceback_to_the_log_file(tmp_path):
    handler = logging.FileHandler(tmp_path / "train.log", delay=True)
    logging.getLogger().addHandler(handler)
    try:
        def broken():
            raise RuntimeError("something broke deep inside")
        with pytest.raises(RuntimeError):
            run_cli(broken)
        with pytest.raises(SystemExit) as stop:
            run_cli(lambda: (_ for _ in ()).throw(ConfigError("a bad value")))
        assert stop.value.code == 2
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    text = (tmp_path / "train.log").read_text()
    assert "Traceback" in text and "something broke deep inside" in text
    assert "a bad value" not in text  # a rejected config writes nothing


def test_train_py_rejects_before_writing_anything(tmp_path, train_in_process):
    """The real entry point (train.py's main, in-process): exit 2, one stderr line, and the run directory holds
    only Hydra's .hydra/ (a value error) or does not exist (a type error stops Hydra before it creates it)."""
    for word, line in (("trainer.batch_size=0", "error: trainer.batch_size=0: must be at least 1"),
                       ("trainer.epochs=abc", "error: trainer.epochs=abc: expected an integer (at least 1)")):
        run_dir = tmp_path / word.split("=")[0]
        code, stderr = train_in_process(word, f"hydra.run.dir={run_dir}")
        assert code == 2 and stderr.strip() == line
        assert not run_dir.exists() or sorted(p.name for p in run_dir.iterdir()) == [".hydra"]
    assert (tmp_path / "trainer.batch_size" / ".hydra").is_dir()


def test_a_moh_preset_keeps_its_heads_under_the_default_attention():
    """model=<MoH preset> needs no attention override: the default attention=moh (activation_ratio null) keeps
    the preset's per-layer heads, and an explicit ratio replaces them."""
    from moh_vision.attention import routed_modules
    from moh_vision.models import build_model

    def heads(overrides):
        run = validate(compose("train", ["model=moh_dit_s_2_75", "experiment=diffusion", *overrides]))
        with torch.device("meta"):
            model = build_model(run.model.name, attention=run.attention)
        return [(m.shared_heads, m.topk) for _, m in routed_modules(model)]

    with torch.device("meta"):
        official = [(m.shared_heads, m.topk) for _, m in routed_modules(build_model("moh_dit_s_2_75"))]
    assert official[:3] == [(2, 1), (2, 1), (3, 1)]  # not what the 0.75 policy gives (2, 2)
    assert heads(["model=moh_dit_s_2_75"]) == official == heads(["attention=preset"])
    assert heads(["model=moh_dit_s_2_75", "attention.activation_ratio=0.5"]) != official


def test_no_config_option_has_a_default_hidden_in_code():
    """Defaults live in the schema: no ``<cfg>.get(key, default)`` in the package, the entry points or the tools."""
    import re
    pattern = re.compile(r"(\b\w*(cfg|config|conf|options)\w*(\[[^]]*\])?|\bor \{\}\))\.get\(\s*[^,()]+,")
    files = [*(REPO / "moh_vision").rglob("*.py"), *(REPO / "tools").glob("*.py"), REPO / "train.py", REPO / "eval.py"]
    hits = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
    assert pattern.search('x = self.cfg.get("amp", "none")') and pattern.search('(cfg.get("model") or {}).get("a", 1)')


def test_a_truncated_checkpoint_is_one_line_at_load(tmp_path):
    """A file that starts like a checkpoint but is cut short passes the up-front check; loading it is then a
    one-line ConfigError, not a torch traceback."""
    from moh_vision.models import build_model

    whole = tmp_path / "whole.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, whole)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:300])
    run = validate(compose("train", [f"model.checkpoint_path={cut}"]))  # the format looks right
    with pytest.raises(ConfigError) as err:
        build_model(run.model.name, attention=run.attention, checkpoint_path=run.model.checkpoint_path)
    assert "\n" not in str(err.value) and "cut.pt" in str(err.value)


def test_no_code_tests_a_type_name():
    """Capabilities and families are declared, never read from a class name."""
    import re
    pattern = re.compile(r"__name__\s*(==|!=|in\b)|__class__\.__name__")
    hits = [f"{path.relative_to(REPO)}:{number}" for path in (REPO / "moh_vision").rglob("*.py")
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line) and "__main__" not in line]
    assert not hits, hits


def test_the_model_group_offers_only_models_that_run():
    """Every ``model=`` option composes and names a registered model (the family files are not options)."""
    from moh_vision.config import compose, group_options
    from moh_vision.models import list_models
    from moh_vision.models.families import suggest_model

    options = group_options("model")
    assert options == list_models()
    assert compose("train", ["model=moh_dit_s_2_75"]).model.name == "moh_dit_s_2_75"
    assert "model=plain_vit_small with img_size=384" in suggest_model("deit_small_patch16_384.fb_in1k")
    assert suggest_model("resnet50") == ""
