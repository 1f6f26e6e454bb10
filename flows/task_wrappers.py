"""Thin Prefect @task wrappers around the plain stage functions: names, timeouts, I/O-only retries.

The work lives in `tasks.job_plan`, `tasks.stage1` and `tasks.stage2` and runs without Prefect;
this module only gives each call a task run in the UI. Retries happen for transient I/O failures
(an unreachable endpoint, a dropped connection, a timeout), never for bad input or bugs: retrying
a wrong config only repeats its error. Nothing is cached by Prefect (`NO_CACHE`): the stage-1 cache
is content-addressed already, and training resumes from its own checkpoints.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from splitstage.config.job import SplitstageConfig
from splitstage.data.index import DataIndex, Shown, index_data_set
from splitstage.flows.artifacts import Progress, artifact_key
from splitstage.splitter import UserError
from splitstage.storage.files import StorageUnreachableError
from splitstage.tasks.cache.validation_prompts import write_validation_prompts
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.launch.launcher import TrainReport, train
from splitstage.tasks.stage1.preprocess import (
    CacheSnapshot,
    PreprocessReport,
    ShardReport,
    all_cached,
    preprocess_shard,
    snapshot,
    summarize_preprocess,
)

IO_RETRIES = 2
IO_RETRY_DELAYS = [2.0, 10.0]
# OSErrors that name a wrong path or a refused permission: retrying cannot fix them.
_PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def is_transient_io_error(exc: BaseException | None) -> bool:
    """True for I/O failures worth retrying: connection, timeout, unreachable storage."""
    if isinstance(exc, StorageUnreachableError | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, (UserError, *_PERMANENT_OS_ERRORS)):
        return False
    return isinstance(exc, OSError)


def retry_on_io(task_: object, task_run: TaskRun, state: State) -> bool:
    """Prefect `retry_condition_fn`: retry a failed task run only for transient I/O errors."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:  # an unreadable result is no reason to retry
            return False
    return is_transient_io_error(exc if isinstance(exc, BaseException) else None)


def _io_task(name: str, timeout_seconds: float | None, **options):
    """A task with this module's defaults: no Prefect caching, retries only on transient I/O."""
    return task(
        name=name,
        cache_policy=NO_CACHE,
        retries=IO_RETRIES,
        retry_delay_seconds=IO_RETRY_DELAYS,
        retry_condition_fn=retry_on_io,
        timeout_seconds=timeout_seconds,
        **options,
    )


@_io_task("plan", timeout_seconds=600)
def plan_job(config: SplitstageConfig) -> JobPlan:
    """Split the pipeline for the trainable models and derive the cache key (hashes weights)."""
    plan = make_plan(config)
    _ = plan.cache_key  # computed here so its file reads are retried and timed as this task
    return plan


@_io_task("index-data-set", timeout_seconds=1800)
def index_data(config: SplitstageConfig) -> DataIndex:
    """Read the metadata and content-hash every sample (the sample keys); images that must be
    read and hashed show as a progress artifact (none when the memos know every one)."""
    progress: Progress | None = None

    def report(done: int, total: int) -> None:
        nonlocal progress
        if progress is None:
            key = artifact_key(config, "index-progress")
            progress = Progress(key, f"Hashing {total} images of the data set", log_as="hashed")
        progress.set(done, total, force=done >= total)

    return index_data_set(config, shown=Shown(bar=False, report=report))


@_io_task("read-cache-index", timeout_seconds=600)
def snapshot_cache(plan: JobPlan) -> CacheSnapshot:
    """Read the cache index once: what preprocessing will reuse, and the figures to diff later."""
    return snapshot(plan.cache)  # the process's one store: the shards and the summary use it


@_io_task("check-cache", timeout_seconds=1800)
def check_cache(plan: JobPlan, data: DataIndex) -> ShardReport | None:
    """The run's report when nothing is to compute (every sample cached intact, shards modified
    after their index entry re-read, or recorded undecodable); None when shards must run."""
    return all_cached(plan, data, prompts=False)  # the flow encodes prompts itself


@_io_task(
    "preprocess-shard",
    timeout_seconds=None,
    task_run_name="preprocess-shard-{shard}-of-{num_shards}",
)
def preprocess_shard_task(
    config: SplitstageConfig,
    shard: int,
    num_shards: int,
    plan: JobPlan | None = None,
    data: DataIndex | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ShardReport:
    """Compute and cache the V2 outputs of one shard's samples that are not cached yet."""
    return preprocess_shard(
        config, shard, num_shards, plan=plan, data=data, progress=False, on_progress=on_progress
    )


@_io_task("encode-validation-prompts", timeout_seconds=1800)
def validation_prompts_task(plan: JobPlan) -> str | None:
    """Encode the [validation] prompts beside the cache unless shard 0 already did."""
    return write_validation_prompts(plan)


@_io_task("finish-preprocess", timeout_seconds=1800)
def finish_preprocess(
    plan: JobPlan,
    data: DataIndex,
    reports: list[ShardReport] | None,
    before: CacheSnapshot,
    workers: int,
    started: float,
) -> PreprocessReport:
    """Verify the cache holds every sample, write its manifest and report what was done."""
    result = summarize_preprocess(plan, data, reports, before, workers)
    result.seconds = time.perf_counter() - started
    return result


@_io_task("train", timeout_seconds=None)
def train_task(
    config: SplitstageConfig,
    run_id: str,
    on_line: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    timeout: float | None = None,
    node_rank: int = 0,
) -> TrainReport:
    """Run stage 2 under torchrun (resuming from the run's latest checkpoint) and report."""
    try:
        return train(
            config,
            run_id=run_id,
            node_rank=node_rank,
            on_line=on_line,
            cancel=cancel,
            timeout=timeout,
        )
    except BaseException:
        if cancel is not None:
            cancel.set()  # anything that ends this task early also ends the process tree
        raise
