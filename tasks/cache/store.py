"""Content-addressed sample cache on object storage: stage 1 writes shards, stage 2 reads them.

Layout under `<url>/<cache_key>/`:
  shards/<shard_id>.safetensors  many samples; tensors named `<sample_key>/<param>`, non-tensor
                                 values as one JSON blob in the safetensors metadata
  index/<shard_id>.json          written only after its shard: byte size, sha256, sample params
  manifest.json                  written by the preprocessing coordinator (`manifest`), with
  manifest-samples-<sha>.parquet  its sample keys, compact (a key table)
  index-snapshot.parquet         the index as arrays, written with the manifest (`index_snapshot`)
  quarantine/                    damaged index entries and shards moved aside, with the problem
  undecodable/<sample_key>.json  rows stage 1 skipped as undecodable (`side_records`)

`shard_id` hashes the shard bytes, so two workers writing the same samples write the same names.
A sample is visible only once its index entry exists. Reads check size and sha256 before parsing;
nothing is ever unpickled: a cache in a shared bucket cannot run code. Checks and repair are in
`repair` (mixed in here).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

import splitstage.storage.files as st
import splitstage.tasks.cache.manifest as mf
import splitstage.tasks.cache.shard_format as fmt
from splitstage.process.switch_interval import shorter_switch_interval
from splitstage.storage.files import storage_errors, write_chains
from splitstage.tasks.cache.cache_errors import CacheCorruptError, SampleNotCachedError
from splitstage.tasks.cache.compact_index import CompactIndex, IndexBuilder, release_freed_memory
from splitstage.tasks.cache.group_labels import ImageSizes
from splitstage.tasks.cache.index_entry import seen_digest
from splitstage.tasks.cache.index_snapshot import read_index, write_snapshot
from splitstage.tasks.cache.key_table import KeyTable
from splitstage.tasks.cache.repair import QUARANTINE, READ_BATCH_BYTES, CacheChecks
from splitstage.tasks.cache.side_records import SideRecords
from splitstage.tasks.cache.write_ahead import PreparedShard, WriteAhead

OPTIONS_FIELD = "cache.storage_options"  # the config field a cache's credentials go in
MEMO_FOLDER = "data-memo"  # beside the caches: `splitstage.data.hash_memo.FOLDER` (not imported)
_INDEX_BATCH = 1024  # index entries per batched read (bounds the bytes held at once)
WRITE_SWITCH_INTERVAL = 0.0001  # s: best of 5 / 0.5 / 0.1 ms for write_shards (switch_interval)
encode_shard = fmt.encode_shard  # importable from here, as are the errors, QUARANTINE, seen_digest
__all__ = [
    "QUARANTINE",
    "CacheCorruptError",
    "CacheStore",
    "SampleNotCachedError",
    "encode_shard",
    "seen_digest",
]


class _Seen(dict):
    """{shard id: digest} that takes the entry bytes themselves (`seen[id] = data`)."""

    def __setitem__(self, shard_id: str, data: bytes) -> None:
        super().__setitem__(shard_id, seen_digest(data))


class CacheStore(CacheChecks, WriteAhead, SideRecords):
    """The cache under `<url>/<cache_key>/`: write shards, list committed samples, read, verify."""

    shard_file = staticmethod(fmt.shard_file)
    index_file = staticmethod(fmt.index_file)

    def __init__(
        self, url: str, cache_key: str, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        fmt.check_name("cache key", cache_key)
        self.base_url = url.rstrip("/")
        self.cache_key = cache_key
        self.url = f"{self.base_url}/{cache_key}"
        self._options = dict(storage_options or {})
        with storage_errors(self.url, "open", self._options, field=OPTIONS_FIELD):
            self.fs, root = st.open_fs(url, self._options)
        self.root = st.join(root, cache_key)
        self._lock = threading.Lock()
        self._index: CompactIndex | None = None  # the committed index as arrays, once read
        self._pending: list[fmt.IndexEntry] = []  # entries written since, merged on look-up
        self._seen = _Seen()  # digests of index entry bytes as last read or written, by shard id
        self.image_sizes: ImageSizes = None  # the job's image sizes: group labels say pixels
        # the family's sequence params -> mask (Family.sequence_params): any length groups
        # together, batches pad them
        self.sequence_params: Mapping[str, str | None] = {}

    def __repr__(self) -> str:
        return f"CacheStore(url={self.url!r}, storage_options={st.redact(self._options)!r})"

    def _path(self, rel: str) -> str:
        """Absolute fs path of a file relative to the cache root."""
        return st.join(self.root, rel)

    def _url(self, path: str) -> str:
        """URL of an fs path, for messages (never contains credentials)."""
        return st.display_url(self.fs, path)

    # ---- writing ----------------------------------------------------------------------------
    def write_shard(
        self, samples: Mapping[str, Mapping[str, Any]] | PreparedShard
    ) -> fmt.ShardInfo:
        """Write one shard (or commit a `prepare_shard` one), then its index entry; idempotent."""
        if isinstance(samples, PreparedShard):
            return self._commit(samples)
        return self.write_shards([samples])[0]

    def write_shards(
        self, shards: Iterable[Mapping[str, Mapping[str, Any]]]
    ) -> list[fmt.ShardInfo]:
        """Write many shards, each index entry right after its shard (uploads overlap encoding)."""
        done: list[tuple[fmt.ShardInfo, bytes]] = []

        def chains():
            for samples in shards:
                info, data, index = fmt.prepare_shard(samples)
                done.append((info, index))
                index_path = self._path(self.index_file(info.shard_id))
                yield [(self._path(info.path), data), (index_path, index)]

        where = storage_errors(self.url, "write shards under", self._options, field=OPTIONS_FIELD)
        with where, shorter_switch_interval(WRITE_SWITCH_INTERVAL):  # the I/O loop gets the GIL
            write_chains(self.fs, chains())
        self._record(done)
        return [info for info, _ in done]

    def _record(self, written: list[tuple[fmt.ShardInfo, bytes]]) -> None:
        """Note committed index entries: their digests, and the cached listing when read."""
        with self._lock:
            for info, index in written:
                self._seen[info.shard_id] = index
                if self._entries is not None:
                    self._add_entry(fmt.parse_index_entry(index, info.shard_id, info.path))

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Write the manifest atomically (the preprocessing coordinator's record of the run); its
        `samples` (a list of keys or a KeyTable) go into a compact samples file it names."""
        where = self._url(self._path(mf.MANIFEST))
        fmt.check_json({k: v for k, v in manifest.items() if k != "samples"}, "manifest")
        data, samples_file = mf.encode_manifest(manifest, where)
        with storage_errors(self.url, "write manifest under", self._options, field=OPTIONS_FIELD):
            try:
                old = mf.samples_file_name(self._raw_manifest())
            except CacheCorruptError:
                old = None
            if samples_file is not None:
                st.write_atomic(self.fs, self._path(samples_file[0]), samples_file[1])
            st.write_atomic(self.fs, self._path(mf.MANIFEST), data)
            if old and old != (samples_file or ("",))[0]:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self._path(old))

    def _read_file(self, rel: str) -> bytes | None:
        """One file under the cache root, None when it is not there."""
        path = self._path(rel)
        (data,) = st.read_many(self.fs, [path])
        if isinstance(data, BaseException):
            st.raise_if_storage_error(
                data, self._url(path), "read", self._options, field=OPTIONS_FIELD
            )
            if isinstance(data, FileNotFoundError):
                return None
            raise data
        return data

    def _raw_manifest(self) -> dict[str, Any] | None:
        """The manifest as stored (checked), None when not written."""
        data = self._read_file(mf.MANIFEST)
        return None if data is None else mf.check_manifest(data, self._url(self._path(mf.MANIFEST)))

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest with its `samples` as a KeyTable (from its samples file, or inline in
        older manifests); None when not written, CacheCorruptError when not a manifest."""
        where = self._url(self._path(mf.MANIFEST))
        raw = self._raw_manifest()
        name = mf.samples_file_name(raw)
        data = None if name is None else self._read_file(name)
        if name is not None and data is None:  # replaced since? (a coordinator writing)
            raw = self._raw_manifest()
            name = mf.samples_file_name(raw)
            data = None if name is None else self._read_file(name)
        return None if raw is None else mf.decode_samples(raw, data, where)

    def write_index_snapshot(self) -> int:
        """Write the index snapshot beside the manifest (what the preprocessing coordinator
        does after the manifest) so stage 2 loads the index from one file; entries it holds."""
        return write_snapshot(self)

    # ---- the index ----------------------------------------------------------------------------
    def _list(self, rel: str, suffix: str | None) -> dict[str, dict[str, Any]]:
        """ONE listing of a folder: {path: fsspec info (size, mtime)} of its `suffix` files (of
        everything in it, folders too, when `suffix` is None); {} when there is no such folder."""
        path = self._path(rel) if rel else self.root
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)
        with storage_errors(self.url, "list", self._options, field=OPTIONS_FIELD):
            try:
                infos = st.local_ls(path) if st.is_local(self.fs) else self.fs.ls(path, detail=True)
            except (FileNotFoundError, NotADirectoryError) as exc:
                if st.error_code(exc) is not None:
                    raise
                return {}
        keep = (i for i in infos if i.get("type") == "file" and i["name"].endswith(suffix or ""))
        return {i["name"]: i for i in (infos if suffix is None else keep)}

    def _scan(self, paths: list[str]) -> Iterator[tuple[str, str, bytes]]:
        """Read index entries in batches: (shard id, path, bytes) of each one still there."""
        for start in range(0, len(paths), _INDEX_BATCH):
            group = paths[start : start + _INDEX_BATCH]
            with storage_errors(self.url, "read the index of", self._options, field=OPTIONS_FIELD):
                datas = st.read_many(self.fs, group)
            for path, data in zip(group, datas):
                if isinstance(data, BaseException):
                    st.raise_if_storage_error(
                        data, self._url(path), "read", self._options, field=OPTIONS_FIELD
                    )
                    if isinstance(data, FileNotFoundError):
                        continue  # removed between listing and reading
                    raise data
                yield path.rsplit("/", 1)[-1].removesuffix(".json"), path, data

    @property
    def _entries(self) -> CompactIndex | None:
        """The index as last read (None: not read since `refresh()`), without later writes."""
        return self._index

    def _set_entries(self, entries: Iterable[fmt.IndexEntry]) -> None:
        """Replace the cached listing."""
        index = IndexBuilder().add_all(sorted(entries, key=lambda e: e.shard_id)).build()
        with self._lock:
            self._index, self._pending = index, []

    def _add_entry(self, entry: fmt.IndexEntry) -> None:
        """Add an entry to the cached listing (merged at the next look-up; the caller holds the
        lock); duplicates resolve to the lowest shard id."""
        self._pending.append(entry)

    def _load_index(self) -> None:
        """Read the index once (cached until `refresh()`), from the snapshot where it still holds
        (`index_snapshot`); CacheCorruptError on a bad entry. Entries become arrays chunk by
        chunk: no per-sample objects outlive the read."""
        with self._lock:
            if self._index is not None:
                return
        index, _ = read_index(self)
        release_freed_memory()
        self._use_index(index)

    def _use_index(self, index: CompactIndex) -> None:
        """Take `index`, read just now, as the cached listing (entry digests from it)."""
        with self._lock:
            self._index, self._pending, self._seen = index, [], _Seen()

    def _current(self) -> CompactIndex:
        """The index with every entry this store wrote since it was read."""
        while True:
            self._load_index()
            with self._lock:
                if self._index is None:
                    continue  # refreshed meanwhile
                if self._pending:
                    builder = IndexBuilder(self._index)
                    for entry in self._pending:
                        builder.add(entry)
                    self._index, self._pending = builder.build(), []
                return self._index

    def refresh(self) -> None:
        """Forget the cached listing so the next call re-reads the index (see other writers)."""
        with self._lock:
            self._index, self._pending = None, []

    def committed_keys(self) -> set[str]:
        """Sample keys with a committed index entry (listing cached until `refresh()`; after
        `check`, only those with an intact copy). A set of str: stage 2 uses `key_table()`."""
        return set(self._current().table())

    def key_table(self) -> KeyTable:
        """The committed sample keys, sorted, held compactly (as `committed_keys`)."""
        return self._current().table()

    def contains(self, keys: Iterable[str] | KeyTable) -> np.ndarray:
        """Boolean mask over `keys` (str in any order, or a KeyTable): which are committed."""
        return self._current().table().contains(keys)

    def missing(self, keys: Iterable[str] | KeyTable) -> KeyTable:
        """The distinct keys of `keys` that are not committed, sorted."""
        keys = KeyTable.from_keys(keys)
        return keys.select(~self.contains(keys))

    def _sequence_names(self) -> list[str]:
        """The sequence params and their masks (padded per batch: their length groups none)."""
        params = self.sequence_params
        return list(dict.fromkeys([*params, *filter(None, params.values())]))

    def groups_of(self, keys: KeyTable) -> tuple[np.ndarray, list[str]]:
        """For committed `keys`: each one's group (samples with identical param dtypes and
        shapes share one, e.g. an aspect bucket) and a readable label per group number."""
        index = self._current()
        found, _, spec = index.lookup(keys)
        if not found.all():
            raise self._not_committed(keys.select(~found).to_list())
        of_spec, labels = index.groups(self.image_sizes, tuple(self._sequence_names()))
        return of_spec[spec] if len(of_spec) else np.zeros(len(keys), np.int32), labels

    def _not_committed(self, missing: list[str]) -> SampleNotCachedError:
        """The error for asking after uncommitted keys."""
        return SampleNotCachedError(
            f"{len(missing)} sample key(s) are not committed in {self.url} (e.g. "
            f"{', '.join(sorted(missing)[:3])}); run preprocess for them, or refresh() if "
            f"another worker wrote them since this store listed the index"
        )

    def shard_of(self, keys: Iterable[str]) -> dict[str, str]:
        """Map each sample key to the shard id readers use for it; raise for uncommitted keys."""
        index = self._current()
        keys = list(keys)
        found, shard, _ = index.lookup(keys)
        if not found.all():
            raise self._not_committed([k for k, f in zip(keys, found) if not f])
        ids = {n: index.shard_id(n) for n in set(shard.tolist())}
        return {k: ids[n] for k, n in zip(keys, shard.tolist())}

    def _entry(self, shard_id: str) -> fmt.IndexEntry:
        """The index entry of a shard; raise when the shard is not committed."""
        index = self._current()
        number = index.shard_number(shard_id)
        if number is None:
            raise SampleNotCachedError(
                f"shard {shard_id!r} has no index entry in {self.url}; refresh() or check the id"
            )
        return index.entry(number)

    def _seen_digest(self, shard_id: str) -> bytes | None:
        """Digest of a shard's index entry bytes as this store last read or wrote them."""
        with self._lock:
            digest, index = self._seen.get(shard_id), self._index
        number = None if digest is not None or index is None else index.shard_number(shard_id)
        return digest if number is None else index.seen(number) or None

    # ---- reading ----------------------------------------------------------------------------
    def _verified(self, entry: fmt.IndexEntry, data: bytes | BaseException) -> dict[str, Any]:
        """Check shard bytes against the index (size, sha256) and parse them (tensors as the
        index lists); CacheCorruptError naming the shard and the fix."""
        url = self._url(self._path(entry.shard))
        if isinstance(data, BaseException):
            st.raise_if_storage_error(data, url, "read", self._options, field=OPTIONS_FIELD)
            if not isinstance(data, FileNotFoundError):
                raise data
        got = None if isinstance(data, BaseException) else data
        found = fmt.shard_problem(entry, None if got is None else len(got), got, url)
        if found:
            raise CacheCorruptError(found[1])
        try:
            return fmt.decode_shard(data, entry)
        except Exception as exc:
            raise CacheCorruptError(
                f"shard file {url} matches its checksum but does not parse or disagrees with its "
                f"index entry ({type(exc).__name__}: {exc}); {fmt.repair_hint(entry)}"
            ) from None

    def read_shards(self, shard_ids: Iterable[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """Read and verify many shards in batched requests: {shard_id: {sample_key: params}}."""
        entries = [self._entry(s) for s in dict.fromkeys(shard_ids)]
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for group in fmt.byte_groups(entries, READ_BATCH_BYTES):
            datas = st.read_many(self.fs, [self._path(e.shard) for e in group])
            for entry, data in zip(group, datas):
                out[entry.shard_id] = self._verified(entry, data)
        return out

    def read_shard(self, shard_id: str) -> dict[str, dict[str, Any]]:
        """Read and verify one shard: {sample_key: {param: value}}, tensors on CPU."""
        return self.read_shards([shard_id])[shard_id]

    def read_samples(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Read samples by key, fetching each needed shard once; tensors come back on CPU."""
        owners = self.shard_of(keys)
        shards = self.read_shards(sorted(set(owners.values())))
        return {key: shards[shard][key] for key, shard in owners.items()}

    def require_writable(self) -> None:
        """Write and delete a probe in the cache folder: a read-only, full or forbidden cache is
        refused now, in one line naming it, not after the data set was indexed."""
        probe = self._path(f".write-probe-{uuid.uuid4().hex}")
        with storage_errors(self.url, "write", self._options, field=OPTIONS_FIELD):
            if st.is_local(self.fs):
                os.makedirs(self.root, exist_ok=True)
            else:
                st.ensure_folder(
                    self.fs, self.root, self.url, field="cache.url", options_field=OPTIONS_FIELD
                )
            st.write_atomic(self.fs, probe, b"", self._url(probe))
        with contextlib.suppress(Exception):  # may write but not delete: an empty file stays
            self.fs.rm(probe)

    def sweep_temp_files(self) -> tuple[int, int]:
        """Delete the temporary files an interrupted writer left in this cache and in the data
        memos beside it (a Ctrl-C or a killed worker mid-write; never one whose writer still
        runs): (files, bytes) reclaimed."""
        memos = st.join(self.root[: -len(self.cache_key) - 1], MEMO_FOLDER)
        with storage_errors(
            self.url, "delete unfinished files under", self._options, field=OPTIONS_FIELD
        ):
            found = [st.sweep_temp_files(self.fs, folder) for folder in (self.root, memos)]
        return sum(f for f, _ in found), sum(b for _, b in found)

    def require(self, fix: str) -> None:
        """Raise CacheNotFoundError, one line naming the URL and `fix`, unless this cache's
        folder exists (on object storage: holds any object); bucket errors name the bucket."""
        no_base = st.is_local(self.fs) and not os.path.isdir(self.root[: -len(self.cache_key) - 1])
        if no_base or not self._list("", None):
            why = (
                f"the folder cache.url = {self.base_url} does not exist (check cache.url)"
                if no_base
                else "nothing was written under this cache key (new stage-1 models, V2, settings?)"
            )
            raise fmt.CacheNotFoundError(f"cache {self.url} holds no samples: {why}; {fix}")

    def stats(self) -> fmt.CacheStats:
        """Samples, shards, shard bytes, duplicated sample keys and samples per param-spec group
        (e.g. per aspect bucket), from the index alone."""
        index = self._current()
        dups = index.duplicate_keys()
        return fmt.CacheStats(
            len(index.table()),
            len(index.shard_ids),
            int(index.shard_bytes.sum()),
            len(dups),
            dups,
            index.group_counts(self.image_sizes, tuple(self._sequence_names())),
        )
