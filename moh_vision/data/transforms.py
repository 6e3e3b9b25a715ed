"""Image transforms and batch mixing for classification: the TransNeXt / DeiT recipe, built with timm.

Train (``build_train_transform``): RandomResizedCrop (scale 0.08-1, bicubic) -> horizontal flip -> RandAugment
``rand-m9-mstd0.5-inc1`` -> ToTensor -> Normalize -> RandomErasing (p 0.25, per-pixel noise, one box). timm turns colour
jitter off while RandAugment is on, as in the reference runs, so ``color_jitter`` only acts without ``auto_augment``.

Eval (``build_eval_transform``): resize the short side to ``floor(img_size / crop_pct)`` (bicubic), center crop
``img_size`` (224 / 0.875 = 256 -> 224). ``crop_pct=None`` (or 0) squashes the whole image to ``img_size x img_size``
instead, which is what TransNeXt does at 384 and above.

Batch mixing: :func:`build_mixup`. Every knob switches off with 0 / None / "". timm's ``PosterizeIncreasing`` (the
``inc1`` policy) keeps 0 bits at the top magnitude (m >= 10, reached by ``mstd0.5`` draws around m9), which Pillow 13
refuses: the transforms built here give the black image older Pillows gave (:func:`posterize_any_bits`), as in the
reference runs."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageOps
from timm.data import Mixup, create_transform
from timm.data import auto_augment as timm_auto_augment
from timm.data.transforms import MaybeToTensor
from torchvision.transforms import Normalize
from timm.data.mixup import mixup_target
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from ..errors import ConfigError

__all__ = ["IMAGENET_DEFAULT_MEAN", "IMAGENET_DEFAULT_STD", "RECIPE_RE_MODE", "RECIPE_RE_COUNT", "BatchMixup",
           "ToNormalizedTensor", "build_eval_transform", "build_mixup", "build_train_transform", "normalization_for"]

# Random erasing as in DeiT / TransNeXt (--remode pixel --recount 1): one box of per-pixel noise.
RECIPE_RE_MODE = "pixel"
RECIPE_RE_COUNT = 1

_INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming", "random")
_OFF_STRINGS = ("", "none", "off", "null", "0")


def _off(value) -> bool:
    """True for the values that switch a knob off: None, 0, False, "", "none", "off"."""
    if isinstance(value, str):
        return value.strip().lower() in _OFF_STRINGS
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0)


def _check_interpolation(interpolation: str) -> str:
    if interpolation not in _INTERPOLATIONS:
        raise ConfigError(f"interpolation={interpolation!r} is not supported; expected one of {_INTERPOLATIONS}")
    return interpolation


def normalization_for(in_chans: int, mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
                      std: Sequence[float] = IMAGENET_DEFAULT_STD) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Mean/std with one entry per channel; for ``in_chans == 1`` a 3-entry mean/std (the ImageNet default) is averaged
    to one entry, so the defaults keep working for grayscale models."""
    mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if in_chans == 1 and len(mean) == 3 and len(std) == 3:
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    if len(mean) != in_chans or len(std) != in_chans:
        raise ConfigError(f"mean={mean} / std={std} need one value per channel; expected {in_chans} values for "
                          f"in_chans={in_chans}")
    if any(s <= 0 for s in std):
        raise ConfigError(f"std={std} must be positive")
    return mean, std


