"""``eval.py model=<preset> pretrained=<weights> eval.sets=[in1k,real,v2,a,r]``: each set's layout (ReaL file names,
V2's numeric class folders, A's and R's 200 wnid folders), scored as timm scores them, with weights whose predictions
are known: the classifier's weights are zero and its biases rank the classes, so every image gets the same top-5."""
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from moh_vision.data.eval_sets import build_set, imagenet_synsets, subset_indices, timm_info_file

pytestmark = pytest.mark.usefixtures("one_thread")

SYNSETS = imagenet_synsets()
A_INDICES = subset_indices("a")
R_INDICES = subset_indices("r")
REAL = json.load(open(timm_info_file("imagenet_real_labels.json")))
TOP = [970, 1, 2, 0, 3]  # the weights' top-5 classes, best first (970 is in the ReaL set of val image 2)
A_BEST = A_INDICES[5]  # the best of A's classes (ranked below TOP's), so restricting the logits makes it top-1


def _png(path, seed):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (36, 40, 3), dtype=np.uint8)).save(path, "PNG")


def head_bias() -> torch.Tensor:
    bias = torch.linspace(0, -1, 1000)
    bias[A_BEST] = 5.0
    for rank, index in enumerate(TOP):
        bias[index] = 20.0 - rank
    return bias


def restricted_top1(indices):
    bias = head_bias()
    return max(indices, key=lambda i: float(bias[i]))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    torch.manual_seed(0)
    model = timm.create_model("transnext_nano", num_classes=1000)
    state = model.state_dict()
    state["head.weight"].zero_()
    state["head.bias"].copy_(head_bias())
    path = tmp_path_factory.mktemp("weights") / "nano_1000.pth"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """ImageNet val (val/ only: wnid folders of ReaL-named files), V2 (folders 0..11), A and R (4 wnid folders)."""
    root = tmp_path_factory.mktemp("sets")
    for n in range(1, 9):  # val images 1..8: image 1 has no ReaL labels
        wnid = SYNSETS[REAL[n - 1][0]] if REAL[n - 1] else SYNSETS[n]
        _png(root / "in1k" / "val" / wnid / f"ILSVRC2012_val_{n:08d}.JPEG", n)
    for c in range(12):  # folders 1 and 10 and 2: the plain string sort would put 10 before 2
        _png(root / "v2" / str(c) / f"{c}.jpeg", 100 + c)
    for name, indices in (("a", A_INDICES), ("r", R_INDICES)):
        for k in (0, 5, 6, 7):
            _png(root / name / SYNSETS[indices[k]] / f"{k}.jpg", 200 + k)
    return root


def words(sets, weights, out, *more):
    return ("model=transnext_nano", f"pretrained={weights}", "data=imagenet", f"data.root={sets / 'in1k'}",
            f"data.class_map={timm_info_file('imagenet_synsets.txt')}", "eval.batch_size=4", "eval.num_workers=0",
            "eval.device=cpu", f"hydra.run.dir={out}", *more)


def expected():
    """What timm's scoring gives for these weights (every image's top-5 is TOP)."""
    real_kept = [n for n in range(1, 9) if REAL[n - 1]]
    real1 = sum(TOP[0] in REAL[n - 1] for n in real_kept) / len(real_kept)
    real5 = sum(any(p in REAL[n - 1] for p in TOP) for n in real_kept) / len(real_kept)
    in1k_labels = [REAL[n - 1][0] if REAL[n - 1] else n for n in range(1, 9)]
    return {"in1k/acc1": 100 * np.mean([t == TOP[0] for t in in1k_labels]),
            "real/acc1": 100 * real1, "real/acc5": 100 * real5, "real/count": len(real_kept),
            "v2/acc1": 0.0, "v2/acc5": 100 * 4 / 12,  # classes 0 ... 3 of TOP have folders (970 has none)
            "a/acc1": 100 / 4,  # A's folders 0, 5, 6, 7: the restricted top-1 is folder 5's class
            "r/acc1": 100 * sum(R_INDICES[k] == restricted_top1(R_INDICES) for k in (0, 5, 6, 7)) / 4}


def test_each_set_is_scored_as_timm_scores_it(sets, weights, tmp_path, eval_in_process):
    from timm.data import RealLabelsImagenet
    out = tmp_path / "eval"
    code, err = eval_in_process(*words(sets, weights, out, "eval.sets=[in1k,real,v2,a,r]",
                                       f"+eval.roots={{v2: {sets / 'v2'}, a: {sets / 'a'}, r: {sets / 'r'}}}"))
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    for key, value in expected().items():
        assert summary[key] == pytest.approx(value), key
    assert summary["val/count"] == 8 and summary["real/count"] == 7 and summary["sets"]["real"]["left_out"] == 1
    assert summary["a/count"] == summary["r/count"] == 4 and summary["v2/count"] == 12
    assert summary["class_order"] == "natural"
    assert A_BEST not in TOP and TOP[0] not in A_INDICES, "unrestricted, A's top-1 would be 0"
    # ReaL as timm's evaluator scores the same predictions
    names = [f"ILSVRC2012_val_{n:08d}.JPEG" for n in range(1, 9)]
    real = RealLabelsImagenet(names + [f"ILSVRC2012_val_{n:08d}.JPEG" for n in range(9, 50001)])
    logits = torch.full((8, 1000), -1.0)
    logits[:, TOP] = torch.tensor([5.0, 4, 3, 2, 1])
    real.add_result(logits)
    assert summary["real/acc1"] == pytest.approx(real.get_accuracy(1))
    assert summary["real/acc5"] == pytest.approx(real.get_accuracy(5))


def test_v2_folders_are_their_class_numbers(sets):
    """Folder 10 is class 10 (the plain string sort would make it class 2), whatever the data's class order."""
    one = build_set("v2", {"v2": str(sets / "v2")}, None, None)
    assert {one.dataset.path(i).split("/")[-2]: int(t) for i, t in enumerate(one.dataset.targets)} == \
        {str(c): c for c in range(12)}


@pytest.mark.parametrize("more, expected", [
    (("eval.sets=[v2]",), "eval.roots.v2"),
    (("eval.sets=[sketch]", "+eval.roots={sketch: /tmp}"), "expected some of"),
    (("eval.sets=[a]", "+eval.roots={a: V2}"), "ImageNet-A"),
])
def test_missing_or_wrong_set_roots_are_one_line_errors(sets, weights, tmp_path, eval_in_process, more, expected):
    more = tuple(m.replace("V2", str(sets / "v2")) for m in more)
    code, err = eval_in_process(*words(sets, weights, tmp_path / "eval", *more))
    assert code == 2 and expected in err, err
    assert len([line for line in err.splitlines() if line.startswith("error")]) == 1


def test_classes_that_cannot_match_the_model_are_one_line_errors(sets, weights, tmp_path, eval_in_process):
    class_map = tmp_path / "reversed.txt"
    class_map.write_text("\n".join(reversed(SYNSETS)) + "\n")
    code, err = eval_in_process(*words(sets, weights, tmp_path / "eval", f"data.class_map={class_map}"))
    assert code == 2 and "do not match the ImageNet-1K model" in err, err
