"""What a training run's arithmetic rate is measured against: its FLOPs per image and the device's peak, with the
conventions of torchtitan's and nanoGPT's MFU:

* **2 FLOPs per multiply-add.** The project's GFLOPs (fvcore's, :mod:`moh_vision.analysis.flop_count`) count a
  multiply-add as one; vendors' peaks count it as two.
* **Training = 3 x the forward** (the backward computes the gradients of both the inputs and the weights), per image,
  from the **active** count (a MoH layer is charged for the heads a token uses); point-wise work left out, as the peaks
  are those of the matrix units.
* **Dense peaks** (no 2:4 sparsity) from the vendors' datasheets, in TFLOP/s: bf16 / fp16 on the tensor cores with fp32
  accumulation (what PyTorch uses; the GeForce cards run at half the fp16-accumulate rate their box states), tf32 on the
  tensor cores, fp32 without them. A precision the device lacks (bf16 or tf32 before Ampere) has no peak, nor has a CPU:
  utilisation is then not reported."""
from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

FLOPS_PER_MULTIPLY_ADD = 2
TRAINING_PASSES = 3  # forward + backward (gradients of inputs and of weights: two forwards' worth)
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak TFLOP/s of one GPU model per precision (None: the device has no such unit)."""
    name: str
    pattern: str  # searched in torch.cuda.get_device_name() (case-insensitive); the first match wins
    bf16: Optional[float]
    fp16: Optional[float]
    tf32: Optional[float]
    fp32: float

    def tflops(self, precision: str) -> Optional[float]:
        """The peak for ``precision``; tf32 on a device without it runs (and peaks) as fp32."""
        value = getattr(self, precision)
        return self.fp32 if value is None and precision == "tf32" else value


# More specific patterns first: "H100 PCIe" before "H100", "L40S" before "L40" before "L4", "A10" as a word.
PEAKS = (
    DevicePeak("H100 PCIe", r"H100.*PCIe", 756.5, 756.5, 378.0, 51.2),
    DevicePeak("H100 NVL", r"H100.*NVL", 835.5, 835.5, 417.5, 60.0),
    DevicePeak("H100 SXM", r"H100|GH200", 989.4, 989.4, 494.7, 66.9),
    DevicePeak("H200 NVL", r"H200.*NVL", 835.5, 835.5, 417.5, 60.0),
    DevicePeak("H200 SXM", r"H200", 989.4, 989.4, 494.7, 66.9),
    DevicePeak("A100", r"A100|A800", 312.0, 312.0, 156.0, 19.5),
    DevicePeak("L40S", r"L40S", 362.05, 362.05, 183.0, 91.6),
    DevicePeak("L40", r"\bL40\b", 181.05, 181.05, 90.5, 90.5),
    DevicePeak("L4", r"\bL4\b", 121.0, 121.0, 60.0, 30.3),
    DevicePeak("A40", r"\bA40\b", 149.7, 149.7, 74.8, 37.4),
    DevicePeak("A10", r"\bA10\b", 125.0, 125.0, 62.5, 31.2),
    DevicePeak("RTX 6000 Ada", r"RTX 6000 Ada", 364.2, 364.2, 182.1, 91.1),
    DevicePeak("RTX A6000", r"RTX A6000", 154.8, 154.8, 77.4, 38.7),
    DevicePeak("RTX 4090", r"RTX 4090", 165.2, 165.2, 82.6, 82.6),
    DevicePeak("RTX 3090", r"RTX 3090", 71.0, 71.0, 35.6, 35.6),
    DevicePeak("V100 PCIe", r"V100.*PCIE", None, 112.0, None, 14.0),
    DevicePeak("V100 SXM2", r"V100", None, 125.0, None, 15.7),
    DevicePeak("T4", r"\bT4\b", None, 65.0, None, 8.1),
    DevicePeak("MI300X", r"MI300X", 1307.4, 1307.4, 653.7, 163.4),
)


def match_device(device_name: str) -> Optional[DevicePeak]:
    """The table entry of a GPU named as ``torch.cuda.get_device_name`` names it, or None."""
    return next((peak for peak in PEAKS if re.search(peak.pattern, device_name, re.IGNORECASE)), None)


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """Dense peak TFLOP/s of ``device_name`` at ``precision`` (one of :data:`PRECISIONS`), None if unknown."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; expected one of {', '.join(PRECISIONS)}")
    peak = match_device(device_name)
    return None if peak is None else peak.tflops(precision)


def run_precision(amp: str) -> str:
    """The matrix units a run with ``trainer.amp=amp`` uses: bf16, fp16, or for fp32 runs tf32 when PyTorch lets fp32
    matmuls use it (``torch.set_float32_matmul_precision("high")``), else fp32."""
    if amp in ("bf16", "fp16"):
        return amp
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_name(device: torch.device) -> str:
    """The name the peak is matched by: the GPU's, or ``cpu`` (with its model where known)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({cpu_name()})" if device.type == "cpu" else device.type


def cpu_name() -> str:
    """This machine's processor model (``/proc/cpuinfo``'s model name where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def training_gflops_per_image(flops: Mapping[str, Any]) -> Optional[float]:
    """GFLOPs (2 per multiply-add) of one training image, 3 x the active forward; None when FLOPs were not counted."""
    active = flops.get("active_gflops")
    return None if active is None else FLOPS_PER_MULTIPLY_ADD * TRAINING_PASSES * float(active)
