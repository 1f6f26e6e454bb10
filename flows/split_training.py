"""The `split-training` flow: plan -> preprocess (cached, fanned out) -> train -> publish.

Run it locally with `python -m splitstage.demo`, or as the `split-training/local` and
`split-training/nightly` deployments (deployments/prefect.yaml). Its parameter `config` is the job
config model, so the Prefect UI shows the whole job as a form.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.deployments import run_deployment
from prefect.states import Cancelled

from splitstage.config.job import SplitstageConfig
from splitstage.flows.artifacts import publish_plan, publish_summary
from splitstage.flows.cancel import stop_training
from splitstage.flows.preprocess_flow import FanOut, preprocess_planned
from splitstage.flows.task_wrappers import plan_job
from splitstage.flows.train_flow import REPORT_FILE, train_flow
from splitstage.flows.versioned_outputs import current_version, run_id_for
from splitstage.tasks.stage2.outputs import open_output


@contextlib.contextmanager
def timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    """Add the wall time of the block to `seconds[stage]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started


def train_on_deployment(
    config: SplitstageConfig,
    deployment: str,
    version: str | None,
    warm: bool,
    timeout_s: float | None,
) -> dict[str, Any]:
    """Run stage 2 as a run of `deployment` (e.g. train/multinode); read back its report file."""
    run = run_deployment(
        deployment,
        parameters={
            "config": config.model_dump(mode="json"),
            "version": version,
            "versioned": version is not None,
            "warm_start_from_latest": warm,
            "timeout_s": timeout_s,
        },
        timeout=None,
    )
    if not run.state.is_completed():
        raise RuntimeError(
            f"training run {run.name} of {deployment} ended {run.state.name}: {run.state.message}"
        )
    url = f"{config.output.url.rstrip('/')}/{run_id_for(config, version)}/{REPORT_FILE}"
    fs, path = open_output(config, url)
    return json.loads(fs.cat_file(path))


def summarize(
    config: SplitstageConfig, cache: dict[str, Any], trained: dict[str, Any], seconds: dict
) -> dict[str, Any]:
    """The run's summary: where the weights are, the loss, the cache figures, time per stage."""
    losses = trained.get("losses") or []
    return {
        "job": config.job.name,
        "version": trained.get("version"),
        "output_url": trained["output_url"],
        "weights": trained.get("outputs", {}),
        "sample_grids": trained.get("samples", {}),  # update -> validation grid URL
        "sample_grids_by_size": trained.get("grids", {}),  # update -> every size's grid URL
        "latest": trained.get("latest"),
        "report_url": trained.get("report_url"),
        "warm_start_from": trained.get("warm_start_from"),
        "updates": trained.get("updates", 0),
        "final_loss": losses[-1] if losses else None,
        "cache_url": cache["cache_url"],
        "cache_key": cache["cache_key"],
        "samples": cache["samples"],
        "samples_new": cache["computed"],
        "samples_reused": cache["reused"],
        "samples_skipped": cache["skipped"],
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


@flow(
    name="split-training",
    on_cancellation=[stop_training],
    on_crashed=[stop_training],
)
def split_training(
    config: SplitstageConfig,
    shards: int | None = None,
    fan_out: FanOut = "local",
    versioned: bool = True,
    warm_start_from_latest: bool = False,
    train_timeout_s: float | None = None,
    train_deployment: str | None = None,
) -> dict[str, Any]:
    """Two-stage split training end to end: plan, preprocess, train, publish the outputs.

    `shards` (default `preprocess.workers`) and `fan_out` ('local' tasks, or one run of
    `preprocess/gpu` per shard) shape stage 1. `versioned` writes the weights under
    `<output.url>/<job.name>/<version>/` and moves `latest.json`; `warm_start_from_latest` starts
    fully trained models from that run. `train_deployment` (e.g. 'train/multinode') runs stage 2
    as a run of that deployment instead of in this process.
    """
    logger = get_run_logger()
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    version = current_version() if versioned else None
    with timed(seconds, "plan"):
        plan = plan_job(config)
        publish_plan(plan)
    with timed(seconds, "preprocess"):  # on the plan above: the flow plans once
        num_shards = shards or config.preprocess.workers
        cache = preprocess_planned(plan, num_shards, fan_out)
    with timed(seconds, "train"):
        if train_deployment:
            trained = train_on_deployment(
                config, train_deployment, version, warm_start_from_latest, train_timeout_s
            )
        else:
            state = train_flow(
                config,
                version=version,
                versioned=versioned,
                warm_start_from_latest=warm_start_from_latest,
                timeout_s=train_timeout_s,
                return_state=True,
            )
            if state.is_cancelled():
                return Cancelled(message=f"split training of {config.job.name} cancelled")
            trained = state.result()
    seconds["total"] = time.perf_counter() - started
    summary = summarize(config, cache, trained, seconds)
    publish_summary(config, summary)
    logger.info(f"weights: {summary['weights']}; latest: {summary['latest']}")
    return summary
