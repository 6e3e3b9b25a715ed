"""Model families, registered with timm on import: ``timm.create_model("moh_dit_xl_2_90")``."""
from . import transnext, dit, vit  # noqa: F401  (registration)
from .factory import attention_kwargs, build_model, load_weights, state_dict_mismatch, unwrap_model  # noqa: F401
