"""Continue-tuning: start a routed model from a dense (multi-head attention) checkpoint of the same backbone.

What a variant adds over a dense layer (its ``variant_parameters``) and how those start (``dense_start``) is declared by
the variant itself; this module copies the dense tensors, asks each layer for the start of its own parameters, and
refuses what a variant says it cannot do (``dense_start_refusal``). MoH, the built-in example, adds only routers
(``wg``, ``wg_0``, ``wg_1``), started so that every active head has gate 1
(:meth:`~moh_vision.attention.moh.MoH.dense_start`); every other tensor keeps its dense name and shape and is copied one
to one. A layer whose heads are all active computes the dense layer at step 0; one that keeps fewer heads per token
starts as the dense layer with ``num_heads - active`` heads dropped per token (the accuracy continue-tuning has to
recover), its ``wg`` with tiny random weights (``router_std``, default 1e-3).

Refused, with the reason: checkpoints that are not dense (they hold a variant's parameters), backbones of another
width / depth / head layout, and targets whose variant cannot start from dense weights (MoA). The checkpoint is first
made to fit the data the target is built for (:func:`moh_vision.models.fitting.fit_to_model`). ``model.init_from``
and ``tools/convert_dense_to_moh.py`` both call :func:`init_from_dense`."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from moh_vision.attention import find_attention, list_attention, variant_class
from moh_vision.checkpoints import find_weights, load_file, state_dict_diff
from moh_vision.errors import ConfigError
from .fitting import fit_to_model

log = logging.getLogger(__name__)

Tensor = torch.Tensor

DEFAULT_ROUTER_STD = 1e-3
SHOW = 3                                          # examples named per problem


class ContinueTuningError(ConfigError):
    """The dense checkpoint cannot start this model; the message says why and what would."""


# ---- Reading a dense checkpoint --------------------------------------------------------------
@dataclass
class DenseCheckpoint:
    """The tensors of a dense checkpoint and what is known about where they came from."""

    state: Dict[str, Tensor]
    path: str
    where: str                          # e.g. "['model_ema']" or "(top level)"
    model_name: Optional[str] = None    # our trainer's checkpoints record it; official ones do not
    config: Optional[Dict[str, Any]] = None


def read_dense_checkpoint(path: Union[str, Path], weights: str = "auto") -> DenseCheckpoint:
    """Load ``path`` (tensors only, plus the argparse Namespace released training checkpoints carry) and pick its
    weights (:func:`moh_vision.checkpoints.find_weights`: ours, DiT's, timm's, plain state dicts; ``weights``: ``auto``
    EMA when present, ``ema``, ``model``)."""
    path = Path(path)
    if not path.is_file():
        raise ContinueTuningError(f"init_from={path} does not exist")
    try:
        ckpt = load_file(path)
        state, where = find_weights(ckpt, weights, source=str(path))
    except ContinueTuningError:
        raise
    except ConfigError as err:
        raise ContinueTuningError(str(err)) from None
    config = ckpt.get("config") if isinstance(ckpt.get("config"), Mapping) else None
    model_name = ckpt.get("model_name") if isinstance(ckpt.get("model_name"), str) else None
    return DenseCheckpoint(state, str(path), where, model_name, dict(config or {}) or None)


# ---- What the target model is ----------------------------------------------------------------
@dataclass
class LayerStart:
    """One attention layer of the target and how it starts."""

    name: str
    attention: str
    num_heads: int
    active_heads: int
    shared_heads: int
    topk: int

    @property
    def exact(self) -> bool:
        """Computes exactly the dense layer at step 0 (every head active, gates 1)."""
        return self.active_heads == self.num_heads


@dataclass
class ConversionReport:
    """What :func:`init_from_dense` copied, initialised and could not keep exact."""

    source: str
    source_model: Optional[str]
    copied: int
    routers_zero: List[str] = field(default_factory=list)
    routers_random: List[str] = field(default_factory=list)
    layers: List[LayerStart] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(layer.exact for layer in self.layers)

    @property
    def head_fraction(self) -> float:
        """Active heads per token over all heads, summed over the attention layers."""
        heads = sum(layer.num_heads for layer in self.layers)
        return sum(layer.active_heads for layer in self.layers) / heads if heads else 1.0

    def summary(self) -> str:
        inexact = [layer for layer in self.layers if not layer.exact]
        lines = [f"init_from {self.source}" + (f" (trained as {self.source_model})" if self.source_model else ""),
                 f"  copied {self.copied} dense tensors; routers: {len(self.routers_zero)} zero, "
                 f"{len(self.routers_random)} small random",
                 f"  active heads {self.head_fraction:.3f} of all; "
                 + ("every layer starts exactly dense" if not inexact else
                    f"{len(self.layers) - len(inexact)} of {len(self.layers)} layers start exactly dense, "
                    f"{len(inexact)} drop heads at step 0 (the expected drop), e.g. {inexact[0].name}: "
                    f"{inexact[0].active_heads} of {inexact[0].num_heads} heads per token")]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out.update(exact=self.exact, head_fraction=self.head_fraction)
        return out


def attention_layers(model: nn.Module) -> List[LayerStart]:
    """Every registry attention of ``model`` with its head budget (as its variant describes it)."""
    layers = []
    for name, module in find_attention(model):
        info = module.routing_description()
        h, active = int(info["num_heads"]), int(info["active_heads"])
        layers.append(LayerStart(name, module.attention_name, h, active, int(info.get("shared_heads", active)),
                                 int(info.get("topk", 0))))
    return layers


def heads_per_layer(model: nn.Module) -> List[Tuple[int, int]]:
    return [(int(m.num_heads), int(m.head_dim)) for _, m in find_attention(model)]


# ---- Checks (each raises ContinueTuningError with the reason and the way out) ----------------
def _module_of(key: str) -> str:
    parts = key.split(".")
    return parts[-2] if len(parts) > 1 else ""


def check_target(model: nn.Module) -> List[LayerStart]:
    layers = attention_layers(model)
    if not layers:
        raise ContinueTuningError(f"{type(model).__name__} has no registry attention layers to convert")
    for name, module in find_attention(model):
        if module.dense_start_refusal:
            count = sum(1 for _, m in find_attention(model) if type(m) is type(module))
            raise ContinueTuningError(f"{name} ({module.attention_name}, {count} such layers): "
                                      f"{module.dense_start_refusal}")
    return layers


def variant_parameter_names() -> set:
    """Names of what any registered variant adds over a dense attention (routers, experts)."""
    return {p for name in list_attention() for p in variant_class(name).variant_parameters}


def check_dense(ckpt: DenseCheckpoint) -> None:
    not_dense = variant_parameter_names()
    routed = [k for k in ckpt.state if _module_of(k) in not_dense or k.rsplit(".", 1)[-1] in not_dense]
    if routed:
        owners = sorted(name for name in list_attention()
                        if set(variant_class(name).variant_parameters) & {_module_of(routed[0]),
                                                                          routed[0].rsplit(".", 1)[-1]})
        raise ContinueTuningError(
            f"{ckpt.path} is not a dense checkpoint: it holds parameters of attention {'/'.join(owners)} "
            f"({routed[0]} and {len(routed) - 1} more); to continue a routed run use model.checkpoint_path=<it> with "
            f"the same attention (or trainer.resume)")


def _source_heads(ckpt: DenseCheckpoint) -> Optional[List[Tuple[int, int]]]:
    """(heads, head_dim) per layer of the model our trainer recorded, built on the meta device."""
    model_cfg = (ckpt.config or {}).get("model") or {}
    name = model_cfg.get("name") or ckpt.model_name
    if not name:
        return None
    import timm
    try:
        with torch.device("meta"):
            source = timm.create_model(name, attention="mha", **dict(model_cfg.get("kwargs") or {}))
    except Exception as err:  # an old or foreign config: the shape checks below still apply
        log.warning("init_from: could not rebuild the source model %s (%s); head layout not cross-checked", name, err)
        return None
    return heads_per_layer(source)


def check_layout(model: nn.Module, ckpt: DenseCheckpoint, attention_prefixes: Tuple[str, ...] = ()) -> None:
    """Same keys (but the variants' own parameters) and shapes; the same heads per layer where the checkpoint says."""
    expected = model.state_dict()
    missing, unexpected, reshaped = state_dict_diff(expected, ckpt.state, optional=router_keys(model))
    problems = []
    if reshaped:
        k = reshaped[0]
        problems.append(f"{len(reshaped)} tensors of other shapes (e.g. {k}: checkpoint {tuple(ckpt.state[k].shape)}"
                        f" vs model {tuple(expected[k].shape)})")
    if missing:
        problems.append(f"{len(missing)} model tensors missing from the checkpoint (e.g. {', '.join(missing[:SHOW])})")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensors the model does not have (e.g. "
                        f"{', '.join(unexpected[:SHOW])})")
    source = f" (trained as {ckpt.model_name})" if ckpt.model_name else ""
    if problems:
        raise ContinueTuningError(
            f"{ckpt.path}{source} is not the dense version of this backbone: {'; '.join(problems)}. "
            f"Continue-tuning copies every dense tensor, so width, depth and heads per layer must match (classes, "
            f"input channels and position embeddings are adapted to the data)"
            f"{_layout_hint(reshaped, missing, unexpected, attention_prefixes)}")
    src = _source_heads(ckpt)
    tgt = heads_per_layer(model)
    if src is not None and src != tgt:
        i = next((i for i, (a, b) in enumerate(zip(src, tgt)) if a != b), min(len(src), len(tgt)))
        raise ContinueTuningError(
            f"{ckpt.path}{source} has another head layout: layer {i} has {src[i] if i < len(src) else 'none'} "
            f"(heads, head_dim) in the checkpoint and {tgt[i] if i < len(tgt) else 'none'} in the target; the q/k/v "
            f"rows would be cut into different heads")


def _layout_hint(reshaped: Sequence[str], missing: Sequence[str], unexpected: Sequence[str],
                 attention_prefixes: Tuple[str, ...]) -> str:
    """When only attention tensors differ, the width is the same and the heads are not."""
    if not reshaped or missing or unexpected or not attention_prefixes or not all(
            k.startswith(attention_prefixes) for k in reshaped):
        return ""
    return (". Only attention projections differ, so the target has another head layout (the official MoH-DiT-XL/L "
            "presets use 8/16/24 heads per layer, not DiT's 16): keep the dense backbone and give MoH the same "
            "budget on its heads, e.g. tools/convert_dense_to_moh.py model=dit_xl_2 "
            "routing_like=moh_dit_xl_2_90, or in a config attention.shared_heads/topk from "
            "moh_vision.models.continue_tuning.routing_like")


# ---- Routers ---------------------------------------------------------------------------------
def router_keys(model: nn.Module) -> List[str]:
    """State-dict keys of the variants' own parameters (what a dense checkpoint does not have)."""
    keys = []
    for name, module in find_attention(model):
        prefix = f"{name}." if name else ""
        keys += [f"{prefix}{k}" for k in module.state_dict() if k.split(".")[0] in module.variant_parameters]
    return keys


def router_start(model: nn.Module, router_std: float = DEFAULT_ROUTER_STD,
                 seed: int = 0) -> Tuple[Dict[str, Tensor], List[str], List[str]]:
    """Start values of every layer's own parameters, as each variant declares them
    (:meth:`~moh_vision.attention.AttentionVariant.dense_start`). Returns the tensors and which keys
    started at zero and which at random."""
    generator = torch.Generator().manual_seed(seed)
    weights, zero, random = {}, [], []
    for name, module in find_attention(model):
        prefix = f"{name}." if name else ""
        for key, value in module.dense_start(router_std, generator).items():
            weights[prefix + key] = value
            (zero if not value.any() else random).append(prefix + key)
    return weights, zero, random


# ---- The entry point -------------------------------------------------------------------------
def init_from_dense(model: nn.Module, source: Union[str, Path, DenseCheckpoint], weights: str = "auto",
                    router_std: float = DEFAULT_ROUTER_STD, seed: int = 0) -> ConversionReport:
    """Copy a dense checkpoint into ``model`` (MoH or MHA over the same backbone) and start its routers. After this, a
    model whose layers keep every head computes what the dense checkpoint computes (fp32 rounding); layers that keep
    fewer heads start as the dense layer without them. Raises :class:`ContinueTuningError` for every mismatch. Returns
    (and logs) what was done."""
    ckpt = source if isinstance(source, DenseCheckpoint) else read_dense_checkpoint(source, weights)
    if router_std < 0:
        raise ContinueTuningError(f"router_std={router_std} must be >= 0")
    layers = check_target(model)
    check_dense(ckpt)
    # other data: classifier re-initialised, first conv to the model's channels, position embeddings resampled
    ckpt.state, adapted = fit_to_model(model, ckpt.state)
    check_layout(model, ckpt, tuple(f"{name}." for name, _ in find_attention(model)))
    routers, zero, random = router_start(model, router_std, seed)
    model.load_state_dict({**ckpt.state, **routers}, strict=True)  # copy_ casts dtype and device
    report = ConversionReport(source=f"{ckpt.path}{ckpt.where if ckpt.where != '(top level)' else ''}",
                              source_model=ckpt.model_name, copied=len(ckpt.state), routers_zero=zero,
                              routers_random=random, layers=layers, notes=list(adapted))
    if ckpt.config is None:
        report.notes.append("the checkpoint records no model config (official format): the target's heads per layer "
                            "are assumed to be the checkpoint's")
    log.info("%s", report.summary())
    return report


# ---- A MoH preset's budget on a dense backbone's heads ---------------------------------------
def routing_like(preset: str, backbone: str, **backbone_kwargs: Any) -> Dict[str, List[int]]:
    """Per-block ``shared_heads`` / ``topk`` that give ``backbone`` (a dense DiT or plain ViT) the routing of MoH
    ``preset`` on its own heads. The official MoH-DiT-XL/L presets have 8/16/24 heads per block while DiT has 16
    everywhere, so their weights cannot come from a DiT checkpoint. This keeps, block by block, the preset's routed pool
    (``heads - shared``) and top-k, and makes the rest of the backbone's heads shared: every block drops as many heads
    per token as in the preset, so with the same total number of heads (DiT-XL: 28 x 16 = 9 x 8 + 10 x 16 + 9 x 24 =
    448) the activation ratio is the preset's (XL/2-90: 403 / 448)."""
    import timm

    from .families import model_family

    with torch.device("meta"):
        moh = timm.create_model(preset)
        dense = timm.create_model(backbone, attention="mha", **backbone_kwargs)
    if model_family(dense) == "transnext":
        raise ContinueTuningError(f"TransNeXt's MoH presets keep the dense heads per stage: convert {backbone} "
                                  f"straight to the preset (e.g. model=moh_transnext_base_75)")
    moh_layers, dense_layers = attention_layers(moh), attention_layers(dense)
    if not any(layer.topk for layer in moh_layers):
        raise ContinueTuningError(f"{preset} routes no heads (not a MoH preset with shared_heads/topk)")
    if len(moh_layers) != len(dense_layers) or type(moh) is not type(dense):
        raise ContinueTuningError(f"{preset} ({type(moh).__name__}, {len(moh_layers)} attention layers) and "
                                  f"{backbone} ({type(dense).__name__}, {len(dense_layers)}) are not the same family "
                                  f"and depth")
    shared, topk = [], []
    for m, d in zip(moh_layers, dense_layers):
        pool = m.num_heads - m.shared_heads if m.topk else 0
        if pool > d.num_heads:
            raise ContinueTuningError(f"{m.name}: {preset} routes among {pool} heads but {backbone} has "
                                      f"{d.num_heads} there")
        shared.append(d.num_heads - pool)
        topk.append(m.topk)
    return {"shared_heads": shared, "topk": topk}
