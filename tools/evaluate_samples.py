#!/usr/bin/env python
"""ADM's evaluation suite without TensorFlow: FID, sFID, Inception Score, precision and recall of a samples .npz.

    python tools/evaluate_samples.py samples=samples/xl_2/samples.npz ref=VIRTUAL_imagenet256_labeled.npz \\
        inception=weights-inception-2015-12-05-6726825d.pth

``samples``: ``arr_0`` uint8 [N, H, W, 3] (tools/sample.py's or DiT's sample_ddp.py's .npz); ``ref``: one of ADM's
reference batches (its stored mu/sigma and mu_s/sigma_s are used) or a folder of images; ``inception``: a LOCAL copy
of torch-fidelity's port of TF's 2015-12-05 Inception (nothing is downloaded), checked before any image is read.
Everything is computed in float32 (no TF32, whatever torch's settings); a samples file ordered by class (its Inception
Score far from that of the same samples shuffled) is warned about. Prints the numbers and writes them, with their
definitions, as JSON. Definitions and layer correspondence: moh_vision/analysis/generative_metrics.py and
moh_vision/analysis/inception.py.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from moh_vision.analysis.adm_evaluation import evaluate_samples
from moh_vision.cli import Option, boolean, integer, run_tool

OPTIONS = (
    Option("samples", required=True, help="samples .npz: arr_0 uint8 [N, H, W, 3]"),
    Option("ref", required=True,
           help="ADM reference batch .npz (arr_0 + mu/sigma, mu_s/sigma_s) or a folder of images"),
    Option("inception", required=True, help="LOCAL torch-fidelity Inception weights "
           "(weights-inception-2015-12-05-6726825d.pth)"),
    Option("batch_size", 64, integer, "images per Inception call", minimum=1),
    Option("device", "auto", help="auto | cuda | cuda:<n> | cpu"),
    Option("out", help="JSON output (default: <samples stem>_adm_metrics.json beside the samples)"),
    Option("progress", True, boolean, "show a progress bar"),
)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_tool(evaluate_samples, argv, OPTIONS, __doc__)


if __name__ == "__main__":
    main()
