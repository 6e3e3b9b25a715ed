"""One word per idea (issue 60): "kernel" names an op's implementation only (``moh_vision/ops/``, the ``kernels``
config, the optimizer's fused/foreach implementation); how a head attends is the attention's *form*
(``register_form``, ``build_attention(..., form=...)``). The old ``kernel=`` key still builds, with a warning, and no
checkpoint carries the old name (no state-dict key holds it)."""
import ast
import warnings

import pytest
import timm
import torch

import moh_vision  # noqa: F401  (registers the models)
import moh_vision.attention as attention
from helpers import REPO
from moh_vision.attention import build_attention
from moh_vision.errors import ConfigError
from moh_vision.models.vit import build_attention_stack

# Identifiers outside ops/ that contain "kernel", each an implementation: the kernels config and the ops' own keyword
# (``ops.route_merge(..., kernel=self.kernels.routing)``), the optimizer's implementation, PyTorch's ``kernel_size``.
KERNELS_CONFIG = {"kernels", "Kernels", "KernelsConfig", "TRACED_KERNELS", "traced_kernels", "_kernel_choices",
                  "kernels_ran", "kernel_fallbacks", "kernels_in_use"}  # summary.json: which implementations ran
OPTIMIZER = {"optimizer_kernel", "optimizer_kernel_of"}
OPTIMIZER_KEYWORD = {"engine/optim.py", "engine/fit_setup.py", "apps/step_check.py"}  # build_optimizer(..., kernel=optimizer_kernel(...))


def _names(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id, node
    elif isinstance(node, ast.Attribute):
        yield node.attr, node
    elif isinstance(node, ast.arg):
        yield node.arg, node
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        yield node.name, node
    elif isinstance(node, ast.alias):
        yield (node.asname or node.name).split(".")[-1], node
    elif isinstance(node, ast.keyword) and node.arg:
        yield node.arg, node


def misused(path) -> list:
    """``file:line name`` for each identifier naming "kernel" that is not an implementation's."""
    rel = path.relative_to(REPO / "moh_vision").as_posix()
    tree = ast.parse(path.read_text())
    op_keywords = {id(k) for call in ast.walk(tree) if isinstance(call, ast.Call)
                   and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                   and call.func.value.id == "ops" for k in call.keywords if k.arg == "kernel"}
    wrong = []
    for node in ast.walk(tree):
        for name, where in _names(node):
            if "kernel" not in name.lower() or name in KERNELS_CONFIG | OPTIMIZER or name == "kernel_size":
                continue
            if name == "kernel" and (id(where) in op_keywords or rel in OPTIMIZER_KEYWORD):
                continue
            wrong.append(f"moh_vision/{rel}:{getattr(where, 'lineno', '?')} {name}")
    return wrong


def test_kernel_names_an_ops_implementation_only():
    package = REPO / "moh_vision"
    files = [p for p in sorted(package.rglob("*.py")) if p.relative_to(package).parts[0] != "ops"]
    wrong = [w for p in files for w in misused(p)]
    assert not wrong, "\n".join(wrong)
    assert not any("kernel" in name for name in attention.__all__) and "register_form" in attention.__all__


def test_the_check_catches_the_old_word(tmp_path, monkeypatch):
    """A file that registers a backbone's attention as a "kernel" fails the check."""
    import test_one_word
    path = tmp_path / "moh_vision" / "models" / "example.py"
    path.parent.mkdir(parents=True)
    path.write_text('def register_kernel(name):\n    return name\n\n\nattn = build(kernel="sdpa")\n')
    monkeypatch.setattr(test_one_word, "REPO", tmp_path)
    assert misused(path) == ["moh_vision/models/example.py:1 register_kernel", "moh_vision/models/example.py:5 kernel"]


def test_the_old_kernel_keyword_still_builds_with_a_warning():
    new = build_attention("moh", 32, 4, form="sdpa", activation_ratio=0.5)
    with pytest.warns(DeprecationWarning, match="now called 'form'"):
        old = build_attention("moh", 32, 4, kernel="sdpa", activation_ratio=0.5)
    assert type(old) is type(new)
    with pytest.warns(DeprecationWarning):
        full = build_attention("mha", 48, 4, kernel="transnext_full", input_resolution=4)
    assert full.form_name == "transnext_full"
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="disagree"):
        build_attention("mha", 48, 4, form="transnext_full", kernel="transnext_aggregated", input_resolution=4)
    with pytest.warns(DeprecationWarning):  # a ViT's options, as a config or timm.create_model gives them
        stack = build_attention_stack("mha", 32, 2, 4, None, {"kernel": "sdpa"})
    assert [m.form_name for m in stack] == ["sdpa", "sdpa"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [m.form_name for m in build_attention_stack("mha", 32, 2, 4, None, {"form": "sdpa"})] == ["sdpa"] * 2


@pytest.mark.parametrize("name", ["transnext_nano", "dit_tiny_2", "plain_vit_nano"])
def test_no_checkpoint_key_carries_the_old_word(name):
    """What a checkpoint holds of a model is its state dict (and its config, whose attention options take the old key
    above): none of its keys names a "kernel" or a "form", so checkpoints of either naming load alike."""
    with torch.device("meta"):
        model = timm.create_model(name, attention="moh")
    keys = list(model.state_dict())
    assert keys and not [k for k in keys if "kernel" in k or "form" in k.split(".")[-1]]
