"""Stage 1: run V2 over the data set under no_grad and write only the boundary params to the cache.

Samples are partitioned by sample key (`shard_of`), so any worker count gives the same cache; a
worker loads only the stage-1 models of the offload plan, skips samples already committed, and
writes shards of `cache.shard_samples` samples (bounded memory), each committed by its index entry.

Before computing, a worker checks the cache (`CacheStore.check`): one listing of `index/` and
`shards/` finds unreadable index entries, missing or resized shards and entries with other params;
shards modified after their index entry (or, with `verify=True`, every shard of its samples) are
re-read for sha256. Damaged entries are moved to `quarantine/` (by ONE worker: the one owning the
entry's first sample) and reported; their samples are recomputed like new ones. With everything
cached intact the coordinator's own check (`all_cached`) answers and no worker starts. The
reports and the coordinator's manifest are in `report` (re-exported here).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import active_children, get_context
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from splitstage.config.job import SplitstageConfig
from splitstage.data.dataset import DataError, Row
from splitstage.data.index import DataIndex, Shown, index_data_set
from splitstage.data.source import DataSource
from splitstage.pipelines.distill_rows import check_rows
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units, split_batch
from splitstage.process.unused_imports import skip_unused_libraries
from splitstage.splitter import UserError
from splitstage.tasks.cache.shard_format import CacheCorruptError, ShardProblem
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.cache.validation_prompts import (
    prompts_path,
    validation_prompts_written,
    write_validation_prompts,
)
from splitstage.tasks.cache.validation_references import check_validation_references
from splitstage.tasks.device import (
    peak_memory_gib,
    pick_device,
    resident_mb,
    steady_heap,
    tensor_mb,
)
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.memory.budget import check_stage1_memory
from splitstage.tasks.stage1 import undecodable
from splitstage.tasks.stage1.overlap import OverlappedRun
from splitstage.tasks.stage1.preprocess_report import (
    CacheSnapshot,
    PreprocessReport,
    ShardReport,
    snapshot,
    summarize_preprocess,
    summarize_shards,
)
from splitstage.tasks.stage2.preflight import check_job

ProgressFn = Callable[[int, int], None]
__all__ = [  # the reports live in `report`; importers reach them from here too
    "CacheSnapshot",
    "PreprocessReport",
    "ShardReport",
    "all_cached",
    "overlapped_run",
    "preprocess",
    "preprocess_shard",
    "shard_of",
    "snapshot",
    "start_preprocess",
    "summarize_preprocess",
    "summarize_shards",
]


def shard_of(key: str, num_shards: int) -> int:
    """The worker shard that owns a sample key: stable, independent of row order and paths."""
    return int(key[:16], 16) % num_shards


def _owner(problem: ShardProblem, num_shards: int) -> int:
    """The worker shard that moves a damaged entry aside: the owner of its first sample (who
    alone could rewrite that very shard), or by shard id when the entry is unreadable."""
    name = min(problem.samples) if problem.samples else problem.shard_id
    try:
        return shard_of(name, num_shards)
    except ValueError:  # not a hex name
        return zlib.crc32(name.encode()) % num_shards


def repair_cache(
    store: CacheStore, plan: JobPlan, keys: list[str], shard: int, num_shards: int, verify: bool
) -> tuple[ShardReport, list[bool]]:
    """Check the cache for `keys` and move the damaged entries this worker owns to quarantine/;
    the store then lists only intact samples. Returns the counts (damaged entries moved, and
    `repaired`: samples of `keys` to compute again: a damaged copy, or the manifest lists them)
    and, per key, whether an intact copy is cached."""
    check = store.check(
        "all" if verify else "changed", keys=keys, params=plan.split.boundary_params, touch=True
    )
    ours = [p for p in check.damaged if p.kind != "manifest" and _owner(p, num_shards) == shard]
    moved = store.quarantine(ours)
    cached = store.contains(keys).tolist()  # arrays: no set of 10^6 keys
    uncached = {k for k, done in zip(keys, cached) if not done}
    listed: set[str] = set()
    if uncached:  # (a rerun with everything cached reads no manifest: 10^6 keys cost ~0.5 s)
        with contextlib.suppress(CacheCorruptError):  # rewritten at the end of the run
            listed = set((store.read_manifest() or {}).get("samples", []))
    report = ShardReport(
        shard,
        num_shards,
        damaged=len(moved),
        repaired=len(uncached & (set(check.lost) | listed)),
        bytes_verified=check.bytes_checked,
        quarantined=moved,
    )
    return report, cached


def preprocess_shard(
    config: SplitstageConfig,
    shard: int = 0,
    num_shards: int = 1,
    *,
    plan: JobPlan | None = None,
    data: DataIndex | None = None,
    progress: bool = True,
    on_progress: ProgressFn | None = None,
    verify: bool = False,
) -> ShardReport:
    """Compute and cache the V2 outputs of the samples this shard owns that are not cached yet
    (or whose cached copy is damaged: see `repair_cache`; `verify` re-reads all their shards)."""
    if not 0 <= shard < num_shards:
        raise UserError(
            f"--shard {shard}/{num_shards}: the shard index must be in 0..{num_shards - 1}"
        )
    started = time.perf_counter()
    plan = plan or make_plan(config)
    if data is None:  # a shard on its own (a deployment's): its rows checked here, once
        data = index_data_set(config, shown=Shown(bar=None if progress else False))
        check_rows(config, data.rows)
    store = plan.cache  # opened once per process: every shard and the coordinator share it
    keys = data.keys
    mine = [i for i, k in enumerate(keys) if num_shards == 1 or shard_of(k, num_shards) == shard]
    report, cached = repair_cache(store, plan, [keys[i] for i in mine], shard, num_shards, verify)
    report.assigned = len(mine)
    todo = [(data.rows[i], keys[i]) for i, done in zip(mine, cached) if not done]  # rows built here
    report.reused = len(mine) - len(todo)
    if not verify and todo and (bad := undecodable.known(store, [key for _, key in todo])):
        report.undecodable.update(bad)  # not decoded again (and no model loaded for them)
        todo = [(row, key) for row, key in todo if key not in bad]
    report.skipped = len(data.skipped) + len(report.undecodable)
    if todo:
        _compute(plan, store, data.source, todo, report, progress, on_progress)
    if shard == 0:  # once per run, on a worker (where the encoders belong): not sharded
        report.validation_prompts = write_validation_prompts(plan)
    report.seconds = time.perf_counter() - started
    return report


def all_cached(plan: JobPlan, data: DataIndex, *, prompts: bool = True) -> ShardReport | None:
    """The coordinator's own check before it starts workers: when every sample has an intact
    cached copy (or is recorded undecodable: `undecodable`), nothing is damaged and (`prompts`)
    the validation prompts are encoded, the run's report (no worker to start: on a rerun that
    costs seconds of imports); else None (workers check, repair and compute exactly as without
    it)."""
    store = plan.cache
    keys = data.keys
    present = store.contains(keys)  # an array: a million keys in no time
    missing = [] if present.all() else [keys[i] for i in np.flatnonzero(~present)]
    bad = undecodable.known(store, missing) if missing else {}
    if len(bad) < len(missing):  # samples to compute: the workers check (once)
        return None
    check = store.check("changed", keys=keys, params=plan.split.boundary_params, touch=True)
    if check.damaged or (prompts and not validation_prompts_written(plan)):
        return None
    report = ShardReport(0, 1, assigned=len(keys), reused=len(keys) - len(bad), undecodable=bad)
    report.skipped = len(data.skipped) + len(bad)
    report.bytes_verified = check.bytes_checked
    if prompts and plan.config.validation.enabled:
        report.validation_prompts = prompts_path(plan)[2]  # checked above: it is there
    return report


def _compute(plan, store, source, todo, report, progress, on_progress) -> None:
    """Load the stage-1 models and run the overlapped run over `todo` (rows read through
    `source`), with a progress bar; the worker's memory goes into the report (MiB): resident
    before the models were built, the models' own size, and its peaks (resident, and CUDA's
    allocator on a GPU)."""
    device = pick_device(plan.config.preprocess.device)
    family = plan.family
    steady_heap()  # the encoders' transient CPU buffers go back to the system
    before = resident_mb()
    models = {name: family.build_model(name, device) for name in plan.split.models["stage1"]}
    modules = [m for m in models.values() if isinstance(m, torch.nn.Module)]
    report.memory = {"before_models_mb": before, "models_mb": tensor_mb(modules)}
    ctx = StepContext(models=models, device=device, settings=family.settings())
    done = 0
    bar = tqdm(
        total=len(todo),
        desc=f"preprocess {report.shard}/{report.num_shards}",
        unit="sample",
        disable=not progress,
    )

    def finished(count: int) -> None:
        nonlocal done
        done += count
        bar.update(count)
        if on_progress:
            on_progress(done, len(todo))

    rows: dict[str, Row] = {}

    def row_of(key: str) -> Row:  # the first undecodable row builds the map (rarely needed)
        if not rows:
            rows.update((k, row) for row, k in todo)
        return rows[key]

    with torch.no_grad(), bar:
        overlapped_run(plan, store, source, ctx, report, finished, row_of).run(todo)
    peaks = peak_memory_gib(device)
    report.memory |= {name.replace("_gib", "_mb"): gib * 1024 for name, gib in peaks.items()}


def overlapped_run(
    plan: JobPlan,
    store: CacheStore,
    source: DataSource,
    ctx: StepContext,
    report: ShardReport,
    on_done: Callable[[int], None] | None = None,
    row_of: Callable[[str], Row] | None = None,
) -> OverlappedRun:
    """The overlapped stage-1 run of a job (`overlap.OverlappedRun`): decode on threads (each
    load reads through `source`, the data set opened once: the data index's), V2 in batches of
    one shape on the caller (under its no_grad), shards written in the background; counts go
    into `report`, undecodable rows (`row_of` names them) beside the cache."""
    config, family, params = plan.config, plan.family, plan.split.boundary_params

    def compute(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        batch = run_units(plan.v2_units, ctx, collate_samples(samples))
        report.computed += len(samples)
        return split_batch(batch, params, len(samples), family.sequence_params)

    def skip(key: str, error: DataError) -> None:
        report.skipped += 1
        row = row_of(key) if row_of else None
        report.undecodable[key] = undecodable.record(store, key, row, error, source)

    return OverlappedRun(
        load=lambda row: family.load_sample(row, source),
        compute=compute,
        prepare=store.prepare_shard,  # encode + upload shard k+1 while shard k commits
        write=lambda shard: _write(store, shard, report),
        discard=lambda prepared: prepared.discard(),
        batch_size=config.preprocess.batch_size,
        shard_samples=config.cache.shard_samples,
        skip_bad_rows=config.data.skip_bad_rows,
        on_skip=skip,
        on_done=on_done,
        decode_threads=_decode_threads(),
    )


def _decode_threads() -> int:
    """Load threads per worker: SPLITSTAGE_DECODE_THREADS, else 2. They overlap reading the
    bytes (storage I/O) and resizing with the rest of stage 1; decoding itself is one at a time
    per process (`data.images.open_image` holds a lock): more decoding needs more `--workers`."""
    value = os.environ.get("SPLITSTAGE_DECODE_THREADS", "2")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"SPLITSTAGE_DECODE_THREADS={value!r}: give a whole number >= 1")
    return int(value)


def _write(store: CacheStore, shard, report: ShardReport) -> None:
    """Commit one prepared shard (its file, then its index entry); on the writer thread, in
    order, so the fault-injection kill below comes after exactly N commits."""
    info = store.write_shard(shard)
    report.bytes_written += info.nbytes
    report.shards_written += 1
    # Fault injection for tests: SPLITSTAGE_FAULT_KILL_AFTER_SHARDS=N kills this worker for real.
    limit = os.environ.get("SPLITSTAGE_FAULT_KILL_AFTER_SHARDS")
    if limit and report.shards_written >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)
    # ... and SPLITSTAGE_FAULT_PAUSE_AFTER_SHARDS=N stops it committing, to be killed from outside.
    pause = os.environ.get("SPLITSTAGE_FAULT_PAUSE_AFTER_SHARDS")
    if pause and report.shards_written >= int(pause):
        time.sleep(3600)


@contextlib.contextmanager
def ctrl_c_ignored_by_children() -> Iterator[None]:
    """While the pool spawns its workers (in `submit`), SIGINT is ignored, so they start with it
    ignored (an ignored signal stays ignored across exec, and Python then installs no
    KeyboardInterrupt handler): a Ctrl-C during their imports prints no traceback. Main thread
    only (a flow's thread cannot set handlers; the workers' initializer covers that case)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker_start(config_json: str) -> None:
    """Pool-worker start: Ctrl-C in the terminal reaches the whole process group; the
    coordinator alone handles it (it stops the workers; their shards are written atomically).
    tqdm's lock is a thread lock here: its default, a multiprocessing lock, is a named semaphore
    a stopped worker never releases (the resource tracker then warns of a leak at exit).
    A worker serves this one job (the pool ends with the run): the libraries it cannot use are
    marked absent before any family imports them (bitsandbytes' and torchao's import lines)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tqdm.set_lock(threading.RLock())
    skip_unused_libraries(json.loads(config_json))


def _worker(config_json: str, shard: int, num_shards: int, threads: int, data: DataIndex, verify):
    """Process-pool entry: rebuild the config, limit torch threads, run one shard."""
    from splitstage.config.job import SplitstageConfig

    torch.set_num_threads(threads)
    config = SplitstageConfig.model_validate_json(config_json)
    return preprocess_shard(config, shard, num_shards, data=data, progress=False, verify=verify)


def start_preprocess(plan: JobPlan) -> tuple[int, int]:
    """A preprocess run's first step (CLI and flow), before the data set is indexed: refuse
    what `train` would (the job's own checks: `preflight.check_job`), a worker over the device
    budget, or a cache that cannot be written (one line), then delete what an interrupted run
    left mid-write; (files, bytes) reclaimed."""
    check_job(plan, optimizer_package=False)  # what validate and train refuse, refused here
    check_validation_references(plan.family)  # [validation] reference images: read, decoded
    check_stage1_memory(plan)  # a worker over train.device_memory: refused before any model
    plan.cache.require_writable()
    return plan.cache.sweep_temp_files()  # no writer of this run has started yet


def preprocess(
    config: SplitstageConfig,
    *,
    workers: int | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool = True,
    verify: bool = False,
) -> PreprocessReport:
    """Run one shard (`shard=(i, n)`) or all shards on local worker processes, then the manifest.
    `verify=True` re-reads every cached shard of the data set's samples for its checksum (by
    default only shards modified after their index entry are)."""
    started = time.perf_counter()
    plan = make_plan(config)
    swept = start_preprocess(plan)
    store = plan.cache
    data = index_data_set(config, shown=Shown(bar=None if progress else False))
    check_rows(config, data.rows)  # the task's row values, before any worker loads a model
    before = snapshot(store)
    workers = workers or config.preprocess.workers
    run = {"plan": plan, "data": data, "progress": progress, "verify": verify}
    if shard is not None:
        reports = [preprocess_shard(config, shard[0], shard[1], **run)]
        workers = 1
    elif workers == 1:
        reports = [preprocess_shard(config, 0, 1, **run)]
    elif not verify and (cached := all_cached(plan, data)):
        reports, workers = [cached], 0  # nothing to compute: no worker started
    else:
        threads = int(os.environ.get("SPLITSTAGE_PREPROCESS_THREADS", 0)) or max(
            1, (os.cpu_count() or 1) // workers
        )
        payload = config.model_dump_json()
        context = get_context("spawn")
        start = {"initializer": _worker_start, "initargs": (payload,)}
        with ProcessPoolExecutor(workers, mp_context=context, **start) as pool:
            try:
                with ctrl_c_ignored_by_children():
                    futures = [
                        pool.submit(_worker, payload, i, workers, threads, data, verify)
                        for i in range(workers)
                    ]
                reports = [f.result() for f in futures]
            except KeyboardInterrupt:  # the coordinator stops its workers: no traceback each
                for child in active_children():
                    child.terminate()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    if shard is None:
        result = summarize_preprocess(plan, data, reports, before, workers)
    else:  # one shard of many: the coordinator of the whole run writes the manifest
        result = summarize_shards(plan, store, data, reports, workers)
    result.seconds = time.perf_counter() - started
    result.checksums = "all" if verify else "changed"
    result.temp_files_removed, result.bytes_reclaimed = swept
    return result
