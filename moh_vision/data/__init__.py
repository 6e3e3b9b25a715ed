"""Datasets and transforms; :func:`cache_dir` holds what the package derives (file indexes, the digits classifier)."""
import os
from pathlib import Path

CACHE_ENV = "MOH_VISION_CACHE_DIR"


def cache_dir() -> Path:
    """Where cached artefacts (the digits classifier) live: ``$MOH_VISION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/moh_vision``, else ``~/.cache/moh_vision``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "moh_vision"
