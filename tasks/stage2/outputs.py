"""Where a job's outputs go: run paths, and the one way to open the output filesystem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitstage.config.job import SplitstageConfig
from splitstage.storage.files import open_fs
from splitstage.storage.options import name_block
from splitstage.storage.urls import local_path, scheme_of

LEASE_NAME = "LEASE.json"  # in each leased place: who holds the run (tasks/stage2/lease.py)
ERROR_FILE = "error.json"  # in a run folder: a rank's one-line reason for stopping on bad input


def output_storage_options(config: SplitstageConfig, url: str) -> dict[str, Any] | None:
    """Options for an output or checkpoint URL: object storage connects as the cache does, with
    its endpoint options and, on the cache's object store (same scheme), its credentials block;
    else credentials come from the environment. Local paths need none.

    The block is only named (`name_block`): its secrets are read where the URL is opened (the
    launcher, each training rank), so these options may go into the run spec."""
    scheme = scheme_of(url)
    if scheme in ("file", "memory"):
        return None
    cache = config.cache
    block = cache.credentials_block if scheme == scheme_of(cache.url) else None
    options = name_block(cache.storage_options, block, field="cache.credentials_block")
    return options or None


def open_output(config: SplitstageConfig, url: str) -> tuple[Any, str]:
    """(filesystem, path) of an output URL of this job."""
    return open_fs(url, output_storage_options(config, url))


def run_paths(config: SplitstageConfig, run_id: str, run_root: str | Path = "runs/train") -> dict:
    """Where a run writes: local run dir (spec, metrics), output URL, checkpoint URL, and the
    storage options of both, resolved once here (the launcher's checks, leases and the spec
    the ranks read all take them from this dict)."""
    output = f"{config.output.url.rstrip('/')}/{run_id}"
    checkpoints = config.train.checkpoint_url or f"{output}/checkpoints"
    return {
        "run_dir": str(Path(run_root) / run_id),
        "output_url": output,
        "checkpoint_url": checkpoints,
        "output_storage_options": output_storage_options(config, output),
        "checkpoint_storage_options": output_storage_options(config, checkpoints),
    }


URL_KEYS = ("output_url", "checkpoint_url")  # the run's places, as a report names them


def leased_places(paths: dict) -> list[str]:
    """The run_paths keys a run holds a lease on: its output folder, and a checkpoint URL
    outside it."""
    keys = ["output_url"]
    if not paths["checkpoint_url"].startswith(paths["output_url"].rstrip("/") + "/"):
        keys.append("checkpoint_url")
    return keys


def deleted_place(paths: dict, lease_held_here: bool = True) -> str | None:
    """The run's local output or checkpoint folder, if it was deleted while the run wrote to
    it: the folder is gone, or (where this node's launcher holds the lease, so its file must be
    there) its lease file is (writers such as TensorBoard's may have made the folder again).
    Another node's lease may be released when that node stops: only the folder counts there."""
    for key in leased_places(paths):
        url = paths[key]
        if scheme_of(url) != "file":
            continue
        folder = Path(local_path(url))
        if not folder.is_dir() or (lease_held_here and not (folder / LEASE_NAME).exists()):
            return url
    return None


def options_for(paths: dict, url_key: str) -> dict[str, Any] | None:
    """The resolved storage options of `paths[url_key]` (run_paths' `<x>_storage_options`)."""
    return paths[url_key.replace("_url", "_storage_options")]
