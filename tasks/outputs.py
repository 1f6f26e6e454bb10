"""Where a job's outputs go: run paths, and the one way to open the output filesystem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitstage.pipelines.config import SplitstageConfig
from splitstage.tasks.cache.storage import open_fs

ERROR_FILE = "error.json"  # in a run folder: a rank's one-line reason for stopping on bad input


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def output_storage_options(config: SplitstageConfig, url: str) -> dict[str, Any] | None:
    """Options for an output or checkpoint URL: object storage uses the cache's endpoint options
    (never secrets: credentials come from the environment); local paths need none."""
    if _scheme(url) in ("file", "memory"):
        return None
    return dict(config.cache.storage_options) or None


def open_output(config: SplitstageConfig, url: str) -> tuple[Any, str]:
    """(filesystem, path) of an output URL of this job."""
    return open_fs(url, output_storage_options(config, url))


def run_paths(config: SplitstageConfig, run_id: str, run_root: str | Path = "runs/train") -> dict:
    """Where a run writes: local run dir (spec, metrics), output URL, checkpoint URL."""
    output = f"{config.output.url.rstrip('/')}/{run_id}"
    checkpoints = config.train.checkpoint_url or f"{output}/checkpoints"
    return {
        "run_dir": str(Path(run_root) / run_id),
        "output_url": output,
        "checkpoint_url": checkpoints,
    }
