"""ADM's evaluation suite: the five numbers from activations (against independent computations), the Inception
activations (torch-fidelity's port, a random-weight copy: the real file is 91 MB and must not be downloaded),
``tools/evaluate_samples.py`` on ADM-layout .npz files, and the digits proxy classifier."""
import json
import math
import re
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import linalg

from helpers import load_tool
from moh_vision.analysis import generative_metrics, metrics
from moh_vision.analysis.adm_evaluation import NpzImages, read_reference
from moh_vision.analysis.generative_metrics import adm_metrics, inception_score
from moh_vision.analysis.inception import InceptionActivations, check_inception_weights
from moh_vision.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Independent computations: scipy's sqrtm, brute-force neighbours, the Inception Score's definition
# ---------------------------------------------------------------------------------------------
def frechet_by_sqrtm(mu1, sigma1, mu2, sigma2):
    covmean = linalg.sqrtm(sigma1 @ sigma2)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean.real))


def gaussian_of(x):
    return x.mean(axis=0), np.cov(x, rowvar=False)


def distances(a, b):
    return np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))


def knn_radii(points, k):
    d = distances(points, points)
    np.fill_diagonal(d, np.inf)  # a point is not its own neighbour
    return np.sort(d, axis=1)[:, k - 1]


def share_inside(points, centres, radii):
    return float((distances(points, centres) <= radii[None, :]).any(axis=1).mean())


def inception_score_by_definition(probs, split):
    scores = []
    for start in range(0, len(probs), split):
        part = probs[start:start + split]
        marginal = part.mean(axis=0)
        kl = [sum(p * math.log(p / q) for p, q in zip(row, marginal) if p > 0) for row in part]
        scores.append(math.exp(sum(kl) / len(kl)))
    return sum(scores) / len(scores)


def random_spd(rng, d):
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.5 * np.eye(d)


def softmax_rows(rng, n, classes, temperature=2.0):
    logits = rng.normal(size=(n, classes)) * temperature
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture
def activations():
    rng = np.random.default_rng(0)
    samples = {"pool": rng.normal(0.4, 1.0, (45, 6)).astype(np.float32),
               "spatial": rng.normal(0.0, 1.3, (45, 5)).astype(np.float32),
               "probs": softmax_rows(rng, 45, 11)}
    reference = {"pool": rng.normal(0.0, 1.0, (35, 6)).astype(np.float32),
                 "spatial": rng.normal(0.0, 1.0, (35, 5)).astype(np.float32),
                 # the whole training set's statistics, unlike those of the reference batch's own activations
                 "mu": rng.normal(1.0, 0.5, 6), "sigma": random_spd(rng, 6),
                 "mu_s": rng.normal(-0.5, 0.5, 5), "sigma_s": random_spd(rng, 5)}
    return samples, reference


def test_each_number_matches_an_independent_computation(activations):
    samples, reference = activations
    out = adm_metrics(samples, reference, split_size=20)
    assert set(out) == {"fid", "sfid", "inception_score", "precision", "recall"}
    fake_pool, fake_spatial = gaussian_of(samples["pool"].astype(np.float64)), gaussian_of(samples["spatial"])
    assert out["fid"] == pytest.approx(frechet_by_sqrtm(*fake_pool, reference["mu"], reference["sigma"]), rel=1e-9)
    assert out["sfid"] == pytest.approx(frechet_by_sqrtm(*fake_spatial, reference["mu_s"], reference["sigma_s"]),
                                        rel=1e-9)
    # the stored statistics took precedence over the reference activations' own
    own = frechet_by_sqrtm(*fake_pool, *gaussian_of(reference["pool"].astype(np.float64)))
    assert abs(out["fid"] - own) > 0.1
    assert out["inception_score"] == pytest.approx(inception_score_by_definition(samples["probs"], 20), rel=1e-12)
    ref, fake = reference["pool"].astype(np.float64), samples["pool"].astype(np.float64)
    precision = share_inside(fake, ref, knn_radii(ref, 3))
    recall = share_inside(ref, fake, knn_radii(fake, 3))
    assert (out["precision"], out["recall"]) == (precision, recall)
    assert 0 < precision < 1 and 0 < recall < 1  # neither trivially 0 nor 1 on these sets


