"""A cache check that reads no index entry the index snapshot still holds: seconds at 10^6 samples.

`CacheStore.check` on a rerun used to read and parse every index entry (5 s for 10^6 samples in
15,625 entries, locally; one GET each on an object store). Here the entries come from the index
snapshot wherever their listing stamp (size + ETag, or size + inode + mtime) is the snapshotted
one, by the stage-2 reader's rule (`index_snapshot.read_index`): entries added since are read,
one rewritten with other bytes means no snapshot. The shards are then checked against ONE listing
of `shards/` with arrays. Anything a full check would have to look into (a listed entry that does
not parse, a missing or resized shard, params other than this job's, a shard of a wanted sample
modified after its entry) returns None: the caller runs the full check, which names it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

import splitstage.tasks.cache.shard_format as fmt
from splitstage.tasks.cache.compact_index import CompactIndex
from splitstage.tasks.cache.index_snapshot import entry_stamp, from_snapshot


def snapshot_check(
    store: Any,
    checksums: str,
    wanted: set[str] | None,
    params: Collection[str] | None,
) -> fmt.VerifyReport | None:
    """The report of `store.check(checksums, keys=wanted, params=params)` for checksums "changed"
    or "none", made from the index snapshot, when it shows every entry intact; None otherwise
    (no snapshot, or something the full check must name or re-read). Sets the store's index."""
    listing = store._list("index", ".json")
    stamps = {path: entry_stamp(info) for path, info in listing.items()}
    index = from_snapshot(store, listing, stamps, tolerant=True)
    if index is None or len(index.shard_ids) != len(listing):
        return None  # no snapshot, or a listed entry did not parse (or went meanwhile)
    if params is not None and not _specs_hold(index, set(params)):
        return None
    shard_info = store._list("shards", ".safetensors")
    ids = [i.decode() for i in index.shard_ids.tolist()]
    shard_paths = [store._path(fmt.shard_file(i)) for i in ids]
    sizes = np.array([shard_info.get(p, {}).get("size", -1) for p in shard_paths], np.int64)
    present = np.array([p in shard_info for p in shard_paths], bool)
    if not present.all() or (sizes != index.shard_bytes.astype(np.int64))[sizes >= 0].any():
        return None  # a missing or resized shard
    if checksums == "changed":
        for n, (sid, path) in enumerate(zip(ids, shard_paths)):
            entry_info = listing[store._path(store.index_file(sid))]
            if fmt.newer(shard_info[path], entry_info) and _wanted_in(index, n, wanted):
                return None  # the full check re-reads it (and re-commits it when good)
    store._use_index(index)
    report = fmt.VerifyReport(store.url, checksums=checksums)
    report.shards_checked, report.samples = len(ids), len(store.key_table())
    named = set(shard_paths)
    report.orphans = [store._url(p) for p in sorted(shard_info) if p not in named]
    return report


def _specs_hold(index: CompactIndex, params: set[str]) -> bool:
    """True when every committed sample's spec map has exactly `params` (a spec naming a
    `same_as` tensor has its plain base's params: only those are looked at)."""
    base = np.asarray(index.spec_base, np.int64)[np.unique(index.spec)] if len(index.spec) else []
    return all(set(index.specs[b]) == params for b in set(np.asarray(base).tolist()))


def _wanted_in(index: CompactIndex, n: int, wanted: set[str] | None) -> bool:
    """True when shard number `n` holds a sample of `wanted` (None: every sample is wanted)."""
    return wanted is None or not wanted.isdisjoint(index.entry(n).samples)
