"""Model families, registered with timm on import: ``timm.create_model("moh_dit_xl_2_90")``. Each model class carries
its family tag (``TransNeXt.family == "transnext"``, ``"dit"``, ``"vit"``): :func:`model_family` answers it for a
registered name or a built model; :func:`list_models` names every model this package registers."""
from . import transnext, dit, vit  # noqa: F401  (registration)
from .dit import DiT
from moh_vision.checkpoints import read_weights, state_dict_mismatch  # noqa: F401
from .build import attention_kwargs, build_model, load_weights  # noqa: F401
from .families import list_models, model_class, model_family, unwrap_model  # noqa: F401
from .transnext import TransNeXt
from .vit import PlainViT

FAMILIES = {cls.family: cls for cls in (TransNeXt, DiT, PlainViT)}
