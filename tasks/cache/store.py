"""Content-addressed sample cache on object storage: stage 1 writes shards, stage 2 reads them.

Layout under `<url>/<cache_key>/`:
  shards/<shard_id>.safetensors  many samples; tensors named `<sample_key>/<param>`, non-tensor
                                 values as one JSON blob in the safetensors metadata
  index/<shard_id>.json          written only after its shard: byte size, sha256, sample params
  manifest.json                  written by the preprocessing coordinator

`shard_id` is a hash of the shard bytes, so two workers writing the same samples write the same
names. A sample is visible only once its index entry exists. Reads check size and sha256 before
parsing, and nothing is ever unpickled: a cache in a shared bucket cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from splitstage.tasks.cache.shard_format import (
    FORMAT_VERSION,
    CacheCorruptError,
    CacheStats,
    IndexEntry,
    SampleNotCachedError,
    ShardInfo,
    ShardProblem,
    VerifyReport,
    check_json,
    check_name,
    decode_shard,
    encode_shard,
)
from splitstage.tasks.cache.storage import (
    display_url,
    join,
    list_dir,
    open_fs,
    raise_if_storage_error,
    read_many,
    redact,
    storage_errors,
    write_atomic,
    write_chains,
)

_READ_BATCH_BYTES = 256 * 2**20


class CacheStore:
    """The cache under `<url>/<cache_key>/`: write shards, list committed samples, read, verify."""

    def __init__(
        self, url: str, cache_key: str, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        check_name("cache key", cache_key)
        self.base_url = url.rstrip("/")
        self.cache_key = cache_key
        self.url = f"{self.base_url}/{cache_key}"
        self._options = dict(storage_options or {})
        with storage_errors(self.url, "open", self._options):
            self.fs, root = open_fs(url, self._options)
        self.root = join(root, cache_key)
        self._lock = threading.Lock()
        self._entries: dict[str, IndexEntry] | None = None
        self._owner: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"CacheStore(url={self.url!r}, storage_options={redact(self._options)!r})"

    # ---- paths and messages ---------------------------------------------------------------
    def _path(self, rel: str) -> str:
        """Absolute fs path of a file relative to the cache root."""
        return join(self.root, rel)

    def _url(self, path: str) -> str:
        """URL of an fs path, for messages (never contains credentials)."""
        return display_url(self.fs, path)

    @staticmethod
    def shard_file(shard_id: str) -> str:
        """Relative path of a shard file."""
        return f"shards/{shard_id}.safetensors"

    @staticmethod
    def index_file(shard_id: str) -> str:
        """Relative path of a shard's index entry."""
        return f"index/{shard_id}.json"

    # ---- writing ----------------------------------------------------------------------------
    def _prepare(self, samples: Mapping[str, Mapping[str, Any]]) -> tuple[ShardInfo, bytes, bytes]:
        """Encode one shard: its info, shard bytes and index-entry bytes."""
        data, specs = encode_shard(samples)
        digest = hashlib.sha256(data).hexdigest()
        shard_id = digest[:32]
        info = ShardInfo(shard_id, self.shard_file(shard_id), len(data), digest, tuple(specs))
        entry = {
            "format": FORMAT_VERSION,
            "shard": info.path,
            "bytes": info.nbytes,
            "sha256": digest,
            "samples": specs,
        }
        index = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()
        return info, data, index

    def write_shard(self, samples: Mapping[str, Mapping[str, Any]]) -> ShardInfo:
        """Write one shard, then its index entry (the commit); idempotent for identical samples."""
        return self.write_shards([samples])[0]

    def write_shards(self, shards: Iterable[Mapping[str, Mapping[str, Any]]]) -> list[ShardInfo]:
        """Write many shards; each index entry goes out right after its own shard is written,
        while the next shard is being encoded (uploads overlap encoding)."""
        done: list[tuple[ShardInfo, bytes]] = []

        def chains():
            for samples in shards:
                info, data, index = self._prepare(samples)
                done.append((info, index))
                index_path = self._path(self.index_file(info.shard_id))
                yield [(self._path(info.path), data), (index_path, index)]

        with storage_errors(self.url, "write shards under", self._options):
            write_chains(self.fs, chains())
        with self._lock:
            if self._entries is not None:
                for info, index in done:
                    self._add_entry(self._parse_entry(index, self.index_file(info.shard_id)))
        return [info for info, _ in done]

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Write `manifest.json` atomically (the preprocessing coordinator's record of the run)."""
        check_json(dict(manifest), "manifest")
        data = json.dumps(manifest, sort_keys=True, indent=2).encode()
        with storage_errors(self.url, "write manifest under", self._options):
            write_atomic(self.fs, self._path("manifest.json"), data)

    def read_manifest(self) -> dict[str, Any] | None:
        """Return `manifest.json`, or None when it has not been written."""
        path = self._path("manifest.json")
        (data,) = read_many(self.fs, [path])
        if isinstance(data, FileNotFoundError):
            raise_if_storage_error(data, self.url, "read manifest under", self._options)
            return None
        if isinstance(data, BaseException):
            raise_if_storage_error(data, self._url(path), "read", self._options)
            raise data
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CacheCorruptError(
                f"manifest {self._url(path)} is not valid JSON ({exc}); rerun preprocess to "
                f"rewrite it"
            ) from None

    # ---- the index ----------------------------------------------------------------------------
    def _parse_entry(self, data: bytes, rel: str) -> IndexEntry:
        """Parse and validate one index entry; CacheCorruptError names it on any problem."""
        where = f"index entry {self._url(self._path(rel))}"
        fix = "delete it and rerun preprocess to rewrite that shard"
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise CacheCorruptError(f"{where} is not valid JSON ({exc}); {fix}") from None
        if not isinstance(raw, dict):
            raise CacheCorruptError(f"{where} is not a JSON object; {fix}")
        version = raw.get("format")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CacheCorruptError(
                f"{where} has format {version}, newer than this splitstage reads "
                f"({FORMAT_VERSION}); upgrade splitstage"
            )
        fields = (
            ("format", int),
            ("shard", str),
            ("bytes", int),
            ("sha256", str),
            ("samples", dict),
        )
        for name, kind in fields:
            if not isinstance(raw.get(name), kind):
                raise CacheCorruptError(f"{where} has a missing or bad field '{name}'; {fix}")
        shard_id = rel.rsplit("/", 1)[-1].removesuffix(".json")
        if raw["shard"] != self.shard_file(shard_id):
            expected = self.shard_file(shard_id)
            raise CacheCorruptError(
                f"{where} names shard {raw['shard']!r}, not {expected!r}; {fix}"
            )
        return IndexEntry(shard_id, raw["shard"], raw["bytes"], raw["sha256"], raw["samples"])

    def _add_entry(self, entry: IndexEntry) -> None:
        """Add an entry to the cached listing; duplicates resolve to the lowest shard id."""
        assert self._entries is not None
        self._entries[entry.shard_id] = entry
        for key in entry.samples:
            owner = self._owner.get(key)
            if owner is None or entry.shard_id < owner:
                self._owner[key] = entry.shard_id

    def _load_index(self, strict: bool = True) -> list[ShardProblem]:
        """List and read every index entry in one batched read; raise or return problems."""
        with self._lock:
            if self._entries is not None and strict:
                return []
        index_dir = self._path("index")
        with storage_errors(self.url, "list", self._options):
            paths = [p for p in list_dir(self.fs, index_dir) if p.endswith(".json")]
            datas = read_many(self.fs, paths)
        entries: list[IndexEntry] = []
        problems: list[ShardProblem] = []
        for path, data in zip(paths, datas):
            rel = "index/" + path.rsplit("/", 1)[-1]
            if isinstance(data, FileNotFoundError):
                raise_if_storage_error(data, self._url(path), "read", self._options)
                continue  # removed between listing and reading
            if isinstance(data, BaseException):
                raise_if_storage_error(data, self._url(path), "read", self._options)
                raise data
            try:
                entries.append(self._parse_entry(data, rel))
            except CacheCorruptError as exc:
                if strict:
                    raise
                problems.append(ShardProblem(self._url(path), str(exc)))
        with self._lock:
            self._entries, self._owner = {}, {}
            for entry in sorted(entries, key=lambda e: e.shard_id):
                self._add_entry(entry)
        return problems

    def refresh(self) -> None:
        """Forget the cached listing so the next call re-reads the index (see other writers)."""
        with self._lock:
            self._entries = None
            self._owner = {}

    def committed_keys(self) -> set[str]:
        """Sample keys with a committed index entry (listing cached until `refresh()`)."""
        self._load_index()
        with self._lock:
            return set(self._owner)

    def shard_of(self, keys: Iterable[str]) -> dict[str, str]:
        """Map each sample key to the shard id readers use for it; raise for uncommitted keys."""
        self._load_index()
        with self._lock:
            owner = dict(self._owner)
        keys = list(keys)
        missing = [k for k in keys if k not in owner]
        if missing:
            raise SampleNotCachedError(
                f"{len(missing)} sample key(s) are not committed in {self.url} (e.g. "
                f"{', '.join(sorted(missing)[:3])}); run preprocess for them, or refresh() if "
                f"another worker wrote them since this store listed the index"
            )
        return {k: owner[k] for k in keys}

    def _entry(self, shard_id: str) -> IndexEntry:
        """The index entry of a shard; raise when the shard is not committed."""
        self._load_index()
        with self._lock:
            entry = (self._entries or {}).get(shard_id)
        if entry is None:
            raise SampleNotCachedError(
                f"shard {shard_id!r} has no index entry in {self.url}; refresh() or check the id"
            )
        return entry

    # ---- reading ----------------------------------------------------------------------------
    def _check_bytes(self, entry: IndexEntry, data: bytes | BaseException) -> bytes:
        """Return shard bytes after checking them against the index; raise CacheCorruptError."""
        path = self._path(entry.shard)
        where = f"shard file {self._url(path)}"
        fix = f"delete it and {self.index_file(entry.shard_id)}, then rerun preprocess"
        if isinstance(data, FileNotFoundError):
            raise_if_storage_error(data, self._url(path), "read", self._options)
            raise CacheCorruptError(
                f"{where} is missing but its index entry exists; delete "
                f"{self.index_file(entry.shard_id)} and rerun preprocess"
            )
        if isinstance(data, BaseException):
            raise_if_storage_error(data, self._url(path), "read", self._options)
            raise data
        if len(data) != entry.nbytes:
            raise CacheCorruptError(
                f"{where} has the wrong size: the index says {entry.nbytes} bytes, the file has "
                f"{len(data)} (truncated or overwritten); {fix}"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise CacheCorruptError(
                f"{where} fails its checksum: sha256 is {digest[:16]}..., the index says "
                f"{entry.sha256[:16]}... (bytes changed in storage); {fix}"
            )
        return data

    def _decode(self, entry: IndexEntry, data: bytes) -> dict[str, dict[str, Any]]:
        """Parse verified bytes; a parse failure still names the shard."""
        try:
            return decode_shard(data, entry)
        except Exception as exc:
            raise CacheCorruptError(
                f"shard file {self._url(self._path(entry.shard))} matches its checksum but does "
                f"not parse ({type(exc).__name__}: {exc}); delete it and its index entry, then "
                f"rerun preprocess"
            ) from None

    def read_shards(self, shard_ids: Iterable[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """Read and verify many shards in batched requests: {shard_id: {sample_key: params}}."""
        entries = [self._entry(s) for s in dict.fromkeys(shard_ids)]
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for group in _byte_groups(entries, _READ_BATCH_BYTES):
            datas = read_many(self.fs, [self._path(e.shard) for e in group])
            for entry, data in zip(group, datas):
                out[entry.shard_id] = self._decode(entry, self._check_bytes(entry, data))
        return out

    def read_shard(self, shard_id: str) -> dict[str, dict[str, Any]]:
        """Read and verify one shard: {sample_key: {param: value}}, tensors on CPU."""
        return self.read_shards([shard_id])[shard_id]

    def read_samples(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Read samples by key, fetching each needed shard once; tensors come back on CPU."""
        owners = self.shard_of(keys)
        shards = self.read_shards(sorted(set(owners.values())))
        return {key: shards[shard][key] for key, shard in owners.items()}

    # ---- checks -----------------------------------------------------------------------------
    def verify(self) -> VerifyReport:
        """Check every shard against its index (size, sha256, parse) and report damaged ones."""
        report = VerifyReport(self.url)
        report.damaged.extend(self._load_index(strict=False))
        with self._lock:
            entries = sorted((self._entries or {}).values(), key=lambda e: e.shard_id)
        for group in _byte_groups(entries, _READ_BATCH_BYTES):
            datas = read_many(self.fs, [self._path(e.shard) for e in group])
            for entry, data in zip(group, datas):
                report.shards_checked += 1
                report.samples += len(entry.samples)
                try:
                    self._decode(entry, self._check_bytes(entry, data))
                    report.bytes_checked += entry.nbytes
                except CacheCorruptError as exc:
                    report.damaged.append(
                        ShardProblem(self._url(self._path(entry.shard)), str(exc))
                    )
        with storage_errors(self.url, "list", self._options):
            shard_paths = list_dir(self.fs, self._path("shards"))
        committed = {self._path(e.shard) for e in entries}
        report.orphans = [
            self._url(p) for p in shard_paths if p.endswith(".safetensors") and p not in committed
        ]
        return report

    def stats(self) -> CacheStats:
        """Samples, shards, shard bytes and duplicated sample keys, from the index alone."""
        self._load_index()
        with self._lock:
            entries = list((self._entries or {}).values())
            owner = dict(self._owner)
        counts: dict[str, int] = {}
        for entry in entries:
            for key in entry.samples:
                counts[key] = counts.get(key, 0) + 1
        dups = sorted(k for k, n in counts.items() if n > 1)
        return CacheStats(
            samples=len(owner),
            shards=len(entries),
            bytes=sum(e.nbytes for e in entries),
            duplicates=len(dups),
            duplicate_keys=dups,
        )


def _byte_groups(entries: list[IndexEntry], limit: int) -> list[list[IndexEntry]]:
    """Split entries into consecutive groups of at most `limit` shard bytes (at least one each)."""
    groups: list[list[IndexEntry]] = []
    size = 0
    for entry in entries:
        if not groups or size + entry.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    return groups
