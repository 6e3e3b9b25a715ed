"""The variant contract: every variant declares what the rest of the codebase asks, its YAML mirrors
its options, and a variant is discovered without an edit anywhere else (package module or entry point)."""
from __future__ import annotations

import importlib
import importlib.metadata
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import moh_vision  # noqa: F401
from moh_vision.attention import (AttentionVariant, active_head_fraction, build_attention, list_attention,
                                  record_routing, variant_class, variant_option_defaults)
from moh_vision.attention import registry as registry_module

REPO = Path(__file__).resolve().parents[1]
CONFIG_ONLY_KEYS = ("name", "aux_loss_weight")  # training settings in configs/attention, not module options


@pytest.mark.parametrize("name", list_attention())
def test_yaml_mirrors_the_variant_options(name):
    path = REPO / "configs" / "attention" / f"{name}.yaml"
    assert path.is_file(), f"variant {name} has no configs/attention/{name}.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["name"] == name
    options = {k: v for k, v in cfg.items() if k not in CONFIG_ONLY_KEYS}
    assert options == variant_option_defaults(name), "the YAML and the variant's __init__ defaults differ"
    cls = variant_class(name)
    assert set(cls.option_ranges) <= set(options), "option_ranges names an option the variant does not take"
    assert cls.aux_reduction in ("mean", "sum")


@pytest.mark.parametrize("name", list_attention())
def test_every_variant_answers_the_contract(name):
    cls = variant_class(name)
    options = cls.options_for_ratio(8, 1.0)  # every variant realises "all heads"
    m = build_attention(name, 32, 8, **options)
    assert isinstance(m, AttentionVariant) and m.active_heads() == 8
    if name != "mha":  # routed variants realise a ratio below 1 with fewer active heads
        half = build_attention(name, 32, 8, **cls.options_for_ratio(8, 0.5))
        assert half.active_heads() == 4 and active_head_fraction(half) == 0.5
        assert set(half.routing_description()) >= {"num_heads", "active_heads"}
    state = m.state_dict()
    own = [k for k in state if k.split(".")[0] in cls.variant_parameters]
    if cls.dense_start_refusal is None:
        start = m.dense_start(1e-3, torch.Generator().manual_seed(0))
        assert set(start) == set(own), "dense_start must start exactly the variant's own parameters"
    with record_routing(m) as routing:
        y = m.train()(torch.randn(2, 5, 32))
    assert y.shape == (2, 5, 32)
    assert routing.aux_loss().ndim == 0


def test_composed_classes_are_importable_by_name():
    m = build_attention("moh", 32, 4, activation_ratio=0.5)
    cls = type(m)
    assert cls.__module__ == "moh_vision.attention.forms" and cls.__qualname__ == "moh__sdpa"
    from moh_vision.attention import forms
    from moh_vision.models import transnext
    assert getattr(forms, "moh__sdpa") is cls
    assert getattr(transnext, "moa__transnext_full").__qualname__ == "moa__transnext_full"
    again = pickle.loads(pickle.dumps(m))
    assert type(again) is cls and torch.equal(again.wg.weight, m.wg.weight)
    with pytest.raises(AttributeError):
        forms.not_a_class  # noqa: B018
    with pytest.raises(AttributeError):
        forms.nope__sdpa  # noqa: B018


def test_unknown_attention_lists_the_known_ones():
    from moh_vision.errors import ConfigError
    with pytest.raises(ConfigError, match="known: mha, moh, moa"):
        build_attention("nope", 32, 4)


VARIANT_SOURCE = '''
"""A variant that lives in another package: every head, output halved."""
from moh_vision.attention import AttentionVariant, register_attention


@register_attention("{name}")
class Halved(AttentionVariant):
    def forward(self, x):
        return 0.5 * self.output(self.heads(x))
'''