def test_without_stored_statistics_the_reference_activations_give_them(activations):
    samples, reference = activations
    plain = {"pool": reference["pool"], "spatial": reference["spatial"]}
    out = adm_metrics(samples, plain)
    assert out["fid"] == pytest.approx(frechet_by_sqrtm(*gaussian_of(samples["pool"].astype(np.float64)),
                                                        *gaussian_of(reference["pool"].astype(np.float64))), rel=1e-9)
    assert out["sfid"] == pytest.approx(frechet_by_sqrtm(*gaussian_of(samples["spatial"].astype(np.float64)),
                                                         *gaussian_of(reference["spatial"].astype(np.float64))),
                                        rel=1e-9)
    same = adm_metrics({"pool": reference["pool"]}, {"pool": reference["pool"]})
    assert abs(same["fid"]) < 1e-6 and same["precision"] == same["recall"] == 1.0


def test_a_number_whose_inputs_are_missing_is_left_out(activations):
    samples, reference = activations
    assert set(adm_metrics({"probs": samples["probs"]}, {})) == {"inception_score"}
    stats_only = {k: reference[k] for k in ("mu", "sigma")}  # FID without reference images: no precision/recall
    assert set(adm_metrics({"pool": samples["pool"]}, stats_only)) == {"fid"}
    assert set(adm_metrics({"spatial": samples["spatial"]}, reference)) == {"sfid"}


def test_inception_score_closed_forms():
    assert inception_score(np.full((10, 4), 0.25)) == pytest.approx(1.0)  # every prediction the same
    one_hot = np.eye(5)[np.arange(20) % 5]  # confident and evenly spread over 5 classes, zeros included
    assert inception_score(one_hot) == pytest.approx(5.0)
    assert inception_score(one_hot, split_size=10) == pytest.approx(5.0)


def confident_softmaxes(labels, rng, columns=1008):
    """Made-up Inception softmaxes, each confident in its sample's class (ADM's graph has 1008 outputs)."""
    logits = rng.normal(size=(len(labels), columns))
    logits[np.arange(len(labels)), labels] += 12.0
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_balanced_samples_are_written_in_an_order_that_keeps_the_inception_score(caplog):
    """tools/sample.py's balanced labels (per_class=), 10 of each of 1000 classes: the Inception Score over ADM's
    consecutive splits of 5,000 is the score of the same samples in a random order, not the collapsed score of
    samples sorted by class (each split would see 500 classes)."""
    from moh_vision.apps.sampling import balanced_labels

    rng = np.random.default_rng(0)
    labels = balanced_labels(10_000, 1000, seed=0).numpy()
    probs = confident_softmaxes(labels, rng)  # in the order the tool writes the samples
    shuffled = inception_score(probs[rng.permutation(len(probs))])
    in_class_order = probs[np.argsort(labels, kind="stable")]
    assert inception_score(probs) == pytest.approx(shuffled, rel=0.02)
    assert inception_score(in_class_order) < 0.6 * shuffled
    with caplog.at_level("WARNING", logger=generative_metrics.__name__):
        adm_metrics({"probs": probs}, {})
        assert "they are ordered" not in caplog.text
        adm_metrics({"probs": in_class_order}, {})  # an npz sorted elsewhere: said, and still ADM's number
        assert "they are ordered (by class?)" in caplog.text


def test_inconsistent_activations_fail_with_one_line(activations):
    samples, reference = activations
    with pytest.raises(ConfigError, match="holds mu but not sigma"):
        adm_metrics(samples, {"mu": reference["mu"]})
    with pytest.raises(ConfigError, match="mu_s .* and sigma_s .* are not a \\[D\\] mean"):
        adm_metrics(samples, {"mu_s": reference["mu_s"], "sigma_s": reference["sigma"]})
    with pytest.raises(ConfigError, match="6-d but the reference's pool statistics are 4-d"):
        adm_metrics(samples, {"mu": np.zeros(4), "sigma": np.eye(4)})
    with pytest.raises(ConfigError, match="more than 3 samples"):
        adm_metrics({"pool": samples["pool"][:3]}, {"pool": reference["pool"]})
    with pytest.raises(ConfigError, match="float \\[N, D\\]"):
        adm_metrics({"pool": samples["pool"][0]}, reference)
    with pytest.raises(ConfigError, match="non-negative softmax rows"):
        inception_score(-samples["probs"])


