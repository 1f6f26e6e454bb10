"""Versioned outputs: each run writes `<output.url>/<job.name>/<version>/`, then `latest.json`.

A version is `<UTC start time>-<flow run id prefix>` (sortable, unique, and the same when Prefect
retries the flow run, so a retried run resumes its own checkpoints instead of starting over).
`latest.json` is written after the weights, atomically, so a reader never sees a pointer to weights
that are not there yet.
"""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from typing import Any

from prefect.context import FlowRunContext

from splitstage.config.job import ModelConfig, SplitstageConfig
from splitstage.storage.files import join, write_atomic
from splitstage.tasks.launch.launcher import TrainReport
from splitstage.tasks.stage2.outputs import open_output

LATEST = "latest.json"
POINTER_FORMAT = 1


def version_for(flow_run: Any | None) -> str:
    """`20260101T020000Z-1a2b3c4d` from a flow run (its creation time and id), else now + random."""
    if flow_run is not None and getattr(flow_run, "id", None):
        created = getattr(flow_run, "created", None) or datetime.now(UTC)
        return f"{created.astimezone(UTC):%Y%m%dT%H%M%SZ}-{str(flow_run.id)[:8]}"
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


def current_version() -> str:
    """The version of the flow run this code runs in."""
    context = FlowRunContext.get()
    return version_for(context.flow_run if context else None)


def run_id_for(config: SplitstageConfig, version: str | None) -> str:
    """The training run id: `<job.name>/<version>`, or `<job.name>` for an unversioned run."""
    return f"{config.job.name}/{version}" if version else config.job.name


def job_url(config: SplitstageConfig) -> str:
    """`<output.url>/<job.name>`: the folder holding every version and the latest pointer."""
    return f"{config.output.url.rstrip('/')}/{config.job.name}"


def _output_fs(config: SplitstageConfig):
    """The job folder's filesystem and path."""
    return open_output(config, job_url(config))


def write_latest(
    config: SplitstageConfig, version: str, report: TrainReport, extra: dict[str, Any]
) -> str:
    """Point `<job>/latest.json` at this run's weights (call after they are written); its URL."""
    pointer = {
        "format": POINTER_FORMAT,
        "job": config.job.name,
        "version": version,
        "output_url": report.output_url,
        "weights": report.outputs,
        "updates": report.updates,
        "final_loss": report.losses[-1] if report.losses else None,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **extra,
    }
    fs, root = _output_fs(config)
    write_atomic(fs, join(root, LATEST), json.dumps(pointer, indent=2).encode())
    return f"{job_url(config)}/{LATEST}"


def read_latest(config: SplitstageConfig) -> dict[str, Any] | None:
    """The job's latest pointer, or None before the first versioned run."""
    fs, root = _output_fs(config)
    path = join(root, LATEST)
    if not fs.exists(path):
        return None
    return json.loads(fs.cat_file(path))


def warm_start(config: SplitstageConfig) -> tuple[SplitstageConfig, str | None]:
    """The config with the trained models' weights taken from the latest run, and that run's URL.

    Supported for models trained in full that load from weight files, with the previous weights
    on local disk. Otherwise (a first run, LoRA: stage 2 cannot load adapters yet, a builder model
    such as the MiniLM text encoder, weights in object storage) the config is returned unchanged
    with None.
    """
    latest = read_latest(config)
    if latest is None or config.trainable.lora_base_model:
        return config, None
    weights = latest.get("weights") or {}
    models = dict(config.models)
    for name in config.trainable.full:
        path = weights.get(name)
        source = config.models.get(name)
        if not path or "://" in path or source is None or source.builder:
            return config, None
        models[name] = ModelConfig(weights=path, key_prefix=export_prefix(config, name))
    updated = config.model_copy(update={"models": models})
    return SplitstageConfig.model_validate(updated.model_dump()), latest["output_url"]


def export_prefix(config: SplitstageConfig, model: str) -> str:
    """The key prefix exported weights carry: `pipe.<model>.` minus `remove_prefix_in_ckpt`."""
    full = f"pipe.{model}."
    remove = config.output.remove_prefix_in_ckpt
    return full[len(remove) :] if remove and full.startswith(remove) else full
