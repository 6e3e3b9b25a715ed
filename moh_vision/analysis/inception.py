"""Inception activations as ADM's evaluator reads them, from torch-fidelity's port of TensorFlow's 2015-12-05 Inception
(the graph ADM loads, ``classify_image_graph_def.pb``), with LOCAL weights: torch-fidelity's
``weights-inception-2015-12-05-6726825d.pth`` (its URL is ``URL_INCEPTION_V3`` in
``torch_fidelity.feature_extractor_inceptionv3``), fetched once where there is a network. What ADM reads from the graph,
and where it is in the port:

* ``pool_3:0`` (2048-d): the port's ``2048`` feature (the 8 x 8 average pool after ``Mixed_7c``);
* ``mixed_6/conv:0``, first 7 channels: the output of ``Mixed_6d.branch1x1``, where torch-fidelity's weight conversion
  maps the graph's ``mixed_6/conv`` parameters (the graph counts its mixed blocks from 0: mixed_6 = 6d, not
  torchvision's 6e). The op ``mixed_6/conv`` is the layer's ReLU, which the port's ``BasicConv2d`` ends with too. The 7
  channels are flattened in TensorFlow's NHWC order, as ADM's ``reshape`` does, to line up with the ``mu_s``/``sigma_s``
  of ADM's reference batches;
* ``softmax`` for the Inception Score: pool_3 times ``softmax/logits/MatMul``'s weights without the bias, the port's
  ``logits_unbiased`` (1008 classes), softmaxed here in float64.

Caveats: the port resizes with TF1's bilinear resize and scales to [-1, 1] as the graph does; its authors report
features equal to TF's up to float round-off, so the numbers agree with ADM's evaluator to round-off (not measured here:
TensorFlow is not installed). That ``mixed_6/conv`` is the ReLU output rests on the graph's naming convention, not on a
check against the graph itself."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import numpy as np
import torch

from moh_vision.errors import ConfigError
from .metrics import full_float32

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_CLASSES = 1008  # the 2015-12-05 graph's softmax; torchvision's ImageNet Inception has 1000
POOL_WIDTH = 2048
SPATIAL_LAYER = "Mixed_6d.branch1x1"  # TF's mixed_6/conv (see the module docstring)
SPATIAL_CHANNELS = 7
_PROBE_KEY = "Conv2d_1a_3x3.conv.weight"  # a key every torch-fidelity InceptionV3 state dict has
TORCH_FIDELITY = "torch-fidelity==0.4.0"  # requirements.txt


def _hint(option: str) -> str:
    return f"{option}= must name a local copy of torch-fidelity's {INCEPTION_FILE} (nothing is downloaded)"


def check_inception_weights(path: Union[str, os.PathLike, None], option: str = "inception") -> Path:
    """The path of a readable state dict of torch-fidelity's InceptionV3 with the 2015-12-05 graph's 1008-class
    classifier, torch-fidelity importable; else a one-line ConfigError naming ``option`` and the fix. Every other key
    and shape is checked where the network is built (:class:`InceptionActivations`)."""
    hint = _hint(option)
    try:
        import torch_fidelity.feature_extractor_inceptionv3  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"FID / sFID / IS / precision-recall need torch-fidelity, its port of the Inception ADM's "
                          f"evaluator uses ({err}): pip install {TORCH_FIDELITY}") from None
    if not path:
        raise ConfigError(f"FID / sFID / IS / precision-recall need Inception weights; {hint}")
    path = Path(str(path)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{option}={path} does not exist; {hint}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"{option}={path} is not a readable state dict ({type(err).__name__}); {hint}")
    if not isinstance(state, dict) or _PROBE_KEY not in state:
        raise ConfigError(f"{option}={path} is not a torch-fidelity InceptionV3 state dict; {hint}")
    classifier = state.get("fc.weight")
    if not torch.is_tensor(classifier) or tuple(classifier.shape) != (INCEPTION_CLASSES, POOL_WIDTH):
        found = f"fc.weight {list(classifier.shape)}" if torch.is_tensor(classifier) else "no fc.weight"
        known = " (torchvision's ImageNet Inception, inception_v3_google-*.pth)" if torch.is_tensor(classifier) and \
            tuple(classifier.shape) == (1000, POOL_WIDTH) else ""
        raise ConfigError(f"{option}={path} has {found}{known}, not the {INCEPTION_CLASSES}-class classifier of the "
                          f"2015-12-05 TF Inception that ADM's evaluator uses; {hint}")
    return path


class InceptionActivations:
    """``pool`` [N, 2048], ``spatial`` [N, 7 * 17 * 17] and ``probs`` [N, 1008] of uint8 NHWC RGB images."""

    def __init__(self, weights: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
                 option: str = "inception"):
        path = check_inception_weights(weights, option)
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        self.device = torch.device(device)
        try:
            net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                              feature_extractor_weights_path=str(path))
        except RuntimeError as err:  # load_state_dict's missing or unexpected keys and shape mismatches, one line
            why = " ".join(str(err).split())
            raise ConfigError(f"{option}={path} does not fit torch-fidelity's InceptionV3 "
                              f"({why if len(why) <= 300 else why[:297] + '...'}); {_hint(option)}") from None
        self.net = net.to(self.device)
        self._spatial: Optional[torch.Tensor] = None
        self.net.get_submodule(SPATIAL_LAYER).register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output: torch.Tensor) -> None:
        first = output[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1)  # NHWC, as the TF graph lays it out
        self._spatial = first.reshape(len(output), -1).float()

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> Dict[str, np.ndarray]:
        """Activations of one batch of uint8 [B, H, W, 3] images."""
        x = torch.from_numpy(np.ascontiguousarray(images)).to(self.device).permute(0, 3, 1, 2)
        with full_float32():
            pool, logits = self.net(x)
        probs = torch.softmax(logits.double(), dim=-1)
        return {"pool": pool.cpu().numpy(), "spatial": self._spatial.cpu().numpy(), "probs": probs.cpu().numpy()}

    def widths(self) -> Dict[str, int]:
        """The width of each activation (one blank image through the network)."""
        return {key: value.shape[1] for key, value in self(np.zeros((1, 8, 8, 3), dtype=np.uint8)).items()}

    def of_batches(self, batches: Iterable[np.ndarray], total: int, desc: str = "Inception",
                   progress: bool = True) -> Dict[str, np.ndarray]:
        """The activations of every batch, concatenated, with a progress bar over the ``total`` images."""
        from tqdm.auto import tqdm
        parts: Dict[str, List[np.ndarray]] = {"pool": [], "spatial": [], "probs": []}
        with tqdm(total=total, unit="img", desc=desc, disable=not progress, dynamic_ncols=True) as bar:
            for batch in batches:
                for key, value in self(batch).items():
                    parts[key].append(value)
                bar.update(len(batch))
        if not parts["pool"]:
            raise ConfigError(f"{desc}: no images")
        return {key: np.concatenate(values) for key, values in parts.items()}
