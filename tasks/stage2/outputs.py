"""Where a job's outputs go: a run's places (typed), whether they can be written, and the one way
to open the output filesystem."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.storage.files import StorageError, join, open_fs, write_atomic
from splitstage.storage.options import name_block
from splitstage.storage.urls import local_path, scheme_of

ERROR_FILE = "error.json"  # in a run folder: a rank's one-line reason for stopping on bad input
SET_UP = "set-up"  # error.json's phase for a refusal before training: the launcher raises it again

UrlKey = Literal["output_url", "checkpoint_url"]
URL_KEYS: tuple[UrlKey, ...] = ("output_url", "checkpoint_url")  # as a report names them
URL_FIELDS: dict[UrlKey, str] = {
    "output_url": "output.url",
    "checkpoint_url": "train.checkpoint_url",
}


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


class RunPlaces(BaseModel):
    """Where a run writes: the local run folder (spec, metrics, result), the output and
    checkpoint URLs and their storage options, resolved once (`run_places`) and handed down."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str
    output_url: str
    checkpoint_url: str
    output_storage_options: dict[str, Any] | None = None
    checkpoint_storage_options: dict[str, Any] | None = None

    def url(self, key: UrlKey) -> str:
        """The output or checkpoint URL."""
        return self.output_url if key == "output_url" else self.checkpoint_url

    def options(self, key: UrlKey) -> dict[str, Any] | None:
        """The resolved storage options of the output or checkpoint URL."""
        if key == "output_url":
            return self.output_storage_options
        return self.checkpoint_storage_options

    def leased(self) -> list[UrlKey]:
        """The places a run holds a lease on: its output folder, and a checkpoint URL outside
        it."""
        keys: list[UrlKey] = ["output_url"]
        if not self.checkpoint_url.startswith(self.output_url.rstrip("/") + "/"):
            keys.append("checkpoint_url")
        return keys

    def deleted(self, lease_held_here: bool = True) -> str | None:
        """The run's local output or checkpoint folder, if it was deleted while the run wrote
        to it: the folder is gone, or (where this node's launcher holds the lease, so its file
        must be there) its lease file is (writers such as TensorBoard's may have made the
        folder again). Another node's lease may be released when that node stops: only the
        folder counts there."""
        from splitstage.storage.lease import LEASE_NAME  # filelock, psutil: not for `validate`

        for key in self.leased():
            url = self.url(key)
            if scheme_of(url) != "file":
                continue
            folder = Path(local_path(url))
            if not folder.is_dir() or (lease_held_here and not (folder / LEASE_NAME).exists()):
                return url
        return None

    def urls(self) -> dict[str, str]:
        """Output and checkpoint URLs, as a report names them."""
        return {key: self.url(key) for key in URL_KEYS}


def run_places(
    config: SplitstageConfig, run_id: str, run_root: str | Path = "runs/train"
) -> RunPlaces:
    """Where run `run_id` writes, with the storage options of both URLs resolved once here (the
    launcher's checks and leases and the spec the ranks read all take them from it)."""
    output = f"{config.output.url.rstrip('/')}/{run_id}"
    checkpoints = config.train.checkpoint_url or f"{output}/checkpoints"
    return RunPlaces(
        run_dir=str(Path(run_root) / run_id),
        output_url=output,
        checkpoint_url=checkpoints,
        output_storage_options=output_storage_options(config, output),
        checkpoint_storage_options=output_storage_options(config, checkpoints),
    )


def check_outputs(places: RunPlaces) -> None:
    """Outputs, checkpoints and the scratch folder can be written by the training processes
    (the launcher checks this before it holds the run)."""
    for key, field_name in URL_FIELDS.items():
        url = places.url(key)
        if url.startswith("memory://"):
            raise ConfigError(
                f"{field_name}: memory:// would keep the run's files inside the training "
                "processes, lost when they end; use a local folder or object storage"
            )
        probe_writable(url, field_name, places.options(key))
    scratch = Path(places.run_dir)
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        probe = scratch / f".write-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"train.scratch_dir: cannot write the run folder {scratch} ({error.strerror}); "
            "point train.scratch_dir at a writable folder"
        ) from None


def probe_writable(url: str, field_name: str, options: dict[str, Any] | None) -> None:
    """Write and delete a probe object under `url` (opened with its resolved `options`): a
    read-only target fails now, not later."""
    fs, root = open_fs(url, options)
    probe = join(root, f".write-probe-{uuid.uuid4().hex}")
    try:
        if "://" not in url or url.startswith("file://"):
            os.makedirs(root, exist_ok=True)
        write_atomic(fs, probe, b"")
        fs.rm(probe)
    except StorageError as error:
        raise ConfigError(f"{field_name}: {error}") from None
    except OSError as error:
        raise ConfigError(
            f"{field_name}: cannot write under {url} ({error.strerror or error}); make it "
            "writable or point the field at a writable folder or bucket"
        ) from None


def record_rank_error(run_dir: str, record: dict[str, Any]) -> None:
    """Leave a rank's reason for stopping in the run folder for the launcher (`ERROR_FILE`,
    JSON); the first rank to write wins, later ones leave it as it is."""
    import json

    try:
        fd = os.open(Path(run_dir) / ERROR_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
