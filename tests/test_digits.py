"""The embedded default data: scikit-learn's digits read from the file it ships, the same arrays as its loader gives,
without importing scikit-learn in the process (every run and most tests start on this data)."""
import subprocess
import sys

import numpy as np

from helpers import REPO
from moh_vision.data.digits import _digits_arrays


def test_the_shipped_file_gives_load_digits_arrays():
    from sklearn.datasets import load_digits
    digits = load_digits()
    pixels, target = _digits_arrays()
    assert pixels.shape == (1797, 8, 8) and np.array_equal(pixels, digits.images)
    assert np.array_equal(target, digits.target) and target.dtype == digits.target.dtype


def test_reading_them_imports_no_scikit_learn():
    code = ("import sys; from moh_vision.data.digits import load_digits_tensors; images, labels = "
            "load_digits_tensors(8); print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy'}), "
            "tuple(images.shape), int(labels.max()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "(1797,", "1,", "8,", "8)", "9"], out
