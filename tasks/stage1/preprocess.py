"""Stage 1: run V2 over the data set under no_grad and write only the boundary params to the cache.

Samples are partitioned by sample key (`shard_of`), so any worker count gives the same cache; a
worker loads only the stage-1 models of the offload plan, skips samples already committed, and
writes shards of `cache.shard_samples` samples (bounded memory), each committed by its index entry.

Before computing, a worker checks the cache (`CacheStore.check`): one listing of `index/` and
`shards/` finds unreadable index entries, missing or resized shards and entries with other params;
shards modified after their index entry (or, with `verify=True`, every shard of its samples) are
re-read for sha256. Damaged entries are moved to `quarantine/` (by ONE worker: the one owning the
entry's first sample) and reported; their samples are recomputed like new ones.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Any

import torch
from tqdm import tqdm

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.data import (
    DataError,
)
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units, split_batch
from splitstage.splitter import UserError
from splitstage.tasks.cache.shard_format import (
    CacheCorruptError,
    SampleNotCachedError,
    ShardProblem,
)
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.data_index import DataIndex, index_data_set
from splitstage.tasks.device import pick_device
from splitstage.tasks.plan import JobPlan, make_plan, open_cache
from splitstage.tasks.validation_prompts import write_validation_prompts

ProgressFn = Callable[[int, int], None]


@dataclass
class ShardReport:
    """What one preprocessing worker did."""

    shard: int
    num_shards: int
    assigned: int = 0
    computed: int = 0
    reused: int = 0
    skipped: int = 0
    bytes_written: int = 0
    shards_written: int = 0
    seconds: float = 0.0
    damaged: int = 0
    repaired: int = 0
    bytes_verified: int = 0
    quarantined: list[str] = field(default_factory=list)
    undecodable: list[str] = field(default_factory=list)  # keys skipped at decode (skip_bad_rows)
    validation_prompts: str | None = None  # shard 0 encodes the [validation] prompts: their URL


@dataclass
class PreprocessReport:
    """The whole preprocessing run, summed over workers."""

    cache_key: str
    cache_url: str
    samples: int = 0
    computed: int = 0
    reused: int = 0
    skipped: int = 0
    duplicates: int = 0
    bytes_written: int = 0
    shards_written: int = 0
    seconds: float = 0.0
    workers: int = 1
    skipped_rows: list[tuple[int, str]] = field(default_factory=list)
    damaged: int = 0  # damaged index entries (and their shards) moved to quarantine/
    repaired: int = 0  # computed samples the cache had lost (damaged, or listed by the manifest)
    bytes_verified: int = 0  # shard bytes re-read for their checksum
    checksums: str = "changed"  # which shards were re-read: "changed" ones or "all"
    quarantined: list[str] = field(default_factory=list)  # the index entries moved aside
    validation_prompts: str | None = None  # URL of the encoded [validation] prompts

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        mb = self.bytes_written / 1e6
        line = (
            f"preprocess {self.cache_key}: {self.samples} samples, {self.computed} computed, "
            f"{self.reused} reused, {self.skipped} skipped, {mb:.2f} MB written in "
            f"{self.shards_written} shards, {self.seconds:.1f} s ({self.workers} workers)"
        )
        if self.damaged or self.repaired:
            line += f"; repaired the cache: {self.repaired} lost samples computed again"
        if self.damaged:
            line += f", {self.damaged} damaged shard(s) moved to {self.cache_url}/quarantine/"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready report."""
        return asdict(self)


@dataclass(frozen=True)
class CacheSnapshot:
    """What a job's cache holds at one moment: committed sample keys, shard files, bytes."""

    keys: frozenset[str]
    shards: int
    bytes: int


