"""The `preprocess` flow: stage 1 over the data set, fanned out over shards, incremental.

Samples are content-addressed, so only samples the cache does not hold yet are computed. Shards
run as local tasks (threads in this process, the default) or, in production, as runs of the
`preprocess/gpu` deployment, one per shard, on a GPU work pool whose concurrency is its GPU count.
A run given `shard=i` is one such shard: it only computes and commits its samples. Shard runs
on other machines must reach the data set and the cache (shared storage or S3).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Literal

from prefect import flow, get_client, get_run_logger
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.data.index import DataIndex
from splitstage.flows.artifacts import (
    Progress,
    artifact_key,
    cache_groups,
    is_top_level_run,
    publish_cache_stats,
    publish_plan,
)
from splitstage.flows.task_wrappers import (
    check_cache,
    finish_preprocess,
    index_data,
    plan_job,
    preprocess_shard_task,
    snapshot_cache,
    validation_prompts_task,
)
from splitstage.pipelines.distill_rows import check_rows
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage1.preprocess import ShardReport, start_preprocess

FanOut = Literal["local", "deployment"]
SHARD_DEPLOYMENT = "preprocess/gpu"
POLL_SECONDS = 2.0


def run_local_shards(
    plan: JobPlan, data: DataIndex, num_shards: int, new: int
) -> list[ShardReport]:
    """One task per shard, run concurrently in this process; one progress artifact for all."""
    config = plan.config
    progress = Progress(
        artifact_key(config, "preprocess-progress"),
        f"Preprocessing {new} new samples on {num_shards} local shard(s)",
        log_as="preprocessed",
    )
    done = [0] * num_shards

    def tracker(shard: int):
        def on_progress(count: int, _total: int) -> None:
            done[shard] = count
            progress.set(sum(done), new)

        return on_progress

    futures = [
        preprocess_shard_task.submit(
            config, i, num_shards, plan=plan, data=data, on_progress=tracker(i)
        )
        for i in range(num_shards)
    ]
    reports = [future.result() for future in futures]
    progress.finish()
    return reports


def run_deployment_shards(config: SplitstageConfig, num_shards: int, deployment: str) -> None:
    """One run of `deployment` per shard (all submitted at once); wait for all, fail if any did."""
    logger = get_run_logger()
    progress = Progress(
        artifact_key(config, "preprocess-progress"),
        f"Preprocessing on {num_shards} runs of {deployment}",
    )
    params = {"config": config.model_dump(mode="json"), "shards": num_shards}
    try:
        runs = [
            run_deployment(
                deployment,
                parameters={**params, "shard": i},
                timeout=0,
                flow_run_name=f"{config.job.name}-shard-{i}-of-{num_shards}",
            )
            for i in range(num_shards)
        ]
    except ObjectNotFound:
        raise ConfigError(
            f"deployment '{deployment}' does not exist; register deployments/prefect.yaml "
            "(`infra/stack.sh up` or `prefect --no-prompt deploy --all`) or use fan_out='local'"
        ) from None
    logger.info(f"submitted {num_shards} shard runs to {deployment}")
    finished: dict[Any, Any] = {}
    with get_client(sync_client=True) as client:
        while len(finished) < len(runs):
            time.sleep(POLL_SECONDS)
            for run in runs:
                if run.id not in finished:
                    current = client.read_flow_run(run.id)
                    if current.state is not None and current.state.is_final():
                        finished[run.id] = current
            progress.set(len(finished), len(runs))
    failed = [r for r in finished.values() if not r.state.is_completed()]
    if failed:
        names = ", ".join(f"{r.name} ({r.state.name}: {r.state.message})" for r in failed)
        raise RuntimeError(
            f"{len(failed)} of {num_shards} preprocessing shard runs did not complete: {names}; "
            "see their logs, then rerun (only samples still missing are computed)"
        )
    progress.finish()


@flow(name="preprocess")
def preprocess_flow(
    config: SplitstageConfig,
    shards: int | None = None,
    fan_out: FanOut = "local",
    shard: int | None = None,
    deployment: str = SHARD_DEPLOYMENT,
) -> dict[str, Any]:
    """Stage 1: cache the V2 outputs of every sample not cached yet, one task or run per shard.

    `shards` defaults to `preprocess.workers`; `fan_out='deployment'` runs each shard as a run of
    `deployment`; `shard=i` makes this run that one shard.
    """
    num_shards = shards or config.preprocess.workers
    if shard is not None:
        return asdict(preprocess_shard_task(config, shard, num_shards))
    plan = plan_job(config)
    if is_top_level_run():
        publish_plan(plan)
    return preprocess_planned(plan, num_shards, fan_out, deployment)


def preprocess_planned(
    plan: JobPlan, num_shards: int, fan_out: FanOut = "local", deployment: str = SHARD_DEPLOYMENT
) -> dict[str, Any]:
    """The preprocess flow's body for a job planned already (the split-training flow plans
    once and hands its plan here): index, check, run the shards, encode the prompts, sum up."""
    config = plan.config
    logger = get_run_logger()
    started = time.perf_counter()
    swept = start_preprocess(plan)  # refusals, an unwritable cache, an interrupted run's files
    data = index_data(config)
    check_rows(config, data.rows)  # the task's row values, before any shard loads a model
    before = snapshot_cache(plan)
    new = len(set(data.keys) - before.keys)
    logger.info(
        f"{len(data.keys)} samples: {new} new, {len(data.keys) - new} cached in "
        f"{config.cache.url} ({plan.cache_key}); {num_shards} shard(s), {fan_out}"
    )
    reports = None  # without shard reports the figures come from the cache index
    cached = check_cache(plan, data)  # None: samples to compute or damage to repair
    workers = 0 if cached else num_shards
    if cached:
        reports = [cached]
    elif fan_out == "deployment":
        run_deployment_shards(config, num_shards, deployment)
    else:
        reports = run_local_shards(plan, data, num_shards, new)
    prompts = validation_prompts_task(plan)  # shard 0 did it, unless no shard ran
    report = finish_preprocess(plan, data, reports, before, workers, started)
    report.validation_prompts = prompts
    report.temp_files_removed, report.bytes_reclaimed = swept
    publish_cache_stats(config, report, cache_groups(plan.cache))
    for warning in report.skipped_lines():
        logger.warning(warning)
    logger.info(report.line())
    return report.to_dict()
