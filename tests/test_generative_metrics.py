"""FID / Inception Score / precision-recall through torch-fidelity with local Inception weights.

The weights here are a randomly initialised torch-fidelity InceptionV3 saved to a temporary file (the
real file is 91 MB and must not be downloaded): the metrics' behaviour on known inputs does not
depend on trained weights. The input side is cut from 299 to 75 px (the smallest Inception takes)
to keep the test fast on a CPU.
"""
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import torch_fidelity.feature_extractor_inceptionv3 as tf_inception
from moh_vision.analysis.generative_metrics import check_inception_weights, generative_metrics, reference_images
from moh_vision.errors import ConfigError


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    def no_download(*args, **kwargs):
        return {}

    mp = pytest.MonkeyPatch()
    mp.setattr(tf_inception, "load_state_dict_from_url", no_download)
    mp.setattr(tf_inception.FeatureExtractorInceptionV3, "load_state_dict", lambda self, state, **kw: None)
    torch.manual_seed(0)
    model = tf_inception.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    mp.undo()
    for module in model.modules():  # He init keeps activations O(1) through the ~90 layers
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    path = tmp_path_factory.mktemp("inception") / "random_inception.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small shared CPU, OpenMP threads waiting on each other cost 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def small_and_offline(monkeypatch):
    monkeypatch.setattr(tf_inception.FeatureExtractorInceptionV3, "INPUT_IMAGE_SIZE", 75)

    def download(*args, **kwargs):
        raise AssertionError("torch-fidelity tried to download weights")

    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", download)


def images(seed, n=8, low=0, high=256, size=16):
    return np.random.default_rng(seed).integers(low, high, (n, size, size, 3), dtype=np.uint8)


def test_identical_sets_give_zero_fid_and_full_precision_recall(inception_weights):
    a = images(0)
    out = generative_metrics(a, a, inception_weights, isc=False, feature_layer="64")
    assert abs(out["fid"]) < 1e-3
    assert out["precision"] == pytest.approx(1.0) and out["recall"] == pytest.approx(1.0)


def test_different_sets_give_positive_fid(inception_weights):
    fake, real = images(0), images(1, low=0, high=96)  # darker, lower-contrast reference images
    out = generative_metrics(fake, real, inception_weights, isc=False, prc=False, feature_layer="64")
    assert out["fid"] > 0.1 and set(out) == {"fid"}


def test_reference_from_npz_or_folder_reads_the_same_images(tmp_path):
    real = images(1, n=3)
    np.savez(tmp_path / "ref.npz", arr_0=real)
    folder = tmp_path / "ref" / "class0"
    folder.mkdir(parents=True)
    for i, img in enumerate(real):
        Image.fromarray(img).save(folder / f"{i}.png")
    Image.fromarray(images(5, n=1, size=40)[0]).resize((40, 24)).save(folder / "z_large.png")  # cropped to 16
    (tmp_path / "ref" / ".hidden.png").write_bytes(b"ignored")
    from_npz, from_folder = reference_images(tmp_path / "ref.npz", 16), reference_images(tmp_path / "ref", 16)
    assert len(from_npz) == 3 and len(from_folder) == 4
    for i in range(3):
        assert from_npz[i].dtype == torch.uint8 and torch.equal(from_npz[i], from_folder[i])
    assert from_folder[3].shape == (3, 16, 16)


def test_inception_score_is_in_range(inception_weights):
    out = generative_metrics(images(2, n=2), None, inception_weights, fid=False, prc=False)
    assert set(out) == {"inception_score", "inception_score_std"}
    assert 1.0 - 1e-6 <= out["inception_score"] <= 1008


def test_missing_or_wrong_inputs_fail_with_one_line(inception_weights, tmp_path):
    with pytest.raises(ConfigError, match="need Inception weights"):
        check_inception_weights(None)
    with pytest.raises(ConfigError, match="does not exist.*nothing is downloaded"):
        generative_metrics(images(0), images(1), tmp_path / "missing.pth")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="not a torch-fidelity InceptionV3 state dict"):
        check_inception_weights(tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="fid_ref=.*does not exist"):
        generative_metrics(images(0), tmp_path / "nowhere.npz", inception_weights)


# ---------------------------------------------------------------------------------------------
# The digits classifier behind sample/class_acc and sample/fd_digits: trained once, cached
# ---------------------------------------------------------------------------------------------
def test_digits_classifier_is_trained_once_and_cached(tmp_path, monkeypatch):
    from moh_vision.analysis import metrics

    trained = []

    def fake_training(img_size, **_):  # the real one takes most of a short diffusion run
        trained.append(img_size)
        torch.manual_seed(len(trained))
        return metrics.DigitsClassifier(), 99.0

    monkeypatch.setattr(metrics, "train_digits_classifier", fake_training)
    monkeypatch.setenv("MOH_VISION_CACHE_DIR", str(tmp_path / "cache"))
    first = metrics.load_or_train_classifier(tmp_path / "run1" / "digits_classifier.pt", 16)
    second = metrics.load_or_train_classifier(tmp_path / "run2" / "digits_classifier.pt", 16)
    assert trained == [16], "a second run reuses the cached classifier"
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    cached = metrics.classifier_cache_path(16)
    assert cached.parent == tmp_path / "cache" and cached.is_file()
    assert (tmp_path / "run2" / "digits_classifier.pt").is_file(), "the run keeps a copy of what it used"
    assert not list(cached.parent.glob("*.tmp")), "written atomically (no temporary files left)"

    metrics.load_or_train_classifier(None, 8)  # another size is another key
    assert trained == [16, 8] and metrics.classifier_key(8) != metrics.classifier_key(16)

    cached.write_bytes(b"\x00truncated")  # a corrupt cache file is retrained, not a crash
    metrics.load_or_train_classifier(tmp_path / "run3" / "digits_classifier.pt", 16)
    assert trained == [16, 8, 16]
    assert torch.load(cached, weights_only=True)["key"] == metrics.classifier_key(16)
    metrics.load_or_train_classifier(tmp_path / "run4" / "digits_classifier.pt", 16)
    assert trained == [16, 8, 16]

    monkeypatch.delenv("MOH_VISION_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert metrics.cache_dir() == tmp_path / "home" / ".cache" / "moh_vision"


def test_the_proxy_classifiers_first_training_is_announced_with_a_progress_bar(tmp_path, monkeypatch, caplog,
                                                                                 capsys):
    from moh_vision.analysis import metrics

    monkeypatch.setenv("MOH_VISION_CACHE_DIR", str(tmp_path / "cache"))
    real = metrics.train_digits_classifier
    monkeypatch.setattr(metrics, "train_digits_classifier", lambda img_size, **kw: real(img_size, epochs=0, **kw))
    with caplog.at_level("INFO", logger=metrics.__name__):
        metrics.load_or_train_classifier(None, 8)
        assert "training the digits proxy classifier for the sample metrics" in caplog.text
        assert str(tmp_path / "cache") in caplog.text
        assert "digits proxy classifier: 0epoch" in capsys.readouterr().err  # the bar (tqdm)
        caplog.clear()
        metrics.load_or_train_classifier(None, 8)  # cached: nothing to announce
        assert "training the digits proxy classifier" not in caplog.text
