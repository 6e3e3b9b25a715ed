"""Where metrics go: ``metrics.csv`` always, plus wandb (``logger=wandb``).

``logger=csv`` writes every logged training step and every epoch; ``logger=none`` writes only the epoch rows. Rank 0
alone logs."""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import netrc
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from moh_vision.checkpoints import atomic_write
from moh_vision.errors import RunError, storage_problem

log = logging.getLogger(__name__)


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class CSVMetrics:
    """Wide CSV: one row per log call, columns grow as new keys appear (the file is rewritten then)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.columns: List[str] = []
        self.rows: List[Dict[str, Any]] = []
        if self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                self.rows = list(reader)

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (they are replayed when a run resumes from that step)."""
        kept = [r for r in self.rows if r.get("step") in (None, "") or int(float(r["step"])) <= step]
        if len(kept) != len(self.rows):
            self.rows = kept
            self._rewrite()

    def log(self, row: Dict[str, Any]) -> None:
        row = {k: _plain(v) for k, v in row.items()}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            self._rewrite()
        else:
            self._append(row)

    def _append(self, row: Dict[str, Any]) -> None:
        """One row, whole or not at all: a write that fails (disk full) is cut off again."""
        text = io.StringIO()
        csv.DictWriter(text, fieldnames=self.columns).writerow(row)
        with open(self.path, "ab") as f:
            end = f.tell()
            try:
                f.write(text.getvalue().encode())
                f.flush()
            except OSError as err:
                f.truncate(end)
                raise RunError(f"could not write metrics file {self.path} ({storage_problem(err)}); "
                               f"its rows so far are intact") from err

    def _rewrite(self) -> None:
        text = io.StringIO()
        w = csv.DictWriter(text, fieldnames=self.columns)
        w.writeheader()
        w.writerows(self.rows)
        atomic_write(self.path, lambda f: f.write(text.getvalue().encode()), what="metrics file")


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return auth is not None


class WandbLogger:
    """A wandb run that works with no network: online with credentials, offline otherwise."""

    def __init__(self, out_dir: Path, config: Dict[str, Any], project: str = "moh-vision", entity: Optional[str] = None,
                 group: Optional[str] = None, name: Optional[str] = None, job_type: str = "train",
                 tags: Optional[List[str]] = None, mode: str = "auto", run_id: Optional[str] = None):
        import wandb
        if mode == "auto":
            mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_credentials() else "offline")
        self.mode = mode
        self.run = wandb.init(project=project, entity=entity, group=group, name=name, job_type=job_type,
                              tags=list(tags or []), config=config, dir=str(out_dir), mode=mode,
                              id=run_id, resume="allow" if run_id else None, reinit="finish_previous")
        self.run_id = getattr(self.run, "id", None)
        if mode == "offline":
            log.info("wandb is offline (no credentials or WANDB_MODE=offline); sync later with: wandb sync %s",
                     Path(self.run.dir).parent if self.run is not None else out_dir)

    def log(self, row: Dict[str, Any], step: Optional[int] = None) -> None:
        self.run.log({k: v for k, v in row.items() if k not in ("step",)}, step=step)

    def log_image(self, key: str, path: Path, step: Optional[int] = None, caption: str = "") -> None:
        import wandb
        self.run.log({key: wandb.Image(str(path), caption=caption)}, step=step)

    def summary(self, values: Dict[str, Any]) -> None:
        for k, v in values.items():
            self.run.summary[k] = _plain(v)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


class Loggers:
    """Fan-out to the CSV file and (optionally) wandb; a no-op on ranks other than 0."""

    def __init__(self, out_dir: Path, kind: str = "csv", enabled: bool = True, wandb_options: Optional[dict] = None,
                 config: Optional[dict] = None, run_id: Optional[str] = None, job_type: str = "train"):
        if kind not in ("csv", "wandb", "none"):
            from moh_vision.errors import ConfigError
            raise ConfigError(f"logger={kind} is unknown; available: csv, wandb, none")
        self.enabled, self.kind = enabled, kind
        self.csv = CSVMetrics(Path(out_dir) / "metrics.csv") if enabled else None
        self.wandb = None
        if enabled and kind == "wandb":
            self.wandb = WandbLogger(Path(out_dir), config or {}, job_type=job_type, run_id=run_id,
                                     **(wandb_options or {}))

    @property
    def run_id(self) -> Optional[str]:
        return self.wandb.run_id if self.wandb else None

    def log_step(self, row: Dict[str, Any], step: int) -> None:
        """Per-step training row, written as an epoch row is (skipped by ``logger=none``)."""
        if self.kind != "none":
            self.log_epoch(row, step)

    def log_epoch(self, row: Dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        self.csv.log({"step": step, **row})
        if self.wandb:
            self.wandb.log(row, step=step)

    def log_image(self, key: str, path: Path, step: int, caption: str = "") -> None:
        if self.enabled and self.wandb:
            self.wandb.log_image(key, path, step=step, caption=caption)

    def truncate_after(self, step: int) -> None:
        if self.enabled:
            self.csv.truncate_after(step)

    def finish(self, summary: Optional[Dict[str, Any]] = None, exit_code: int = 0) -> None:
        if self.enabled and self.wandb:
            if summary:
                self.wandb.summary(summary)
            self.wandb.finish(exit_code)


def write_json(path: Path, data: Dict[str, Any]) -> None:
    text = json.dumps({k: _plain(v) for k, v in data.items()}, indent=2, sort_keys=True, default=str)
    atomic_write(path, lambda f: f.write(text.encode()), what="file")