def posterize_any_bits(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize for any bit count: 8 or more keeps the image, 0 or fewer gives a black image (what Pillow < 13
    returned for 0 bits; Pillow 13 accepts only 1..8)."""
    bits_to_keep = int(bits_to_keep)
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def use_safe_posterize(obj, seen=None) -> int:
    """Swap timm's posterize for :func:`posterize_any_bits` in every augment op under ``obj``; how many were changed."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, timm_auto_augment.AugmentOp):
        if obj.aug_fn is timm_auto_augment.posterize:
            obj.aug_fn = posterize_any_bits
            return 1
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(use_safe_posterize(item, seen) for item in obj)
    return sum(use_safe_posterize(getattr(obj, attr), seen) for attr in ("transforms", "ops", "policy")
               if isinstance(getattr(obj, attr, None), (list, tuple)))


class ToNormalizedTensor:
    """timm's ``MaybeToTensor`` then ``Normalize`` as one transform: an 8-bit PIL image (RGB or L) ->
    ``(pixels / 255 - mean) / std``, float32 ``[C, H, W]``, computed in the pair's order (the same values, bit for bit)
    with two copies of the pixels instead of five. Other inputs take the pair's own path."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.stats = tuple(mean), tuple(std)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img) -> torch.Tensor:
        if not isinstance(img, Image.Image) or img.mode not in ("RGB", "L"):
            tensor = MaybeToTensor()(img)
            return (tensor - self.mean) / self.std
        pixels = torch.from_numpy(np.array(img, np.uint8, copy=True))
        pixels = pixels.unsqueeze(-1) if pixels.ndim == 2 else pixels
        out = torch.empty(pixels.shape[2], pixels.shape[0], pixels.shape[1], dtype=torch.float32)
        out.copy_(pixels.permute(2, 0, 1))
        return out.div_(255).sub_(self.mean).div_(self.std)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.stats[0]}, std={self.stats[1]})"


def _fuse_to_tensor(transform, mean: Sequence[float], std: Sequence[float]):
    """``transform`` (a Compose) with its ``MaybeToTensor``, ``Normalize`` pair replaced by ``ToNormalizedTensor``."""
    steps = transform.transforms
    for i, (first, second) in enumerate(zip(steps, steps[1:])):
        if type(first) is MaybeToTensor and type(second) is Normalize:
            steps[i:i + 2] = [ToNormalizedTensor(mean, std)]
            break
    return transform


def build_train_transform(img_size: int = 224, in_chans: int = 3, auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1",
                          color_jitter: Optional[float] = 0.4, interpolation: str = "bicubic",
                          re_prob: Optional[float] = 0.25, re_mode: str = RECIPE_RE_MODE,
                          re_count: int = RECIPE_RE_COUNT, mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
                          std: Sequence[float] = IMAGENET_DEFAULT_STD):
    """PIL image (already in the model's mode, RGB or L) -> normalised float tensor ``[in_chans, S, S]``.
    ``auto_augment``: a timm augment string (``rand-...``, ``augmix-...``, ``v0``...); ``color_jitter``: strength
    (ignored by timm while RandAugment is on); ``re_prob``: random-erasing probability; each None/0 for none."""
    mean, std = normalization_for(in_chans, mean, std)
    auto_augment = None if _off(auto_augment) else str(auto_augment)
    color_jitter = None if _off(color_jitter) else color_jitter
    re_prob = 0.0 if _off(re_prob) else float(re_prob)
    if not 0.0 <= re_prob <= 1.0:
        raise ConfigError(f"re_prob={re_prob} is a probability; expected a value in [0, 1]")
    try:
        transform = create_transform(input_size=int(img_size), is_training=True, color_jitter=color_jitter,
                                     auto_augment=auto_augment, interpolation=_check_interpolation(interpolation),
                                     mean=mean, std=std, re_prob=re_prob, re_mode=re_mode, re_count=re_count)
    except (AssertionError, KeyError, ValueError) as exc:  # timm asserts on malformed augment strings
        raise ConfigError(f"cannot build the train transform (auto_augment={auto_augment!r}, color_jitter="
                          f"{color_jitter!r}): {type(exc).__name__}: {exc}; expected a timm augment string such as "
                          f"'rand-m9-mstd0.5-inc1'") from exc
    use_safe_posterize(transform)  # 0 bits at the top magnitude: see the module docstring
    return _fuse_to_tensor(transform, mean, std)


def build_eval_transform(img_size: int = 224, in_chans: int = 3, crop_pct: Optional[float] = 0.875,
                         interpolation: str = "bicubic", mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
                         std: Sequence[float] = IMAGENET_DEFAULT_STD):
    """Resize short side to ``floor(img_size / crop_pct)``, center crop ``img_size``, normalise; ``crop_pct=None`` (or
    0) squashes the full image to ``img_size x img_size`` (no crop)."""
    mean, std = normalization_for(in_chans, mean, std)
    interpolation = _check_interpolation(interpolation)
    if interpolation == "random":  # a random eval resize makes no sense; timm's eval path rejects it
        interpolation = "bicubic"
    if _off(crop_pct):
        crop_pct, crop_mode = 1.0, "squash"
    else:
        crop_pct, crop_mode = float(crop_pct), "center"
        if not 0.0 < crop_pct <= 1.0:
            raise ConfigError(f"eval_crop_pct={crop_pct} must be in (0, 1] (0.875: resize 256 -> crop 224), or None")
    transform = create_transform(input_size=int(img_size), is_training=False, interpolation=interpolation,
                                 crop_pct=crop_pct, crop_mode=crop_mode, mean=mean, std=std)
    return _fuse_to_tensor(transform, mean, std)


class BatchMixup(Mixup):
    """timm ``Mixup`` in batch mode, also for odd and empty batches (unreadable images dropped): ``(x [B, C, H, W], y
    [B]) -> (x mixed in place, soft targets [B, num_classes])``, label smoothing included. timm pairs sample ``i`` with
    ``B - 1 - i``; the middle sample of an odd batch is paired with itself (stays unmixed)."""

    def __call__(self, x: torch.Tensor, target: torch.Tensor):
        if len(x) == 0:
            return x, torch.zeros(0, self.num_classes, dtype=torch.float32, device=x.device)
        if len(x) % 2 == 0:
            return super().__call__(x, target)
        lam = self._mix_batch(x)
        return x, mixup_target(target, self.num_classes, lam, self.label_smoothing, self.multi_label)

    def __repr__(self) -> str:
        return (f"BatchMixup(mixup={self.mixup_alpha}, cutmix={self.cutmix_alpha}, prob={self.mix_prob}, "
                f"switch_prob={self.switch_prob}, label_smoothing={self.label_smoothing}, "
                f"num_classes={self.num_classes})")


def build_mixup(num_classes: int, mixup: Optional[float] = 0.8, cutmix: Optional[float] = 1.0, switch_prob: float = 0.5,
                label_smoothing: Optional[float] = 0.1, prob: float = 1.0) -> Optional[BatchMixup]:
    """``BatchMixup`` for the recipe, or None when both ``mixup`` and ``cutmix`` are off (0 / None). ``mixup`` /
    ``cutmix`` are the Beta-distribution alphas; ``switch_prob`` is the chance of cutmix when both are on; ``prob`` the
    chance of mixing a batch at all."""
    mixup = 0.0 if _off(mixup) else float(mixup)
    cutmix = 0.0 if _off(cutmix) else float(cutmix)
    label_smoothing = 0.0 if _off(label_smoothing) else float(label_smoothing)
    if mixup < 0 or cutmix < 0:
        raise ConfigError(f"mixup={mixup} / cutmix={cutmix} are Beta alphas; expected values >= 0 (0 = off)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if mixup == 0.0 and cutmix == 0.0:
        return None
    return BatchMixup(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=float(prob), switch_prob=float(switch_prob),
                      mode="batch", label_smoothing=label_smoothing, num_classes=int(num_classes))