def test_a_separate_package_adds_a_variant_through_an_entry_point(tmp_path, monkeypatch):
    """A pip-installed package declares ``[project.entry-points."moh_vision.attention"]``; importing the
    attention package loads it. Simulated with a dist-info directory on sys.path."""
    site = tmp_path / "site"
    (site / "halved_attention").mkdir(parents=True)
    (site / "halved_attention" / "__init__.py").write_text(VARIANT_SOURCE.format(name="halved_test"))
    info = site / "halved_attention-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halved-attention\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[moh_vision.attention]\nhalved = halved_attention\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    saved = dict(registry_module._VARIANTS)
    try:
        import moh_vision.attention as attention_package
        importlib.reload(attention_package)  # discovery runs at import
        assert "halved_test" in list_attention()
        m = build_attention("halved_test", 16, 2)
        dense = build_attention("mha", 16, 2)
        dense.load_state_dict(m.state_dict())
        x = torch.randn(1, 3, 16)
        torch.testing.assert_close(m(x), 0.5 * dense(x))
    finally:
        registry_module._VARIANTS.clear()
        registry_module._VARIANTS.update(saved)
        sys.modules.pop("halved_attention", None)


def test_a_broken_entry_point_does_not_break_the_package(tmp_path, monkeypatch, caplog):
    site = tmp_path / "site"
    info = site / "broken_attention-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-attention\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[moh_vision.attention]\nbroken = no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    import moh_vision.attention as attention_package
    with caplog.at_level("WARNING"):
        importlib.reload(attention_package)
    assert "broken" in caplog.text and {"mha", "moh", "moa"} <= set(list_attention())


def test_nothing_outside_a_variant_file_compares_a_variant_name():
    """The variant contract: no code outside moh_vision/attention/<variant>.py tests an attention name
    against a literal (``== "moh"``, ``in ("moh", "moa")``, ...)."""
    import re
    names = "|".join(list_attention())
    quoted = rf"""["']({names})["']"""
    pattern = re.compile(rf"""(==|!=)\s*{quoted}|{quoted}\s*(==|!=)|\bin\s+[(\[{{][^)\]}}]*{quoted}""")
    offenders = []
    variant_files = {Path(sys.modules[variant_class(n).__module__].__file__).resolve() for n in list_attention()}
    for path in [*(REPO / "moh_vision").rglob("*.py"), *(REPO / "tools").glob("*.py"), REPO / "train.py",
                 REPO / "eval.py"]:
        if path.resolve() in variant_files:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.lstrip().startswith("for "):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_model_family_is_detected_from_a_name_substring():
    import re
    pattern = re.compile(r"""["'](dit|transnext|moh_|dit_|plain_vit)["']\s+(not\s+)?in\s+\w*name|\.startswith\(["'](moh_|dit|plain_vit)""")
    offenders = []
    for path in [*(REPO / "moh_vision").rglob("*.py"), *(REPO / "tools").glob("*.py")]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_add_your_own_example_is_one_file(tmp_path):
    """README's "add your own attention": the shipped example is a single module with no import from
    elsewhere in the project but the attention package and errors."""
    source = Path(sys.modules[variant_class("random_heads").__module__].__file__).read_text()
    imports = [line for line in source.splitlines() if line.startswith(("from moh_vision", "from ."))]
    assert all(line.startswith(("from .registry", "from .routing", "from moh_vision.errors")) for line in imports)
    assert textwrap.dedent(source).count("@register_attention") == 1


def test_explicit_heads_win_over_the_ratio():
    """``attention.shared_heads=2 attention.topk=1`` win over an activation_ratio that is also set."""
    from moh_vision.config import compose
    from moh_vision.models import build_model
    cfg = compose("train", overrides=["model=plain_vit_nano", "attention.shared_heads=2", "attention.topk=1",
                                      "attention.activation_ratio=0.75"])
    model = build_model("plain_vit_nano", attention=dict(cfg.attention))
    layers = [m for _, m in __import__("moh_vision").attention.find_attention(model)]
    assert {(m.shared_heads, m.topk) for m in layers} == {(2, 1)}
    moa = build_attention("moa", 32, 8, topk=3, activation_ratio=0.5)
    assert moa.topk == 3