def snapshot(store: CacheStore) -> CacheSnapshot:
    """Read the cache index once: what preprocessing will reuse, and the figures to diff later
    (entries one listing shows damaged count as not cached)."""
    store.check("none")
    stats = store.stats()
    return CacheSnapshot(frozenset(store.committed_keys()), stats.shards, stats.bytes)


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
    store.check("none")  # samples count only with an intact-looking copy
    committed = store.committed_keys()
    # Rows whose image failed to decode were skipped (data.skip_bad_rows): not expected, and the
    # manifest names them so stage 2 does not count them as missing.
    undecodable = {k for r in reports or () for k in r.undecodable}
    missing = set(data.keys) - committed - undecodable
    if missing:
        raise SampleNotCachedError(
            f"preprocessing finished but {len(missing)} of {len(data.keys)} samples are not in "
            f"the cache {store.url}; rerun it (only the missing samples are computed) and check "
            "the shard runs' logs"
        )
    keys = set(data.keys) - undecodable
    if reports is not None:
        result = summarize_shards(plan, store, data, reports, workers)
    else:
        result = summarize_shards(plan, store, data, [], workers)
        after = store.stats()
        result.reused = len(keys & before.keys)
        result.computed = len(keys - before.keys)
        result.skipped = len(data.skipped)
        result.bytes_written = max(0, after.bytes - before.bytes)
        result.shards_written = max(0, after.shards - before.shards)
    store.write_manifest(
        {
            "plan": plan.summary(),
            "samples": sorted(keys),
            "undecodable": sorted(undecodable),
            "report": result.to_dict(),
        }
    )
    return result


def summarize_shards(
    plan: JobPlan, store: CacheStore, data: DataIndex, reports: Iterable[ShardReport], workers: int
) -> PreprocessReport:
    """Sum the workers' shard reports into one run report."""
    reports = list(reports)
    quarantined = sorted({url for r in reports for url in r.quarantined})
    return PreprocessReport(
        cache_key=plan.cache_key,
        cache_url=store.url,
        samples=len(data.keys),
        computed=sum(r.computed for r in reports),
        reused=sum(r.reused for r in reports),
        skipped=len(data.skipped) + sum(r.skipped - len(data.skipped) for r in reports),
        duplicates=data.duplicates,
        bytes_written=sum(r.bytes_written for r in reports),
        shards_written=sum(r.shards_written for r in reports),
        workers=workers,
        skipped_rows=data.skipped,
        damaged=len(quarantined),
        repaired=sum(r.repaired for r in reports),
        bytes_verified=sum(r.bytes_verified for r in reports),
        quarantined=quarantined,
        validation_prompts=next((r.validation_prompts for r in reports if r.shard == 0), None),
    )


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
    store: CacheStore, plan: JobPlan, keys: set[str], shard: int, num_shards: int, verify: bool
) -> ShardReport:
    """Check the cache for `keys` and move the damaged entries this worker owns to quarantine/;
    the store then lists only intact samples. Returns the counts: damaged entries moved, and
    `repaired`: samples of `keys` to compute again (a damaged copy, or the manifest lists them)."""
    check = store.check(
        "all" if verify else "changed", keys=keys, params=plan.split.boundary_params, touch=True
    )
    ours = [p for p in check.damaged if p.kind != "manifest" and _owner(p, num_shards) == shard]
    moved = store.quarantine(ours)
    try:
        listed = set((store.read_manifest() or {}).get("samples", []))
    except CacheCorruptError:  # rewritten at the end of the run
        listed = set()
    return ShardReport(
        shard,
        num_shards,
        damaged=len(moved),
        repaired=len(keys & (set(check.lost) | listed) - store.committed_keys()),
        bytes_verified=check.bytes_checked,
        quarantined=moved,
    )


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
    data = data or index_data_set(config)
    store = open_cache(config, plan)
    mine = [(r, k) for r, k in zip(data.rows, data.keys) if shard_of(k, num_shards) == shard]
    report = repair_cache(store, plan, {k for _, k in mine}, shard, num_shards, verify)
    report.skipped, report.assigned = len(data.skipped), len(mine)
    committed = store.committed_keys()
    todo = [(r, k) for r, k in mine if k not in committed]
    report.reused = len(mine) - len(todo)
    if todo:
        _compute(config, plan, store, todo, report, progress, on_progress)
    if shard == 0:  # once per run, on a worker (where the encoders belong): not sharded
        report.validation_prompts = write_validation_prompts(config, plan)
    report.seconds = time.perf_counter() - started
    return report


