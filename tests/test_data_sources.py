"""Every data source (class folders, tars, a tar of tars, folders of per-class tars, webdataset shards read map-style
and streamed, Hugging Face parquet files) gives the images and labels of the class-folder tree it was made from; class
order and class maps; one-line errors; training runs from the tar and streamed sources."""
import hashlib

import numpy as np
import pytest

import fixtures_sources as fx
from helpers import FAST_TRAIN, read_summary
from moh_vision.data.imagefolder import ImageFolderData, ImageNetData
from moh_vision.errors import ConfigError

SMALL = dict(img_size=32, auto_augment=None, mixup=0, cutmix=0, re_prob=0, index_cache=None, repeated_aug=1,
             class_order="natural")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return fx.make_tree(tmp_path_factory.mktemp("sources") / "tree")


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    try:
        import datasets
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def items(dataset):
    """The sorted (pixels digest, label) pairs of a map-style dataset, images undecorated by transforms."""
    dataset.transform = None
    return sorted((hashlib.md5(np.asarray(img).tobytes()).hexdigest(), label)
                  for img, label in (dataset[i] for i in range(len(dataset))))


def streamed(stream):
    stream.transform = None
    stream.configure(batch_size=1, seed=0, rank=0, world_size=1)
    return sorted((hashlib.md5(np.asarray(img).tobytes()).hexdigest(), label) for batch in stream
                  for img, label in batch)