# ---------------------------------------------------------------------------------------------
# Inception activations
# ---------------------------------------------------------------------------------------------
def images(seed, n=6, size=16, low=0, high=256):
    return np.random.default_rng(seed).integers(low, high, (n, size, size, 3), dtype=np.uint8)


def test_activations_are_pool3_the_unbiased_softmax_and_mixed_6d_branch1x1_in_nhwc_order(tiny_inception):
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    batch = images(0, n=3)
    acts = InceptionActivations(tiny_inception)(batch)
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                      feature_extractor_weights_path=str(tiny_inception))
    block_input = []
    net.Mixed_6d.register_forward_hook(lambda module, inputs, output: block_input.append(inputs[0]))
    with torch.no_grad():
        pool, logits = net(torch.from_numpy(batch).permute(0, 3, 1, 2))
        branch = net.Mixed_6d.branch1x1(block_input[0])  # TF's mixed_6/conv: conv, batchnorm, ReLU
    np.testing.assert_array_equal(acts["pool"], pool.numpy())
    np.testing.assert_allclose(acts["probs"], torch.softmax(logits.double(), -1).numpy(), rtol=1e-12)
    assert np.allclose(acts["probs"].sum(1), 1) and acts["probs"].shape == (3, 1008)
    _, _, rows, cols = branch.shape  # 3 x 3 at the tests' 75 px input, 17 x 17 at 299
    assert acts["spatial"].shape == (3, rows * cols * 7) and (acts["spatial"] >= 0).all()
    for i in range(3):  # TF's NHWC flattening: (row, column, channel), channels fastest
        for r in range(rows):
            for c in range(cols):
                for ch in range(7):
                    assert acts["spatial"][i, (r * cols + c) * 7 + ch] == branch[i, ch, r, c].item()


def test_at_299_px_the_activations_have_adm_widths(random_inception_weights):
    widths = InceptionActivations(random_inception_weights).widths()
    assert widths == {"pool": 2048, "spatial": 2023, "probs": 1008}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpu_numbers(random_inception_weights, activations):
    """Inception in float32 (no TF32) and the neighbour distances on the GPU agree with the CPU's."""
    samples, reference = activations
    on_gpu, on_cpu = adm_metrics(samples, reference, device="cuda"), adm_metrics(samples, reference)
    assert on_gpu == pytest.approx(on_cpu, rel=1e-6)
    batch = images(0, n=4, size=64)
    cpu, gpu = InceptionActivations(random_inception_weights)(batch), InceptionActivations(
        random_inception_weights, "cuda")(batch)
    assert torch.backends.cudnn.allow_tf32, "the caller's TF32 setting is restored"
    for key in ("pool", "spatial", "probs"):
        np.testing.assert_allclose(gpu[key], cpu[key], rtol=1e-3, atol=1e-4, err_msg=key)


def precision_views():
    """What every precision setting of torch reads as: cuBLAS and cuDNN TF32, the matmul precision, the per-backend
    fp32 precisions."""
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(), *(owner.fp32_precision for owner in metrics._FP32_PRECISIONS))


FLOAT32 = (False, False, "highest", *["ieee"] * len(metrics._FP32_PRECISIONS))


