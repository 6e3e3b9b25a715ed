"""Class-folder image data: recipe transforms, mixup, unreadable images, image modes, layout errors.

Every test builds a tiny tree in tmp_path (3 classes, 40x48 px images) and runs at img_size 32.
"""
import io
import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T

from moh_vision.data.imagefolder import (
    BadImage,
    BadImageError,
    ImageFolderData,
    ImageNetData,
    SkipBadImagesCollate,
    load_image,
)
from moh_vision.data.transforms import build_eval_transform, build_train_transform
from moh_vision.errors import ConfigError

CLASSES = ("cat", "dog", "eel")
N_TRAIN, N_VAL = 4, 2
SMALL = dict(img_size=32, auto_augment=None, mixup=0, cutmix=0, re_prob=0)  # fast: recipe extras off


def _image(seed, mode="RGB", size=(40, 48)):
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def _jpeg_bytes(seed=0):
    buf = io.BytesIO()
    _image(seed).save(buf, "JPEG")
    return buf.getvalue()


def make_tree(root, classes=CLASSES, n_train=N_TRAIN, n_val=N_VAL):
    """root/{train,val}/<class>/<i>.{png,jpg}: alternating PNG and JPEG files."""
    for split, n in (("train", n_train), ("val", n_val)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                ext = "png" if i % 2 else "jpg"
                _image(100 * c + i).save(folder / f"{i}.{ext}")
    return root


def add_bad_files(root):
    """One truncated JPEG, one zero-byte file and one text file named .jpg, all in train/."""
    data = _jpeg_bytes()
    bad = {
        root / "train" / "cat" / "truncated.jpg": data[: len(data) // 2],
        root / "train" / "dog" / "empty.jpg": b"",
        root / "train" / "eel" / "notes.jpg": b"this is not an image\n",
    }
    for path, content in bad.items():
        path.write_bytes(content)
    return {str(p) for p in bad}


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "data")


@pytest.fixture
def bad_tree(tmp_path):
    root = make_tree(tmp_path / "data")
    return root, add_bad_files(root)


# --------------------------------------------------------------------------------------------------
# Shapes, classes, recipe
# --------------------------------------------------------------------------------------------------


def test_shapes_and_class_mapping_with_full_recipe(tree):
    data = ImageFolderData(tree, img_size=32)  # the TransNeXt defaults, RandAugment and erasing on
    assert (data.num_classes, data.in_chans, data.img_size) == (3, 3, 32)
    assert data.classes == list(CLASSES) and data.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert len(data.train) == 3 * N_TRAIN and len(data.val) == 3 * N_VAL
    for path, label in data.train.samples + data.val.samples:
        assert os.path.basename(os.path.dirname(path)) == CLASSES[label]
    for ds in (data.train, data.val):
        for i in range(len(ds)):
            image, label = ds[i]
            assert image.shape == (3, 32, 32) and image.dtype == torch.float32
            assert label == ds.targets[i]
    assert data.repeated_aug == 1 and data.label_smoothing == 0.1  # repeated_aug auto: 1 in one process
    assert data.collate_fn is not None and data.mixup is not None
    line = data.describe()
    assert "\n" not in line and "3 classes" in line and "rand-m9-mstd0.5-inc1" in line


def test_train_and_eval_transforms_follow_the_recipe():
    train = build_train_transform(224).transforms
    names = [type(t).__name__ for t in train]
    assert names[:3] == ["RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "RandAugment"]
    assert "ColorJitter" not in names  # timm (like DeiT / TransNeXt) drops jitter while RandAugment is on
    assert str(train[0].interpolation).lower().endswith("bicubic")
    erase = train[-1]
    assert type(erase).__name__ == "RandomErasing" and erase.probability == 0.25 and erase.mode == "pixel"

    resize, crop = build_eval_transform(224).transforms[:2]
    assert resize.size in (256, [256]) and tuple(crop.size) == (224, 224)
    assert resize.interpolation == T.InterpolationMode.BICUBIC
    squash = build_eval_transform(224, crop_pct=None).transforms[0]
    assert tuple(squash.size) == (224, 224)

    off = [type(t).__name__ for t in build_train_transform(32, auto_augment=None, re_prob=0).transforms]
    assert "RandAugment" not in off and "RandomErasing" not in off and "ColorJitter" in off
    bare = [type(t).__name__ for t in build_train_transform(32, auto_augment="", color_jitter=0).transforms]
    assert "ColorJitter" not in bare


def test_posterize_at_top_magnitude_gives_a_black_image_with_any_pillow():
    from timm.data.auto_augment import AugmentOp

    from moh_vision.data.transforms import posterize_any_bits
    img = _image(0, size=(9, 7))
    # PosterizeIncreasing at m >= 10 asks for 0 bits (Pillow >= 13 raises on that; older Pillow gave black)
    op = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    op.aug_fn = posterize_any_bits
    for mode in ("RGB", "L"):
        out = op(img.convert(mode))
        assert out.mode == mode and out.size == (9, 7) and np.asarray(out).max() == 0
    assert np.array_equal(np.asarray(posterize_any_bits(img, 4)), np.asarray(img) & 0xF0)
    assert posterize_any_bits(img, 8) is img


@pytest.mark.parametrize("in_chans,mode", [(3, "RGB"), (1, "L")])
def test_tensor_conversion_gives_timms_values_bit_for_bit(in_chans, mode):
    """The recipe's transforms convert and normalise in one step (ToNormalizedTensor) with exactly the values
    of timm's MaybeToTensor + Normalize, for the same random draws."""
    import random

    from timm.data import create_transform

    from moh_vision.data.transforms import normalization_for, use_safe_posterize
    mean, std = normalization_for(in_chans)
    timms = {"train": create_transform(input_size=32, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                       interpolation="bicubic", mean=mean, std=std, re_prob=0.25, re_mode="pixel"),
             "eval": create_transform(input_size=32, interpolation="bicubic", crop_pct=0.875, mean=mean, std=std)}
    use_safe_posterize(timms["train"])
    ours = {"train": build_train_transform(32, in_chans=in_chans), "eval": build_eval_transform(32, in_chans=in_chans)}
    assert "ToNormalizedTensor" in [type(t).__name__ for t in ours["train"].transforms]
    rng = np.random.default_rng(0)
    for i in range(40):
        img = Image.fromarray(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)).convert(mode)
        for split in ("train", "eval"):
            outs = []
            for transform in (ours[split], timms[split]):
                random.seed(i), np.random.seed(i), torch.manual_seed(i)
                outs.append(transform(img))
            assert outs[0].dtype == torch.float32 and torch.equal(*outs), (split, i)


@pytest.mark.parametrize("in_chans,mode", [(3, "RGB"), (1, "L")])
def test_recipe_train_transform_survives_thousands_of_images(in_chans, mode):
    """rand-m9-mstd0.5-inc1 reaches posterize-to-0-bits about once in 700 images: push 3000 through."""
    import random
    random.seed(0)  # RandAugment draws ops and magnitudes from Python's RNG
    torch.manual_seed(0)
    transform = build_train_transform(16, in_chans=in_chans)
    rng = np.random.default_rng(0)
    for i in range(3000):
        w, h = (int(v) for v in rng.integers(6, 24, 2))
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
        out = transform(img)
        assert out.shape == (in_chans, 16, 16), i


def test_mixup_gives_soft_targets_that_sum_to_one(tree):
    data = ImageFolderData(tree, img_size=32, auto_augment=None, re_prob=0)
    x, y, skipped = data.collate_fn([data.train[i] for i in range(4)])
    assert skipped == 0 and x.shape == (4, 3, 32, 32)
    for n in (4, 3, 0):  # odd batches appear when unreadable images are dropped; empty ones too
        mixed, soft = data.mixup(x[:n].clone(), y[:n])
        assert mixed.shape == (n, 3, 32, 32) and soft.shape == (n, 3)
        assert torch.allclose(soft.sum(dim=1), torch.ones(n))
    _, soft = data.mixup(x.clone(), y)
    assert soft.min() >= 0.1 / 3 - 1e-6  # label smoothing 0.1 is built into the targets
    plain = ImageFolderData(tree, **SMALL)
    assert plain.mixup is None and plain.label_smoothing == 0.1 and plain.repeated_aug == 1
    assert ImageFolderData(tree, **SMALL, repeated_aug=0, label_smoothing=None).repeated_aug == 1


def test_repeated_aug_auto_follows_the_world_size(tree, monkeypatch):
    """DeiT repeats each image x3 over processes; in one process the copies would share a batch."""
    from moh_vision.data.imagefolder import resolve_repeated_aug
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ImageFolderData(tree, **SMALL).repeated_aug == 1
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets (the process group may not exist yet)
    assert ImageFolderData(tree, **SMALL).repeated_aug == 3
    assert ImageFolderData(tree, **SMALL, repeated_aug=2).repeated_aug == 2  # an explicit count is kept
    assert [resolve_repeated_aug("auto", world_size=w) for w in (1, 2, 8)] == [1, 3, 3]
    assert resolve_repeated_aug(None) == resolve_repeated_aug(0) == 1 and resolve_repeated_aug("3") == 3
    for bad in ("three", -1):
        with pytest.raises(ConfigError, match="auto or an integer"):
            resolve_repeated_aug(bad)
    from moh_vision.config import ImageFolderData as Schema
    assert Schema().repeated_aug == "auto"


# --------------------------------------------------------------------------------------------------
# Unreadable images
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_counts_exactly_the_bad_files(bad_tree, num_workers, caplog):
    root, bad = bad_tree
    data = ImageFolderData(root, **SMALL)
    assert len(data.train) == 3 * N_TRAIN + len(bad)
    loader = DataLoader(data.train, batch_size=4, shuffle=True, num_workers=num_workers, collate_fn=data.collate_fn)
    caplog.set_level(logging.WARNING, logger="moh_vision.data.imagefolder")
    for _ in range(2):  # two epochs: the count is per pass, the warning once per file (per process)
        seen = skipped = 0
        for images, labels, n_bad in loader:
            assert isinstance(n_bad, int) and images.shape == (len(labels), 3, 32, 32)
            assert labels.dtype == torch.int64
            seen += len(labels)
            skipped += n_bad
        assert (seen, skipped) == (3 * N_TRAIN, len(bad))
    if num_workers == 0:  # worker processes log through their own handlers, not caplog
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == len(bad)
        assert {p for p in bad if any(p in m for m in warned)} == bad


def test_raise_names_the_bad_file(bad_tree):
    root, bad = bad_tree
    data = ImageFolderData(root, **SMALL, on_bad_image="raise")
    index = next(i for i, (p, _) in enumerate(data.train.samples) if p.endswith("empty.jpg"))
    with pytest.raises(BadImageError, match="empty.jpg"):
        data.train[index]
    loader = DataLoader(data.train, batch_size=len(data.train), collate_fn=data.collate_fn)
    with pytest.raises(BadImageError) as err:
        next(iter(loader))
    assert any(os.path.basename(p) in str(err.value) for p in bad)


def test_all_bad_batch_is_empty_but_well_formed():
    images, labels, skipped = SkipBadImagesCollate((3, 32, 32))([BadImage("a.jpg", "x"), BadImage("b.jpg", "y")])
    assert images.shape == (0, 3, 32, 32) and labels.shape == (0,) and skipped == 2


# --------------------------------------------------------------------------------------------------
# Image modes
# --------------------------------------------------------------------------------------------------


def test_other_modes_convert_to_rgb_or_l(tmp_path):
    base = _image(7)
    rgba = base.convert("RGBA")
    rgba.putalpha(128)
    palette = base.convert("P")
    palette.info["transparency"] = 0
    files = {
        "gray.png": base.convert("L"),
        "gray_alpha.png": base.convert("LA"),
        "cmyk.jpg": base.convert("CMYK"),
        "rgba.png": rgba,
        "palette.png": palette,
        "deep.png": Image.fromarray(np.full((48, 40), 40000, dtype=np.uint16)),
    }
    for name, img in files.items():
        img.save(tmp_path / name)
        for mode in ("RGB", "L"):
            out = load_image(str(tmp_path / name), mode)
            assert out.mode == mode and out.size == (40, 48), name
    assert load_image(str(tmp_path / "deep.png"), "L").getpixel((0, 0)) == round(40000 / 257)  # not clipped

    root = make_tree(tmp_path / "data")
    base.convert("CMYK").save(root / "train" / "cat" / "cmyk.jpg")
    rgba.save(root / "train" / "dog" / "rgba.png")
    gray = ImageFolderData(root, in_chans=1, **SMALL)
    assert all(gray.train[i][0].shape == (1, 32, 32) for i in range(len(gray.train)))
    rgb = ImageFolderData(root, **SMALL)
    assert all(rgb.train[i][0].shape == (3, 32, 32) for i in range(len(rgb.train)))


# --------------------------------------------------------------------------------------------------
# Layout errors, raised at construction
# --------------------------------------------------------------------------------------------------


def _remove_tree(path):
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for f in filenames:
            os.remove(os.path.join(dirpath, f))
        os.rmdir(dirpath)


def _empty_every_class(root):
    for split in ("train", "val"):
        for name in CLASSES:
            for f in (root / split / name).iterdir():
                f.unlink()
    return root / "train"


def _empty_one_class(root):
    for f in (root / "train" / "dog").iterdir():
        f.unlink()
    return root / "train" / "dog"


def _differing_classes(root):
    os.rename(root / "val" / "eel", root / "val" / "fox")
    return root / "val"


def _loose_images(root):
    for name in CLASSES:
        for f in (root / "train" / name).iterdir():
            os.rename(f, root / "train" / f"{name}_{f.name}")
        os.rmdir(root / "train" / name)
    return root / "train"


def _no_train(root):
    _remove_tree(root / "train")
    return root / "train"


def _no_val(root):
    _remove_tree(root / "val")
    return root / "val"


def _no_root(root):
    _remove_tree(root)
    return root


@pytest.mark.parametrize(
    "break_tree, expected",
    [
        (_no_root, "does not exist"),
        (_no_train, "does not exist"),
        (_no_val, "does not exist"),
        (_empty_every_class, "holds no images"),
        (_empty_one_class, "has no images"),
        (_differing_classes, "only in val: fox"),
        (_loose_images, "has no class folders"),
    ],
)
def test_layout_errors_are_one_line_config_errors(tree, break_tree, expected):
    named_path = break_tree(tree)
    with pytest.raises(ConfigError) as err:
        ImageFolderData(tree, **SMALL)
    message = str(err.value)
    assert "\n" not in message and expected in message and str(named_path) in message
    assert "expected" in message


def test_bad_settings_are_config_errors(tree):
    for bad in (dict(on_bad_image="ignore"), dict(in_chans=2), dict(auto_augment="nonsense"),
                dict(eval_crop_pct=1.5), dict(mean=(0.5, 0.5))):
        with pytest.raises(ConfigError):
            ImageFolderData(tree, **{**SMALL, **bad})


# --------------------------------------------------------------------------------------------------
# ImageNet
# --------------------------------------------------------------------------------------------------


def test_imagenet_requires_1000_classes(tree, tmp_path):
    with pytest.raises(ConfigError, match="has 3 class folders; ImageNet-1K expects 1000"):
        ImageNetData(tree, **SMALL)
    # 1000 wnid folders; files are not decoded at construction, so empty .JPEG files suffice here.
    root = tmp_path / "imagenet"
    wnids = [f"n{i:08d}" for i in range(1000)]
    for split in ("train", "val"):
        for wnid in wnids:
            (root / split / wnid).mkdir(parents=True)
            (root / split / wnid / f"{wnid}_1.JPEG").touch()
    data = ImageNetData(root, img_size=32)
    assert data.num_classes == 1000 and data.classes == wnids and len(data.val) == 1000


def test_imagenet_ilsvrc_layout_reads_flat_val_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(ImageNetData, "expected_classes", 3)
    root = tmp_path / "kaggle"
    cls_loc = root / "ILSVRC" / "Data" / "CLS-LOC"
    wnids = ["n01440764", "n01443537", "n01484850"]
    make_tree(cls_loc, classes=wnids, n_val=0)
    rows = ["ImageId,PredictionString"]
    truth = {}
    for k in range(6):
        image_id = f"ILSVRC2012_val_{k + 1:08d}"
        wnid = wnids[k % 3]
        _image(k).save(cls_loc / "val" / f"{image_id}.JPEG", "JPEG")
        rows.append(f"{image_id},{wnid} 1 2 30 40 {wnid} 5 6 20 30")
        truth[image_id] = wnids.index(wnid)
    (cls_loc / "val" / "n01440764").rmdir()  # make_tree left empty val class folders: the val is flat
    (cls_loc / "val" / "n01443537").rmdir()
    (cls_loc / "val" / "n01484850").rmdir()
    with pytest.raises(ConfigError, match="LOC_val_solution.csv"):
        ImageNetData(root, **SMALL)
    (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    data = ImageNetData(root, **SMALL)
    assert data.classes == wnids and len(data.train) == 3 * N_TRAIN and len(data.val) == 6
    for path, label in data.val.samples:
        assert truth[os.path.splitext(os.path.basename(path))[0]] == label
    image, _ = data.val[0]
    assert image.shape == (3, 32, 32)
