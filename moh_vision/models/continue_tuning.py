"""Continue-tuning: start a MoH model from a dense (multi-head attention) checkpoint of the same backbone.

MoH adds routers to a dense layer and nothing else (``wg``: routed-head scores, ``wg_0``: the two-stage
shared/routed mix, ``wg_1``: shared-head weights); every other parameter (q/k/v and output projections,
TransNeXt's temperature, query embedding, position biases and learnable tokens, MLPs, norms,
embeddings, heads, DiT's adaLN) has the same name and shape as in the dense model. So the dense weights
are copied one to one and only the routers need a start:

* ``wg_0`` and ``wg_1`` start at zero: ``2 * softmax(0) = (1, 1)`` and ``softmax(0) * h_s = 1``, so every
  shared head gets gate 1 and the mix scales nothing;
* ``wg`` starts at zero where a layer's top-k takes its whole routed pool: the renormalised uniform
  top-k gives ``(1/R) / (k/R) * k = 1`` to every routed head.

A layer whose heads are all active (``shared_heads + topk == num_heads``, e.g. activation ratio 1.0)
therefore computes exactly the dense layer at step 0, and a model whose layers all are reproduces the
dense outputs to fp32 rounding. A layer that keeps fewer heads per token (the point of MoH) cannot be
dense; it starts as the dense layer with ``num_heads - active`` heads dropped per token, which is the
accuracy drop that continue-tuning has to recover. In such layers ``wg`` starts with tiny random
weights (``router_std``, default 1e-3): the gates of the kept heads stay within about ``router_std *
sqrt(dim)`` of 1, and each token picks its heads from its own scores rather than every token taking the
same heads by tie-breaking of an all-zero router (whose unchosen heads would also receive identical
updates and stay tied).

What is refused, with the reason: checkpoints that are not dense (they already hold routers, or MoA's
experts), backbones of another width / depth / head layout (the heads would be cut differently), and MoA
targets (one shared key/value head and a bias-free output projection: no dense layer maps onto them).

``model.init_from=<checkpoint>`` (``build_model(..., init_from=...)``) and
``tools/convert_dense_to_moh.py`` both call :func:`init_from_dense`.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from moh_vision.attention import find_attention
from moh_vision.errors import ConfigError

log = logging.getLogger(__name__)

Tensor = torch.Tensor

ROUTERS = ("wg", "wg_0", "wg_1")                 # MoH (the official names)
NOT_DENSE_MODULES = ROUTERS + ("w_gate", "w_noise", "q_proj", "kv_proj")  # MoH routers, MoA experts
EMA_KEYS = ("model_ema", "ema", "state_dict_ema")  # ours, DiT's training script, timm
MODEL_KEYS = ("model", "state_dict", "module")
STRIP_PREFIXES = ("module.", "_orig_mod.")        # DistributedDataParallel, torch.compile
DEFAULT_ROUTER_STD = 1e-3
SHOW = 3                                          # examples named per problem


class ContinueTuningError(ConfigError):
    """The dense checkpoint cannot start this model; the message says why and what would."""


# ----------------------------------------------------------------------------------------------
# Reading a dense checkpoint
# ----------------------------------------------------------------------------------------------
@dataclass
class DenseCheckpoint:
    """The tensors of a dense checkpoint and what is known about where they came from."""

    state: Dict[str, Tensor]
    path: str
    where: str                          # e.g. "['model_ema']" or "(top level)"
    model_name: Optional[str] = None    # our trainer's checkpoints record it; official ones do not
    config: Optional[Dict[str, Any]] = None


def _strip(state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    out = {}
    for key, value in state.items():
        while key.startswith(STRIP_PREFIXES):
            key = next(key[len(p):] for p in STRIP_PREFIXES if key.startswith(p))
        out[key] = value
    return out


def read_dense_checkpoint(path: Union[str, Path], weights: str = "auto") -> DenseCheckpoint:
    """Load ``path`` (tensors only) and pick its weights.

    Understood: a plain state dict (the released TransNeXt / DiT files), our trainer's checkpoints
    (``model`` and, with EMA, ``model_ema``), ``{"model"}`` / ``{"state_dict"}`` wrappers, timm's
    ``state_dict_ema`` and DiT's ``ema``. ``weights``: ``auto`` takes the EMA weights when the file has
    them (what DiT releases and what timm's loader prefers), else the model weights; ``ema`` requires
    them; ``model`` takes the raw weights.
    """
    if weights not in ("auto", "ema", "model"):
        raise ContinueTuningError(f"weights='{weights}' is unknown; use auto, ema or model")
    path = Path(path)
    if not path.is_file():
        raise ContinueTuningError(f"init_from={path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ContinueTuningError(
            f"{path} holds pickled Python objects besides tensors (DiT's training checkpoints keep an argparse "
            f"Namespace); extract the weights first: python tools/convert_checkpoint.py {path} dense.pt "
            f"--trust-pickle, then use dense.pt") from None
    if not isinstance(ckpt, Mapping):
        raise ContinueTuningError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint dict")
    config = ckpt.get("config") if isinstance(ckpt.get("config"), Mapping) else None
    model_name = ckpt.get("model_name") if isinstance(ckpt.get("model_name"), str) else None
    order = {"auto": EMA_KEYS + MODEL_KEYS, "ema": EMA_KEYS, "model": MODEL_KEYS}[weights]
    obj, where = ckpt, ""
    while True:
        key = next((k for k in order if isinstance(obj.get(k), Mapping)), None)
        if key is None:
            break
        obj, where = obj[key], f"{where}[{key!r}]"
    if weights == "ema" and not where:
        raise ContinueTuningError(f"weights='ema' but {path} has no EMA weights (keys: {sorted(ckpt)[:8]})")
    tensors = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
    if not tensors or len(tensors) != len(obj):
        other = [k for k in obj if not isinstance(obj[k], Tensor)][:SHOW]
        raise ContinueTuningError(f"{path}{where} is not a state dict of tensors (e.g. entries {other}); "
                                  f"its keys: {sorted(obj)[:8]}")
    return DenseCheckpoint(_strip(tensors), str(path), where or "(top level)", model_name, dict(config or {}) or None)


# ----------------------------------------------------------------------------------------------
# What the target model is
# ----------------------------------------------------------------------------------------------
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
    """Every registry attention of ``model`` with its head budget."""
    layers = []
    for name, module in find_attention(model):
        h = int(module.num_heads)
        kind = module.attention_name
        if kind == "moh":
            shared, topk = int(module.shared_heads), int(module.topk)
            layers.append(LayerStart(name, kind, h, shared + topk, shared, topk))
        else:
            layers.append(LayerStart(name, kind, h, int(getattr(module, "topk", h)) if kind == "moa" else h, h, 0))
    return layers


def heads_per_layer(model: nn.Module) -> List[Tuple[int, int]]:
    return [(int(m.num_heads), int(m.head_dim)) for _, m in find_attention(model)]


# ----------------------------------------------------------------------------------------------
# Checks (each raises ContinueTuningError with the reason and the way out)
# ----------------------------------------------------------------------------------------------
def _module_of(key: str) -> str:
    parts = key.split(".")
    return parts[-2] if len(parts) > 1 else ""


def check_target(model: nn.Module) -> List[LayerStart]:
    layers = attention_layers(model)
    if not layers:
        raise ContinueTuningError(f"{type(model).__name__} has no registry attention layers to convert")
    moa = [layer.name for layer in layers if layer.attention == "moa"]
    if moa:
        raise ContinueTuningError(
            f"MoA cannot be continue-tuned from a dense checkpoint ({moa[0]} and {len(moa) - 1} more layers): its "
            f"experts share ONE key/value head (kv_proj: C -> 2 x head_dim) where the dense layer has one per head, "
            f"and its output projection has no bias; the embeddings, MLPs, norms and per-expert query/output "
            f"weights would fit, but no choice of the shared key/value head reproduces the dense layer, so the "
            f"model would not start from the dense function. Train MoA from scratch, or continue-tune to "
            f"attention=moh")
    unknown = sorted({layer.attention for layer in layers} - {"mha", "moh"})
    if unknown:
        raise ContinueTuningError(f"continue-tuning knows how to start attention mha and moh, not {unknown}")
    return layers


def check_dense(ckpt: DenseCheckpoint) -> None:
    routed = [k for k in ckpt.state if _module_of(k) in NOT_DENSE_MODULES]
    if routed:
        kind = "MoA experts" if any(_module_of(k) in ("w_gate", "q_proj", "kv_proj") for k in routed) else "MoH routers"
        raise ContinueTuningError(
            f"{ckpt.path} is not a dense checkpoint: it holds {kind} ({routed[0]} and {len(routed) - 1} more); "
            f"to continue a routed run use model.checkpoint_path=<it> with the same attention (or trainer.resume)")


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


def check_layout(model: nn.Module, ckpt: DenseCheckpoint) -> None:
    """Same keys (but the routers) and shapes; the same heads per layer where the checkpoint says."""
    expected = model.state_dict()
    routers = set(router_keys(model))
    missing = [k for k in expected if k not in ckpt.state and k not in routers]
    unexpected = [k for k in ckpt.state if k not in expected]
    reshaped = [k for k in ckpt.state if k in expected and tuple(expected[k].shape) != tuple(ckpt.state[k].shape)]
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
            f"Continue-tuning copies every dense tensor unchanged, so width, depth, heads per layer, image/latent "
            f"size and classes must match{_layout_hint(reshaped, missing, unexpected)}")
    src = _source_heads(ckpt)
    tgt = heads_per_layer(model)
    if src is not None and src != tgt:
        i = next((i for i, (a, b) in enumerate(zip(src, tgt)) if a != b), min(len(src), len(tgt)))
        raise ContinueTuningError(
            f"{ckpt.path}{source} has another head layout: layer {i} has {src[i] if i < len(src) else 'none'} "
            f"(heads, head_dim) in the checkpoint and {tgt[i] if i < len(tgt) else 'none'} in the target; the q/k/v "
            f"rows would be cut into different heads")


def _layout_hint(reshaped: Sequence[str], missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """When only attention projections differ, the width is the same and the heads are not."""
    if not reshaped or missing or unexpected or any(_module_of(k) not in ("qkv", "q", "kv", "proj") for k in reshaped):
        return ""
    return (". Only attention projections differ, so the target has another head layout (the official MoH-DiT-XL/L "
            "presets use 8/16/24 heads per layer, not DiT's 16): keep the dense backbone and give MoH the same "
            "budget on its heads, e.g. tools/convert_dense_to_moh.py --model dit_xl_2 --routing-like "
            "moh_dit_xl_2_90, or in a config attention.shared_heads/topk from "
            "moh_vision.models.continue_tuning.routing_like")


# ----------------------------------------------------------------------------------------------
# Routers
# ----------------------------------------------------------------------------------------------
def router_keys(model: nn.Module) -> List[str]:
    keys = []
    for name, module in find_attention(model):
        if module.attention_name != "moh":
            continue
        for router in ROUTERS:
            if isinstance(getattr(module, router, None), nn.Linear):
                keys.append(f"{name}.{router}.weight" if name else f"{router}.weight")
    return keys


def router_start(model: nn.Module, router_std: float = DEFAULT_ROUTER_STD,
                 seed: int = 0) -> Tuple[Dict[str, Tensor], List[str], List[str]]:
    """Router weights that make every active head's gate 1: zero, except ``wg`` in layers whose top-k
    leaves heads out (``N(0, router_std^2)``: per-token choices, gates 1 + O(router_std * sqrt(dim)))."""
    generator = torch.Generator().manual_seed(seed)
    weights, zero, random = {}, [], []
    for name, module in find_attention(model):
        if module.attention_name != "moh":
            continue
        prefix = f"{name}." if name else ""
        for router in ROUTERS:
            linear = getattr(module, router, None)
            if not isinstance(linear, nn.Linear):
                continue
            key = f"{prefix}{router}.weight"
            w = torch.zeros(linear.weight.shape)
            drops_heads = router == "wg" and module.topk < module.num_heads - module.shared_heads
            if drops_heads and router_std > 0:
                w.normal_(0.0, router_std, generator=generator)
                random.append(key)
            else:
                zero.append(key)
            weights[key] = w.to(linear.weight.dtype)
    return weights, zero, random


# ----------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------
def init_from_dense(model: nn.Module, source: Union[str, Path, DenseCheckpoint], weights: str = "auto",
                    router_std: float = DEFAULT_ROUTER_STD, seed: int = 0) -> ConversionReport:
    """Copy a dense checkpoint into ``model`` (MoH or MHA over the same backbone) and start its routers.

    After this, a model whose layers keep every head computes what the dense checkpoint computes (fp32
    rounding); layers that keep fewer heads start as the dense layer without them. Raises
    :class:`ContinueTuningError` for every mismatch. Returns (and logs) what was done.
    """
    ckpt = source if isinstance(source, DenseCheckpoint) else read_dense_checkpoint(source, weights)
    if router_std < 0:
        raise ContinueTuningError(f"router_std={router_std} must be >= 0")
    layers = check_target(model)
    check_dense(ckpt)
    check_layout(model, ckpt)
    routers, zero, random = router_start(model, router_std, seed)
    model.load_state_dict({**ckpt.state, **routers}, strict=True)  # copy_ casts dtype and device
    report = ConversionReport(source=f"{ckpt.path}{ckpt.where if ckpt.where != '(top level)' else ''}",
                              source_model=ckpt.model_name, copied=len(ckpt.state), routers_zero=zero,
                              routers_random=random, layers=layers)
    if ckpt.config is None:
        report.notes.append("the checkpoint records no model config (official format): the target's heads per layer "
                            "are assumed to be the checkpoint's")
    log.info("%s", report.summary())
    return report


# ----------------------------------------------------------------------------------------------
# A MoH preset's budget on a dense backbone's heads
# ----------------------------------------------------------------------------------------------
def routing_like(preset: str, backbone: str, **backbone_kwargs: Any) -> Dict[str, List[int]]:
    """Per-block ``shared_heads`` / ``topk`` that give ``backbone`` (a dense DiT or plain ViT) the routing of
    MoH ``preset`` on its own heads.

    The official MoH-DiT-XL/L presets have 8/16/24 heads per block while DiT has 16 everywhere, so their
    weights cannot come from a DiT checkpoint. This keeps, block by block, the preset's routed pool
    (``heads - shared``) and top-k, and makes the rest of the backbone's heads shared: every block drops
    as many heads per token as in the preset, so with the same total number of heads (DiT-XL: 28 x 16 =
    9 x 8 + 10 x 16 + 9 x 24 = 448) the activation ratio is the preset's (XL/2-90: 403 / 448).
    """
    import timm

    from .transnext import TransNeXt

    with torch.device("meta"):
        moh = timm.create_model(preset)
        dense = timm.create_model(backbone, attention="mha", **backbone_kwargs)
    if isinstance(dense, TransNeXt):
        raise ContinueTuningError(f"TransNeXt's MoH presets keep the dense heads per stage: convert {backbone} "
                                  f"straight to the preset (e.g. model=moh_transnext_base_75)")
    moh_layers, dense_layers = attention_layers(moh), attention_layers(dense)
    if any(layer.attention != "moh" for layer in moh_layers):
        raise ContinueTuningError(f"{preset} is not a MoH preset")
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
