"""Run an entry point with torch-fidelity's Inception taking 75 px inputs instead of 299 (the smallest it takes), and
no download possible: ``python tests/small_inception.py train.py <args>`` (also under torchrun, one per rank). What
``conftest.tiny_inception`` does in the test process, for the tests that run the real entry points in subprocesses."""
from __future__ import annotations

import runpy
import sys


def main(script: str, *args: str) -> None:
    import torch_fidelity.feature_extractor_inceptionv3 as tf_inception

    def download(*_, **__):
        raise AssertionError("torch-fidelity tried to download weights")

    tf_inception.FeatureExtractorInceptionV3.INPUT_IMAGE_SIZE = 75
    tf_inception.load_state_dict_from_url = download
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
