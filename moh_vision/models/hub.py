"""Where ``pretrained=True`` finds released weights: a local file first, else the Hugging Face Hub or a URL.

The pretrained cfgs carry timm's ``hf_hub_id`` / ``hf_hub_filename`` (TransNeXt, MoH-ViT, MoH-DiT) or ``url`` (DiT).
:func:`released_weights_file` turns that into a local file: ``pretrained_cfg_overlay=dict(file=<path>)`` wins and never
touches the network; a hub id goes through ``huggingface_hub.hf_hub_download``, the hub cache first
(``HF_HUB_OFFLINE=1`` never connects), taking the repo's only weights file where the cfg names none or a missing one; a
URL through timm's download cache. Anything else is one :class:`~moh_vision.errors.ConfigError` naming the id (or URL)
and the local-file route. :func:`moh_vision.checkpoints.read_weights` then reads the file."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Mapping, Optional
from urllib.parse import urlparse

from moh_vision.errors import ConfigError

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (read when asked, not when ``huggingface_hub`` was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in TRUE


def hub_cache_dir(cache_dir: Optional[str] = None) -> str:
    """The hub cache this process uses: ``cache_dir``, ``HF_HUB_CACHE``, ``$HF_HOME/hub``, else the default."""
    from huggingface_hub import constants

    if cache_dir:
        return str(cache_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def local_route(name: str) -> str:
    return (f"or pass a local copy: timm.create_model('{name}', pretrained=True, "
            f"pretrained_cfg_overlay=dict(file=<path>)) (in a config: model.checkpoint_path=<path>)")


def released_weights_file(name: str, cfg: Mapping[str, Any], cache_dir: Optional[str] = None) -> Optional[Path]:
    """The local path of the released weights cfg ``cfg`` of model ``name`` points at (None: it points at none)."""
    if cfg.get("file"):
        return Path(cfg["file"])
    if cfg.get("hf_hub_id"):
        return _from_hub(name, str(cfg["hf_hub_id"]), cfg.get("hf_hub_filename"), cache_dir)
    if cfg.get("url"):
        return _from_url(name, str(cfg["url"]), cache_dir)
    return None


def _weights_files(names: List[str]) -> List[str]:
    return sorted(n for n in names if n.endswith(WEIGHT_SUFFIXES))


def _from_hub(name: str, repo: str, filename: Optional[str], cache_dir: Optional[str]) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    offline, cache = hub_offline(), hub_cache_dir(cache_dir)
    shown = f"{repo} ({filename})" if filename else repo
    fetch = (f"hf download {repo}" + (f" {filename}" if filename else "")
             + (f" --cache-dir {cache}" if cache_dir else ""))
    try:
        if filename:
            try:
                return Path(hf_hub_download(repo, filename, cache_dir=cache, local_files_only=offline))
            except LocalEntryNotFoundError:
                if not offline:
                    raise
            except EntryNotFoundError:
                pass  # the repo does not hold that name: take its only weights file, if it has one
        if offline:  # what of the repo is cached
            folder = Path(snapshot_download(repo, cache_dir=cache, local_files_only=True))
            found = _weights_files([str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()])
        else:
            from huggingface_hub import HfApi
            found = _weights_files(HfApi().list_repo_files(repo))
        if len(found) != 1:
            raise ConfigError(f"{name}: pretrained=True: the Hugging Face repo {repo} holds "
                              f"{len(found) or 'no'} weights files{f' ({found[:4]})' if found else ''} "
                              f"{'in the cache ' + cache if offline else ''} and the cfg names "
                              f"{filename or 'none'}: pass pretrained_cfg_overlay=dict(hf_hub_filename=<one>) "
                              f"{local_route(name)}")
        if offline:
            return folder / found[0]
        return Path(hf_hub_download(repo, found[0], cache_dir=cache))
    except ConfigError:
        raise
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        why = ("HF_HUB_OFFLINE is set and it is not in the hub cache " + cache if offline else
               f"it is not in the hub cache {cache} and the hub could not be reached "
               f"({str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__})")
        raise ConfigError(f"{name}: pretrained=True needs the released weights {shown}: {why}; fetch them "
                          f"where there is a network ({fetch}) {local_route(name)}") from None


def _from_url(name: str, url: str, cache_dir: Optional[str]) -> Path:
    from timm.models._hub import download_cached_file, get_cache_dir

    folder = Path(cache_dir) if cache_dir else Path(get_cache_dir())
    cached = folder / os.path.basename(urlparse(url).path)
    if cached.is_file():
        return cached
    if hub_offline():
        raise ConfigError(f"{name}: pretrained=True needs the released weights {url}: HF_HUB_OFFLINE is set and "
                          f"{cached} does not exist; download the file there {local_route(name)}")
    try:
        return Path(download_cached_file(url, check_hash=False, progress=True, cache_dir=cache_dir))
    except (OSError, ValueError, RuntimeError) as err:
        raise ConfigError(f"{name}: pretrained=True could not download the released weights {url} "
                          f"({str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__}); "
                          f"put the file at {cached} {local_route(name)}") from None