def _compute(config, plan, store, todo, report, progress, on_progress) -> None:
    """Load the stage-1 models, run V2 in batches, flush full shards as they fill."""
    device = pick_device(config.preprocess.device)
    family = plan.family
    models = {name: family.build_model(name, device) for name in plan.split.models["stage1"]}
    ctx = StepContext(models=models, device=device, settings=family.settings())
    base = config.data.base_path
    batch_size = config.preprocess.batch_size
    buffer: dict[str, dict[str, Any]] = {}
    bar = tqdm(
        total=len(todo),
        desc=f"preprocess {report.shard}/{report.num_shards}",
        unit="sample",
        disable=not progress,
    )
    with torch.no_grad(), bar:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            samples, keys = [], []
            for row, key in chunk:
                try:
                    samples.append(family.load_sample(row, base))
                    keys.append(key)
                except DataError:
                    if not config.data.skip_bad_rows:
                        raise
                    report.skipped += 1
                    report.undecodable.append(key)
            if samples:
                batch = run_units(plan.v2_units, ctx, collate_samples(samples))
                records = split_batch(batch, plan.split.boundary_params, len(samples))
                buffer.update(zip(keys, records))
                report.computed += len(samples)
            while len(buffer) >= config.cache.shard_samples:
                _flush(store, buffer, config.cache.shard_samples, report)
            bar.update(len(chunk))
            if on_progress:
                on_progress(start + len(chunk), len(todo))
        if buffer:
            _flush(store, buffer, len(buffer), report)


def _flush(store: CacheStore, buffer: dict, count: int, report: ShardReport) -> None:
    """Write the first `count` buffered samples as one shard (shard file, then its index)."""
    keys = list(buffer)[:count]
    info = store.write_shard({key: buffer.pop(key) for key in keys})
    report.bytes_written += info.nbytes
    report.shards_written += 1
    # Fault injection for tests: SPLITSTAGE_FAULT_KILL_AFTER_SHARDS=N kills this worker for real.
    limit = os.environ.get("SPLITSTAGE_FAULT_KILL_AFTER_SHARDS")
    if limit and report.shards_written >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


def _worker(config_json: str, shard: int, num_shards: int, threads: int, data: DataIndex, verify):
    """Process-pool entry: rebuild the config, limit torch threads, run one shard."""
    from splitstage.pipelines.config import SplitstageConfig

    torch.set_num_threads(threads)
    config = SplitstageConfig.model_validate_json(config_json)
    return preprocess_shard(config, shard, num_shards, data=data, progress=False, verify=verify)


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
    data = index_data_set(config)
    store = open_cache(config, plan)
    before = snapshot(store)
    workers = workers or config.preprocess.workers
    run = {"plan": plan, "data": data, "progress": progress, "verify": verify}
    if shard is not None:
        reports = [preprocess_shard(config, shard[0], shard[1], **run)]
        workers = 1
    elif workers == 1:
        reports = [preprocess_shard(config, 0, 1, **run)]
    else:
        threads = int(os.environ.get("SPLITSTAGE_PREPROCESS_THREADS", 0)) or max(
            1, (os.cpu_count() or 1) // workers
        )
        payload = config.model_dump_json()
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = [
                pool.submit(_worker, payload, i, workers, threads, data, verify)
                for i in range(workers)
            ]
            reports = [f.result() for f in futures]
    if shard is None:
        result = summarize_preprocess(config, plan, data, reports, before, workers)
    else:  # one shard of many: the coordinator of the whole run writes the manifest
        result = summarize_shards(plan, store, data, reports, workers)
    result.seconds = time.perf_counter() - started
    result.checksums = "all" if verify else "changed"
    return result
