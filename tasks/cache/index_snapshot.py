"""A snapshot of a cache's compact index in ONE Parquet file, so stage 2 starts in seconds.

The preprocessing coordinator writes `index-snapshot.parquet` beside the manifest (atomic):
the `CompactIndex` arrays (keys, shard and spec numbers, shard ids, sizes, sha256s, digests of
the entry bytes), its spec table, and per index entry the stamp ONE listing of `index/` gave it
(size + ETag, or size + inode + mtime), taken before the entries were read. A store loading its
index lists `index/` once: entries whose stamp still matches come from the snapshot, entries added
since are read and merged, an entry with another stamp is read and kept only if its bytes are the
snapshotted ones. An entry removed or rewritten with other bytes, or a snapshot that does not
parse, fails its checksum or belongs to another cache, makes the store read every entry (with one
log line): the result is always the index a full read gives. No pickle: arrays and JSON only.

Format: the arrays as Parquet columns (`storage.parquet_columns`: flattened, each name column's
width in the JSON header, which is schema metadata with the format, the cache key and a sha256
over every array's name, shape and bytes); Parquet's page CRC-32 is verified on load too. A
snapshot of the earlier safetensors format (`index-snapshot.safetensors`) is never read: the
first store after the change finds no snapshot and reads every entry, as for a bad one, until
the coordinator writes the Parquet one (the old file is left; deleting it is safe).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

import splitstage.storage.files as st
from splitstage.storage.parquet_columns import ColumnFile, write_columns
from splitstage.tasks.cache.cache_errors import CacheCorruptError
from splitstage.tasks.cache.compact_index import CompactIndex, IndexBuilder, canonical
from splitstage.tasks.cache.index_entry import (
    all_names,
    bad_params,
    index_file,
    parse_index_entry,
    seen_digest,
    spec_key,
)

log = logging.getLogger(__name__)
SNAPSHOT = "index-snapshot.parquet"
_FORMAT = 2
_META = "splitstage-index-snapshot"
_ROWS = ("keys", "shard", "spec")
_SHARDS = ("shard_ids", "shard_bytes", "shard_sha", "shard_seen", "stamps")
_SPECS = ("spec_text", "spec_ends", "spec_aliased", "spec_base")
_NAMES = ("keys", "shard_ids", "shard_sha", "shard_seen", "stamps")  # uint8 [N, width] each


class SnapshotError(ValueError):
    """A snapshot that cannot be used (the caller reads every entry instead)."""


def entry_stamp(info: Mapping[str, Any]) -> str:
    """What a listing says of one entry, to tell a rewrite: size + content tag (object stores),
    else size + inode + modification time; "" when the listing gives neither (never matches)."""
    size = info.get("size")
    for name in ("ETag", "etag", "md5Hash", "generation"):
        if info.get(name):
            return f"{size}:{name}={info[name]}"
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(name) is not None:
            return f"{size}:{info.get('ino')}:{info[name]!s}"
    return ""


def _rows_of(names: np.ndarray) -> np.ndarray:
    """A fixed-width bytes array as uint8 [N, width] (what the checksum covers)."""
    width = names.dtype.itemsize
    return np.frombuffer(np.ascontiguousarray(names).tobytes(), np.uint8).reshape(-1, width)


def _names_of(rows: np.ndarray) -> np.ndarray:
    """Inverse of `_rows_of`."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.shape[1]:
        raise SnapshotError(f"a name column is {rows.dtype} {list(rows.shape)}")
    return np.frombuffer(rows.tobytes(), f"S{rows.shape[1]}")