LAYOUTS = {
    "tar of class folders": (fx.tars_of_folders, "auto", "tar"),
    "ILSVRC tar of tars + flat val tar": (lambda t, o: fx.ilsvrc_tars(t, o)[0], "auto", "tar"),
    "folders of per-class tars": (fx.folders_of_class_tars, "auto", "tar"),
    "webdataset shards, map-style": (fx.wds_shards, "tar", "tar"),
    "Hugging Face parquet": (fx.hf_parquet, "auto", "hfds"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_source_gives_the_images_and_labels_of_its_folder(tree, tmp_path, layout):
    make, source, found = LAYOUTS[layout]
    if found == "hfds":
        pytest.importorskip("datasets")
    reference = ImageFolderData(str(tree), **SMALL)
    assert reference.classes == fx.NATURAL
    data = ImageFolderData(str(make(tree, tmp_path / "copy")), source=source, **SMALL)
    assert data.source == found and data.num_classes == 3
    assert items(data.train) == items(reference.train)
    assert items(data.val) == items(reference.val)
    image, label = ImageFolderData(str(tmp_path / "copy"), source=source, **{**SMALL, "index_cache": None}).val[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 3, "the eval transform applies to every source"


def test_webdataset_stream_gives_every_image_once_and_every_rank_the_same_steps(tree, tmp_path):
    reference = ImageFolderData(str(tree), **SMALL)
    data = ImageFolderData(str(fx.wds_shards(tree, tmp_path / "wds", shards=(3, 1))), source="wds", **SMALL)
    assert data.streaming and len(data.train) == 9
    assert streamed(data.train) == items(reference.train)
    assert items(data.val) == items(reference.val)
    steps = []
    for rank in range(2):
        data.train.configure(batch_size=2, seed=0, rank=rank, world_size=2)
        data.train.set_epoch(1)
        steps.append(len(list(data.train)))
    assert steps == [2, 2], "9 images, 2 ranks, batches of 2: 2 steps each, though the ranks' shards differ"
    data.train.set_epoch(1, start=2)  # resumed after the first batch: the rest of the epoch
    assert len(list(data.train)) == 1


def test_class_order_natural_or_sorted_and_class_maps(tree, tmp_path):
    assert ImageFolderData(str(tree), **SMALL).classes == ["class2", "class10", "eel"]
    assert ImageFolderData(str(tree), **{**SMALL, "class_order": "sorted"}).classes == ["class10", "class2", "eel"]
    assert ImageFolderData(str(tree), **{k: v for k, v in SMALL.items() if k != "class_order"}).classes == \
        ["class10", "class2", "eel"], "the constructor's default is the plain sort that saved runs were trained with"
    class_map = tmp_path / "classes.txt"
    class_map.write_text("eel\nclass10\nclass2\nfox\n")
    data = ImageFolderData(str(tree), class_map=str(class_map), **SMALL)
    assert data.classes == ["eel", "class10", "class2", "fox"] and data.num_classes == 4
    assert {data.classes[label] for label in data.val.targets} == {"eel", "class10", "class2"}
    class_map.write_text("eel\nclass2\n")
    with pytest.raises(ConfigError, match="class10") as err:
        ImageFolderData(str(tree), class_map=str(class_map), **SMALL)
    assert "\n" not in str(err.value)


def test_evaluation_reads_val_alone_or_any_folder_of_class_folders(tree, tmp_path):
    import shutil
    val_only = tmp_path / "val_only"
    shutil.copytree(tree / "val", val_only / "val")
    with pytest.raises(ConfigError, match="does not exist"):
        ImageFolderData(str(val_only), **SMALL)  # training needs train/
    data = ImageFolderData(str(val_only), splits=("val",), **SMALL)
    assert data.train is None and len(data.val) == 6 and data.classes == fx.NATURAL
    bare = ImageFolderData(str(tree / "val"), splits=("val",), **SMALL)  # class folders, no val/ above them
    assert items(bare.val) == items(data.val)
    tars, _ = fx.ilsvrc_tars(tree, tmp_path / "ilsvrc")
    (tars / "ILSVRC2012_img_train.tar").unlink()
    assert items(ImageFolderData(str(tars), splits=("val",), **SMALL).val) == items(data.val)


@pytest.mark.parametrize("case, expected", [
    ("compressed", "uncompressed tar"),
    ("no labels", "no labels file was found"),
    ("no val", "no val tars"),
    ("bad source", "data.source"),
    ("missing class map", "does not exist"),
])
def test_bad_roots_and_maps_are_one_line_errors(tree, tmp_path, case, expected):
    root, kwargs = tmp_path / "root", {}
    if case == "compressed":
        root.mkdir()
        (root / "train.tar").write_bytes(b"\x1f\x8b" + b"\0" * 600)
        (root / "val.tar").write_bytes(b"\x1f\x8b" + b"\0" * 600)
    elif case == "no labels":
        fx.ilsvrc_tars(tree, root)
        (root / "LOC_val_solution.csv").unlink()
    elif case == "no val":
        fx.tars_of_folders(tree, root)
        (root / "val.tar").unlink()
    elif case == "bad source":
        root, kwargs = tree, {"source": "zip"}
    else:
        root, kwargs = tree, {"class_map": str(tmp_path / "nowhere.txt")}
    with pytest.raises(ConfigError) as err:
        ImageFolderData(str(root), **{**SMALL, **kwargs})
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_imagenet_data_reads_tars_and_checks_the_class_count(tree, tmp_path, monkeypatch):
    root, truth = fx.ilsvrc_tars(tree, tmp_path / "ilsvrc")
    with pytest.raises(ConfigError, match="ImageNet-1K expects 1000"):
        ImageNetData(str(root), **SMALL)
    monkeypatch.setattr(ImageNetData, "expected_classes", 3)
    data = ImageNetData(str(root), **SMALL)
    assert data.source == "tar"
    for index in range(len(data.val)):
        name = data.val.path(index).rsplit("/", 1)[-1]
        assert data.classes[data.val.targets[index]] == truth[name]


TRAIN_WORDS = ("data=imagefolder", "data.img_size=32", "data.repeated_aug=1", "trainer.batch_size=3",
               "trainer.epochs=2", "trainer.max_steps=null", "data.index_cache=null")


MAKERS = {"tar": fx.tars_of_folders, "hfds": fx.hf_parquet,
          "wds": lambda tree, out: fx.wds_shards(tree, out, shards=(2, 1))}


@pytest.mark.parametrize("source", [pytest.param("tar", marks=pytest.mark.slow),
                                    pytest.param("hfds", marks=pytest.mark.slow), "wds"])
def test_training_runs_from_tars_and_from_streamed_shards(tree, tmp_path, source, train_in_process, eval_in_process):
    """(The map-style sources share the folder's loader: tar and hfds with the slow tests, the stream by default.)"""
    root = MAKERS[source](tree, tmp_path / source)
    out = tmp_path / "run"
    assert train_in_process(*FAST_TRAIN, *TRAIN_WORDS, f"data.root={root}", f"data.source={source}",
                            f"hydra.run.dir={out}")[0] == 0
    summary = read_summary(out)
    assert summary["steps"] == 6 and summary["val/count"] == 6, "9 images, batches of 3, 2 epochs; 6 val images"
    config = (out / "config.yaml").read_text()
    assert f"source: {source}" in config and "class_order: natural" in config
    # its checkpoint evaluated on a folder that holds val/ alone
    val_only = tmp_path / "val_only"
    (val_only / "val").parent.mkdir()
    import shutil
    shutil.copytree(tree / "val", val_only / "val")
    assert eval_in_process(f"ckpt={out / 'checkpoints' / 'last.pt'}", f"+data.root={val_only}", "+data.source=folder",
                           "eval.num_workers=0", "eval.device=cpu", f"hydra.run.dir={tmp_path / 'eval'}")[0] == 0
    assert read_summary(tmp_path / "eval")["val/count"] == 6


def test_flat_val_labels_from_the_ilsvrc_devkit(tree, tmp_path):
    """ILSVRC2012_img_val.tar's labels from ILSVRC2012_devkit_t12.tar.gz beside it (meta.mat + the ground truth
    file, ILSVRC2012_IDs that are not the class order)."""
    import tarfile

    import scipy.io
    root, truth = fx.ilsvrc_tars(tree, tmp_path / "ilsvrc")
    (root / "LOC_val_solution.csv").unlink()
    ids = {"eel": 1, "class10": 2, "class2": 3}  # the devkit's own numbering
    kit = tmp_path / "kit" / "ILSVRC2012_devkit_t12" / "data"
    kit.mkdir(parents=True)
    synsets = np.array([(i, w, w, "", 0, [], 0, 0) for w, i in ids.items()],
                       dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("gloss", "O"),
                              ("num_children", "O"), ("children", "O"), ("wordnet_height", "O"),
                              ("num_train_images", "O")])
    scipy.io.savemat(kit / "meta.mat", {"synsets": synsets})
    names = sorted(truth)
    (kit / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{ids[truth[n]]}\n" for n in names))
    with tarfile.open(root / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as tf:
        tf.add(kit.parent, arcname="ILSVRC2012_devkit_t12")
    data = ImageFolderData(str(root), splits=("val",), **SMALL)
    assert data.classes == fx.NATURAL
    for index in range(len(data.val)):
        assert data.classes[data.val.targets[index]] == truth[data.val.path(index).rsplit("/", 1)[-1]]
