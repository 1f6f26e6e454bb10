"""Thin Prefect @task wrappers around the plain stage functions: names, timeouts, I/O-only retries.

The work lives in `tasks.job_plan`, `tasks.preprocess` and `tasks.train` and runs without Prefect;
this module only gives each call a task run in the UI. Retries happen for transient I/O failures
(an unreachable endpoint, a dropped connection, a timeout), never for bad input or bugs: retrying
a wrong config only repeats its error. Nothing is cached by Prefect (`NO_CACHE`): the stage-1 cache
is content-addressed already, and training resumes from its own checkpoints.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from pipelines.config import SplitstageConfig
from splitter import UserError
from tasks.job_plan import JobPlan, make_plan
from tasks.preprocess import (
    DataIndex,
    PreprocessReport,
    ShardReport,
    index_data_set,
    open_cache,
    preprocess_shard,
)
from tasks.storage import StorageUnreachableError
from tasks.train import TrainReport, train

_import_lock = threading.Lock()
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


def warm_lazy_imports() -> None:
    """Import transformers' Auto classes once, under a lock, before shards load models in threads.

    transformers resolves them lazily, and two threads doing the first import at once fail with
    "ImportError: cannot import name 'AutoModel' from 'transformers'".
    """
    with _import_lock, contextlib.suppress(ImportError):
        from transformers import AutoModel, AutoTokenizer  # noqa: F401


@_io_task("plan", timeout_seconds=600)
def plan_job(config: SplitstageConfig) -> JobPlan:
    """Split the pipeline for the trainable models and derive the cache key (hashes weights)."""
    plan = make_plan(config)
    _ = plan.cache_key  # computed here so its file reads are retried and timed as this task
    return plan


@_io_task("index-data-set", timeout_seconds=1800)
def index_data(config: SplitstageConfig) -> DataIndex:
    """Read the metadata and content-hash every sample (the sample keys)."""
    return index_data_set(config)


@dataclass(frozen=True)
class CacheSnapshot:
    """What a job's cache holds at one moment: committed sample keys, shard files, bytes."""

    keys: frozenset[str]
    shards: int
    bytes: int


@_io_task("read-cache-index", timeout_seconds=600)
def snapshot_cache(config: SplitstageConfig, plan: JobPlan) -> CacheSnapshot:
    """Read the cache index once: what preprocessing will reuse, and the figures to diff later."""
    store = open_cache(config, plan)
    stats = store.stats()
    return CacheSnapshot(frozenset(store.committed_keys()), stats.shards, stats.bytes)


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
    warm_lazy_imports()
    return preprocess_shard(
        config, shard, num_shards, plan=plan, data=data, progress=False, on_progress=on_progress
    )


def summarize_preprocess(
    config: SplitstageConfig,
    plan: JobPlan,
    data: DataIndex,
    reports: Iterable[ShardReport] | None,
    before: CacheSnapshot,
    workers: int,
) -> PreprocessReport:
    """Check every sample is committed, write the cache manifest, and sum up what was done.

    With shard reports (local fan-out) the figures are the workers' own; without them (shards ran
    as other flow runs elsewhere) they come from the cache: what got committed since `before`.
    """
    store = open_cache(config, plan)
    committed = store.committed_keys()
    missing = set(data.keys) - committed
    if missing:
        raise RuntimeError(
            f"preprocessing finished but {len(missing)} of {len(data.keys)} samples are not in "
            f"the cache {store.url}; rerun it (only the missing samples are computed) and check "
            "the shard runs' logs"
        )
    keys = set(data.keys)
    result = PreprocessReport(
        cache_key=plan.cache_key,
        cache_url=store.url,
        samples=len(keys),
        duplicates=data.duplicates,
        workers=workers,
        skipped_rows=data.skipped,
    )
    if reports is not None:
        reports = list(reports)
        result.computed = sum(r.computed for r in reports)
        result.reused = sum(r.reused for r in reports)
        result.skipped = len(data.skipped) + sum(r.skipped - len(data.skipped) for r in reports)
        result.bytes_written = sum(r.bytes_written for r in reports)
        result.shards_written = sum(r.shards_written for r in reports)
    else:
        after = store.stats()
        result.reused = len(keys & before.keys)
        result.computed = len(keys - before.keys)
        result.skipped = len(data.skipped)
        result.bytes_written = max(0, after.bytes - before.bytes)
        result.shards_written = max(0, after.shards - before.shards)
    store.write_manifest(
        {"plan": plan.summary(), "samples": sorted(keys), "report": result.to_dict()}
    )
    return result


@_io_task("finish-preprocess", timeout_seconds=1800)
def finish_preprocess(
    config: SplitstageConfig,
    plan: JobPlan,
    data: DataIndex,
    reports: list[ShardReport] | None,
    before: CacheSnapshot,
    workers: int,
    started: float,
) -> PreprocessReport:
    """Verify the cache holds every sample, write its manifest and report what was done."""
    result = summarize_preprocess(config, plan, data, reports, before, workers)
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
