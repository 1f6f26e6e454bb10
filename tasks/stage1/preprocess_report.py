"""Stage 1's reports: what each worker and the whole run did; the coordinator's manifest.

`summarize_preprocess` is the coordinator's last step: it checks every sample is committed, sums
the workers' reports (or diffs the cache when the shards ran elsewhere), writes the manifest and,
beside it, the index snapshot that lets stage 2 load a million-sample index from one file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from splitstage.data.index import DataIndex
from splitstage.tasks.cache.shard_format import SampleNotCachedError, reclaimed_text
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage1 import undecodable


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
    undecodable: dict[str, str] = field(default_factory=dict)  # key -> why (skip_bad_rows)
    validation_prompts: str | None = None  # shard 0 encodes the [validation] prompts: their URL
    memory: dict[str, float] = field(default_factory=dict)  # MiB: see `_compute` (none cached)


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
    workers: int = 1  # worker processes started (0: all was cached, the coordinator checked)
    skipped_rows: list[tuple[int, str]] = field(default_factory=list)
    damaged: int = 0  # damaged index entries (and their shards) moved to quarantine/
    repaired: int = 0  # computed samples the cache had lost (damaged, or listed by the manifest)
    bytes_verified: int = 0  # shard bytes re-read for their checksum
    checksums: str = "changed"  # which shards were re-read: "changed" ones or "all"
    quarantined: list[str] = field(default_factory=list)  # the index entries moved aside
    validation_prompts: str | None = None  # URL of the encoded [validation] prompts
    memory: dict[str, float] = field(default_factory=dict)  # the worker with the largest peak
    temp_files_removed: int = 0  # temporary files an interrupted run left, deleted first
    bytes_reclaimed: int = 0  # their bytes

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        mb = self.bytes_written / 1e6
        who = f"{self.workers} workers" if self.workers else "all cached: no worker started"
        line = (
            f"preprocess {self.cache_key}: {self.samples} samples, {self.computed} computed, "
            f"{self.reused} reused, {self.skipped} skipped, {mb:.2f} MB written in "
            f"{self.shards_written} shards, {self.seconds:.1f} s ({who})"
        )
        if self.damaged or self.repaired:
            line += f"; repaired the cache: {self.repaired} lost samples computed again"
        if self.damaged:
            line += f", {self.damaged} damaged shard(s) moved to {self.cache_url}/quarantine/"
        if self.temp_files_removed:
            line += f"; {reclaimed_text(self.temp_files_removed, self.bytes_reclaimed)}"
        return line

    def skipped_lines(self, limit: int = 5) -> list[str]:
        """Warnings naming the skipped rows and why (the first `limit`; the report has all)."""
        lines = [f"skipped (data.skip_bad_rows) {why}" for _, why in self.skipped_rows[:limit]]
        if len(self.skipped_rows) > limit:
            more = len(self.skipped_rows) - limit
            lines.append(f"... and {more} more skipped rows (`preprocess --json` lists them all)")
        return lines

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
    store = plan.cache
    store.check("none")  # samples count only with an intact-looking copy
    committed = store.committed_keys()
    # Rows whose image failed to decode were skipped (data.skip_bad_rows): not expected, and the
    # manifest names them so stage 2 does not count them as missing.
    records = store.read_records(undecodable.FOLDER)  # once: for `known` and `forget`
    if reports is None:  # shards ran elsewhere: what they could not decode is in the cache
        bad = undecodable.known(store, set(data.keys) - committed, records)
    else:
        bad = {k: why for r in reports for k, why in r.undecodable.items() if k not in committed}
    undecodable.forget(store, committed, records)
    missing = set(data.keys) - committed - set(bad)
    if missing:
        raise SampleNotCachedError(
            f"preprocessing finished but {len(missing)} of {len(data.keys)} samples are not in "
            f"the cache {store.url}; rerun it (only the missing samples are computed) and check "
            "the shard runs' logs"
        )
    keys = set(data.keys) - set(bad)
    if reports is not None:
        result = summarize_shards(plan, store, data, reports, workers)
    else:
        result = summarize_shards(plan, store, data, [], workers)
        after = store.stats()
        result.reused = len(keys & before.keys)
        result.computed = len(keys - before.keys)
        result.skipped = len(data.skipped) + len(bad)
        result.skipped_rows = sorted(data.skipped + undecodable.skipped_rows(data, bad))
        result.bytes_written = max(0, after.bytes - before.bytes)
        result.shards_written = max(0, after.shards - before.shards)
    store.write_manifest(
        {
            "plan": plan.summary(),
            "samples": sorted(keys),
            "undecodable": sorted(bad),
            "report": result.to_dict(),
        }
    )
    store.write_index_snapshot()  # after the manifest: stage 2 reads the index from one file
    return result


def summarize_shards(
    plan: JobPlan, store: CacheStore, data: DataIndex, reports: Iterable[ShardReport], workers: int
) -> PreprocessReport:
    """Sum the workers' shard reports into one run report."""
    reports = list(reports)
    quarantined = sorted({url for r in reports for url in r.quarantined})
    bad = {key: why for r in reports for key, why in r.undecodable.items()}
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
        skipped_rows=sorted(data.skipped + undecodable.skipped_rows(data, bad)),
        damaged=len(quarantined),
        repaired=sum(r.repaired for r in reports),
        bytes_verified=sum(r.bytes_verified for r in reports),
        quarantined=quarantined,
        validation_prompts=next((r.validation_prompts for r in reports if r.shard == 0), None),
        memory=max((r.memory for r in reports), key=lambda m: m.get("peak_rss_mb", 0), default={}),
    )