@contextmanager
def settings(*assignments):
    """Apply ``(owner, attribute, value)`` assignments (owner None: set_float32_matmul_precision), restore torch's
    defaults after."""
    defaults = [owner.fp32_precision for owner in metrics._FP32_PRECISIONS]
    for owner, name, value in assignments:
        torch.set_float32_matmul_precision(value) if owner is None else setattr(owner, name, value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True
        for owner, value in zip(metrics._FP32_PRECISIONS, defaults):
            owner.fp32_precision = value


TF32_ON = ((None, None, "high"), (torch.backends.cudnn, "allow_tf32", True))


def test_every_metric_is_computed_without_tf32_whatever_the_caller_set(tiny_inception, activations, monkeypatch):
    """tools/sample.py samples with TF32 on; the Inception forward, the Frechet distances and the neighbour distances
    of the metrics then still see TF32 off in every setting, give the numbers of the float32 path, and the caller's
    settings are back afterwards."""
    seen = []

    def spy(what, real):
        return lambda *args: seen.append((what, precision_views())) or real(*args)

    monkeypatch.setattr(generative_metrics, "squared_distances",
                        spy("distances", generative_metrics.squared_distances))
    monkeypatch.setattr(generative_metrics, "frechet_distance", spy("frechet", generative_metrics.frechet_distance))
    inception = InceptionActivations(tiny_inception)
    inception.net.register_forward_pre_hook(lambda module, inputs: seen.append(("inception", precision_views())))
    batch = images(0, n=2)
    plain_metrics, plain_activations = adm_metrics(*activations), inception(batch)
    for assignments in (TF32_ON, ((torch.backends.cuda.matmul, "allow_tf32", True),),
                        ((None, None, "high"), (torch.backends.cuda.matmul, "allow_tf32", False)),  # a mix
                        ((None, None, "medium"), (torch.backends.cudnn.conv, "fp32_precision", "tf32"))):
        seen.clear()
        with settings(*assignments):
            before = [owner.fp32_precision for owner in metrics._FP32_PRECISIONS], \
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            found, acts = adm_metrics(*activations), inception(batch)
            generative_metrics.precision_recall(activations[1]["pool"], activations[0]["pool"])  # called alone
            after = [owner.fp32_precision for owner in metrics._FP32_PRECISIONS], \
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        assert {what for what, _ in seen} == {"distances", "frechet", "inception"}, assignments
        assert all(views == FLOAT32 for _, views in seen), (assignments, seen)
        assert after == before, "the caller's settings are restored"
        assert found == plain_metrics
        for key, value in acts.items():
            np.testing.assert_array_equal(value, plain_activations[key])


def test_npz_images_stream_what_np_load_reads(tmp_path):
    data = images(3, n=7)
    np.savez(tmp_path / "plain.npz", arr_0=data)
    np.savez_compressed(tmp_path / "compressed.npz", arr_0=data, extra=np.zeros(2))
    for name in ("plain", "compressed"):
        source = NpzImages(tmp_path / f"{name}.npz", "samples=")
        batches = list(source.batches(3))
        assert [len(b) for b in batches] == [3, 3, 1] and source.shape == data.shape
        np.testing.assert_array_equal(np.concatenate(batches), data)


def test_a_reference_folder_gives_its_images_cropped_to_the_samples_size(tmp_path):
    real = images(1, n=3)
    folder = tmp_path / "ref" / "class0"
    folder.mkdir(parents=True)
    for i, img in enumerate(real):
        Image.fromarray(img).save(folder / f"{i}.png")
    Image.fromarray(images(5, n=1, size=40)[0]).resize((40, 24)).save(folder / "z_large.png")
    (tmp_path / "ref" / ".hidden.png").write_bytes(b"ignored")
    reference = read_reference(tmp_path / "ref", side=16)
    got = np.concatenate(list(reference.images.batches(2)))
    assert got.shape == (4, 16, 16, 3) and not reference.statistics
    np.testing.assert_array_equal(got[:3], real)


# ---------------------------------------------------------------------------------------------
# tools/evaluate_samples.py
# ---------------------------------------------------------------------------------------------
def evaluate(*words):
    return load_tool("evaluate_samples").main([*words, "progress=false", "device=cpu"])


def test_the_tool_reports_adm_numbers_of_the_npz_files(tiny_inception, tmp_path):
    fake, real = images(0, n=8), images(1, n=7, size=20, high=160)
    rng = np.random.default_rng(2)
    stored = {"mu": rng.normal(size=2048), "sigma": random_spd(rng, 2048),
              "mu_s": rng.normal(size=63), "sigma_s": random_spd(rng, 63)}
    np.savez(tmp_path / "samples.npz", arr_0=fake)
    np.savez(tmp_path / "ref.npz", arr_0=real, **stored)
    summary = evaluate(f"samples={tmp_path / 'samples.npz'}", f"ref={tmp_path / 'ref.npz'}",
                       f"inception={tiny_inception}", "batch_size=3")
    written = json.loads((tmp_path / "samples_adm_metrics.json").read_text())
    assert written == json.loads(json.dumps(summary))
    inception = InceptionActivations(tiny_inception)
    expected = adm_metrics(inception(fake), {**inception(real), **stored})
    for name in ("fid", "sfid", "inception_score", "precision", "recall"):
        assert written[name] == pytest.approx(expected[name], rel=1e-5), name
        assert name in written["definitions"]
    assert written["reference_statistics"] == {"fid": "stored mu/sigma", "sfid": "stored mu_s/sigma_s"}
    assert (written["num_samples"], written["num_reference"]) == (8, 7)
    # without stored statistics: those of the reference images
    np.savez(tmp_path / "ref_images.npz", arr_0=real)
    plain = evaluate(f"samples={tmp_path / 'samples.npz'}", f"ref={tmp_path / 'ref_images.npz'}",
                     f"inception={tiny_inception}", f"out={tmp_path / 'plain.json'}")
    assert plain["reference_statistics"] == {"fid": "reference images", "sfid": "reference images"}
    assert plain["fid"] != pytest.approx(written["fid"]) and plain["precision"] == written["precision"]


@pytest.mark.parametrize("case,message", [
    ("missing", r"samples=.*missing.npz does not exist"),
    ("not_zip", r"is not an .npz archive"),
    ("no_arr_0", r"has no arr_0 \(it holds images\)"),
    ("float", r"arr_0 must be uint8 \[N, H, W, 3\] images .*float32"),
    ("no_channels", r"arr_0 must be uint8 \[N, H, W, 3\] images .*\(4, 16, 16\)"),
    ("mu_without_sigma", r"ref=.* holds mu but not sigma"),
    ("wrong_width", r"the reference's mu is 100-d but this Inception's pool activations are 2048-d"),
    ("no_weights", r"inception=.*nowhere.pth does not exist; .*nothing is downloaded"),
])
def test_a_wrong_input_is_one_error_line(case, message, tiny_inception, tmp_path, capsys):
    samples, ref, weights = tmp_path / "samples.npz", tmp_path / "ref.npz", tiny_inception
    np.savez(samples, arr_0=images(0, n=4))
    np.savez(ref, arr_0=images(1, n=4))
    if case == "missing":
        samples = tmp_path / "missing.npz"
    elif case == "not_zip":
        samples.write_bytes(b"not a zip archive")
    elif case == "no_arr_0":
        np.savez(samples, images=images(0, n=4))
    elif case == "float":
        np.savez(samples, arr_0=images(0, n=4).astype(np.float32))
    elif case == "no_channels":
        np.savez(samples, arr_0=images(0, n=4)[..., 0])
    elif case == "mu_without_sigma":
        np.savez(ref, arr_0=images(1, n=4), mu=np.zeros(2048))
    elif case == "wrong_width":
        np.savez(ref, arr_0=images(1, n=4), mu=np.zeros(100), sigma=np.eye(100))
    else:
        weights = tmp_path / "nowhere.pth"
    with pytest.raises(SystemExit) as exited:
        evaluate(f"samples={samples}", f"ref={ref}", f"inception={weights}")
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]


def test_inception_weights_must_be_a_torch_fidelity_state_dict(tmp_path):
    with pytest.raises(ConfigError, match="need Inception weights"):
        check_inception_weights(None)
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="not a torch-fidelity InceptionV3 state dict"):
        check_inception_weights(tmp_path / "other.pth")
    torch.save({"Conv2d_1a_3x3.conv.weight": torch.zeros(1), "fc.weight": torch.zeros(1000, 2048)},
               tmp_path / "imagenet.pth")
    with pytest.raises(ConfigError, match=r"has fc.weight \[1000, 2048\] \(torchvision's ImageNet Inception.*, not "
                                          r"the 1008-class classifier"):
        check_inception_weights(tmp_path / "imagenet.pth")


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
