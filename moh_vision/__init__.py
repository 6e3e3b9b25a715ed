"""moh-vision: Mixture-of-Head attention (MoH) and Mixture of Attention heads (MoA) for vision.

``import moh_vision`` registers the attention variants and the timm models."""
from . import attention  # noqa: F401
from . import models  # noqa: F401

__version__ = "0.1.0"