def _digest(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over every array's name, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{list(a.shape)};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def encode_snapshot(index: CompactIndex, stamps: list[str], cache_key: str) -> bytes:
    """The snapshot file of `index`, whose entries' listing stamps are `stamps` (shard order)."""
    texts = [s if isinstance(s, bytes) else canonical(s) for s in index.specs]
    stamp_array = np.array([s.encode() for s in stamps], "S") if stamps else np.zeros(0, "S1")
    arrays = {
        "keys": _rows_of(index.keys),
        "shard": index.shard.astype(np.int32),
        "spec": index.spec.astype(np.int32),
        "shard_ids": _rows_of(index.shard_ids),
        "shard_bytes": index.shard_bytes.astype(np.int64),
        "shard_sha": _rows_of(index.shard_sha),
        "shard_seen": _rows_of(index.shard_seen.astype("S16")),
        "stamps": _rows_of(stamp_array),
        "spec_text": np.frombuffer(b"".join(texts), np.uint8),
        "spec_ends": np.cumsum([len(t) for t in texts], dtype=np.int64),
        "spec_aliased": np.array([isinstance(s, bytes) for s in index.specs], np.uint8),
        "spec_base": np.asarray(index.spec_base, np.int64),
    }
    meta = {"format": _FORMAT, "cache_key": cache_key, "hexed": bool(index.hexed)}
    meta["sha256"] = _digest(arrays)
    meta["widths"] = {name: arrays[name].shape[1] for name in _NAMES}
    return write_columns(arrays, {_META: json.dumps(meta)})


def decode_snapshot(data: bytes, cache_key: str) -> tuple[CompactIndex, np.ndarray]:
    """The index a snapshot holds and its entries' stamps; SnapshotError saying what is wrong."""
    try:
        file = ColumnFile(data)
        meta = json.loads(file.meta[_META])
    except Exception as exc:  # any parse failure: not a snapshot
        raise SnapshotError(f"it does not parse ({type(exc).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise SnapshotError(
            f"it has format {meta.get('format') if isinstance(meta, dict) else meta!r}"
        )
    if meta.get("cache_key") != cache_key:
        raise SnapshotError(f"it is of cache key {meta.get('cache_key')!r}")
    arrays = _arrays(file, meta)
    if set(arrays) != {*_ROWS, *_SHARDS, *_SPECS} or meta.get("sha256") != _digest(arrays):
        raise SnapshotError("it fails its checksum")
    keys, ids = _names_of(arrays["keys"]), _names_of(arrays["shard_ids"])
    shard, spec = arrays["shard"], arrays["spec"]
    specs, spec_ids, spec_base = _specs(arrays)
    n, s = len(keys), len(ids)
    if {len(shard), len(spec)} != {n} or any(len(arrays[c]) != s for c in _SHARDS[1:]):
        raise SnapshotError("its columns differ in length")
    in_range = n == 0 or (shard.min() >= 0 and shard.max() < s)
    in_range = in_range and (n == 0 or (spec.min() >= 0 and spec.max() < len(specs)))
    if not in_range:
        raise SnapshotError("a row names a shard or spec it does not hold")
    same = keys[1:] == keys[:-1]
    if not bool(np.all((keys[1:] > keys[:-1]) | (same & (shard[1:] > shard[:-1])))):
        raise SnapshotError("its rows are not sorted")
    shard_ids = [i.decode("ascii", "replace") for i in ids.tolist()]
    if s and (not all_names(shard_ids) or not bool(np.all(ids[1:] > ids[:-1]))):
        raise SnapshotError("its shard ids are not sorted, distinct names")
    if not meta.get("hexed") and n and not all_names([k.decode("ascii", "replace") for k in keys]):
        raise SnapshotError("it holds a key that is not a sample key")
    shards = {
        "ids": ids,
        "nbytes": arrays["shard_bytes"],
        "sha": _names_of(arrays["shard_sha"]),
        "seen": _names_of(arrays["shard_seen"]).astype("S16"),
    }
    rows = {"keys": keys, "shard": shard, "spec": spec}
    index = CompactIndex(shards, rows, bool(meta.get("hexed")), specs, spec_ids, spec_base)
    return index, _names_of(arrays["stamps"])


def _arrays(file: ColumnFile, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The snapshot's arrays, name columns back to uint8 [N, width]; a page that fails its CRC
    or widths that do not fit fail the checksum."""
    try:
        arrays = file.columns()
        widths = meta.get("widths")
        for name in _NAMES:
            arrays[name] = arrays[name].reshape(-1, int(widths[name]))
    except OSError as exc:  # pyarrow: a page's CRC-32 does not match
        raise SnapshotError(f"it fails its checksum ({exc})") from None
    except Exception:
        raise SnapshotError("it fails its checksum") from None
    return arrays


def _specs(arrays: Mapping[str, np.ndarray]) -> tuple[list, dict, list[int]]:
    """The spec table (plain maps, and aliased ones as their canonical JSON bytes), checked."""
    text, ends = arrays["spec_text"].tobytes(), arrays["spec_ends"].tolist()
    aliased, base = arrays["spec_aliased"].tolist(), arrays["spec_base"].tolist()
    if len(aliased) != len(ends) or len(base) != len(ends) or (ends and ends[-1] != len(text)):
        raise SnapshotError("its spec table is inconsistent")
    specs: list[Any] = []
    spec_ids: dict[Any, int] = {}
    for i, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        raw = text[start:end]
        if aliased[i]:  # kept as bytes, validated when used (`CompactIndex.spec_map`)
            if not (0 <= base[i] < i and base[base[i]] == base[i] and not aliased[base[i]]):
                raise SnapshotError(f"aliased spec {i} has no plain spec before it")
            specs.append(raw)
            spec_ids[raw] = i
            continue
        try:
            params = json.loads(raw)
        except ValueError:
            raise SnapshotError(f"spec {i} is not JSON") from None
        if bad_params(params) != [] or base[i] != i:
            raise SnapshotError(f"spec {i} is not a valid spec map")
        specs.append(params)
        spec_ids[spec_key(params)] = i
    return specs, spec_ids, base


def _snapshot(store: Any) -> tuple[CompactIndex, np.ndarray] | None:
    """The store's snapshot when there is a usable one; logs why one that is there is not."""
    data = store._read_file(SNAPSHOT)
    if data is None:
        return None
    try:
        return decode_snapshot(data, store.cache_key)
    except SnapshotError as exc:
        log.warning(
            "index snapshot %s is not used (%s): reading every index entry",
            store._url(store._path(SNAPSHOT)),
            exc,
        )
        return None


def read_index(store: Any, *, tolerant: bool = False) -> tuple[CompactIndex, list[str]]:
    """The store's committed index from ONE listing of `index/` (the snapshot where it still
    holds, see the module docstring) and each shard's listing stamp. A bad entry raises
    CacheCorruptError, or with `tolerant` is left out (the snapshot writer: readers that see
    it listed but not snapshotted read it and raise)."""
    listing = store._list("index", ".json")
    stamps = {path: entry_stamp(info) for path, info in listing.items()}
    index = from_snapshot(store, listing, stamps, tolerant)
    if index is None:
        builder = IndexBuilder()
        _add(store, builder, sorted(listing), tolerant)
        index = builder.build()
    ids = [i.decode() for i in index.shard_ids.tolist()]
    return index, [stamps.get(store._path(index_file(i)), "") for i in ids]


def from_snapshot(store, listing, stamps, tolerant) -> CompactIndex | None:
    """The snapshot merged with the entries added since; None when it does not hold."""
    found = _snapshot(store)
    if found is None:
        return None
    index, recorded = found
    paths = [store._path(index_file(i.decode())) for i in index.shard_ids.tolist()]
    gone = sum(p not in listing for p in paths)
    restamped = {
        p: n
        for n, p in enumerate(paths)
        if p in listing and (not stamps[p] or stamps[p].encode() != recorded[n])
    }
    where = store._url(store._path(SNAPSHOT))
    if gone:
        log.warning(
            "index snapshot %s is not used (%d of its entries were removed since): "
            "reading every index entry",
            where,
            gone,
        )
        return None
    checked = 0
    for _, path, data in store._scan(sorted(restamped)):
        if seen_digest(data) != index.seen(restamped[path]):
            log.warning(
                "index snapshot %s is not used (index entry %s was rewritten since): "
                "reading every index entry",
                where,
                store._url(path),
            )
            return None
        checked += 1
    if checked != len(restamped):  # removed between the listing and the read
        log.warning(
            "index snapshot %s is not used (an index entry was removed while reading): "
            "reading every index entry",
            where,
        )
        return None
    covered = set(paths)
    builder = IndexBuilder(index)
    if _add(store, builder, sorted(p for p in listing if p not in covered), tolerant):
        return builder.build()
    return index


def _add(store: Any, builder: IndexBuilder, paths: list[str], tolerant: bool) -> int:
    """Read and add the entries at `paths` (bad ones raise, or are skipped when `tolerant`)."""
    added = 0
    for shard_id, path, data in store._scan(paths):
        try:
            entry = parse_index_entry(data, shard_id, store._url(path))
        except CacheCorruptError:
            if not tolerant:
                raise
            continue
        builder.add(entry, seen_digest(data))
        added += 1
    return added


def write_snapshot(store: Any) -> int:
    """Write the store's index snapshot (atomic); the number of entries it holds."""
    index, stamps = read_index(store, tolerant=True)
    data = encode_snapshot(index, stamps, store.cache_key)
    path = store._path(SNAPSHOT)
    with st.storage_errors(
        store.url, "write the index snapshot under", store._options, field="cache.storage_options"
    ):
        st.write_atomic(store.fs, path, data)
    return len(index.shard_ids)
