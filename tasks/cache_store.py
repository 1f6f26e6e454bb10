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
import re
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from splitstage.splitter import UserError
from splitstage.tasks.storage import (
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

FORMAT_VERSION = 1
META_KEY = "splitstage"  # ONE metadata key: safetensors writes several keys in random order
_NAME_RE = re.compile(r"^[A-Za-z0-9_=-][A-Za-z0-9_.=-]*$")
_JSON_SCALARS = (str, int, float, bool, type(None))
_READ_BATCH_BYTES = 256 * 2**20


class CacheCorruptError(UserError, RuntimeError):
    """A shard or index entry is damaged or missing; the message names the file and the fix."""


class SampleNotCachedError(UserError, KeyError):
    """Asked for sample keys that have no committed index entry."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ShardInfo:
    """What `write_shard` committed: the shard's id, file, size, checksum and sample keys."""

    shard_id: str
    path: str
    nbytes: int
    sha256: str
    sample_keys: tuple[str, ...]


@dataclass(frozen=True)
class IndexEntry:
    """One parsed index file: the shard it commits and each sample's params (spec or 'json')."""

    shard_id: str
    shard: str
    nbytes: int
    sha256: str
    samples: Mapping[str, Mapping[str, Any]]


@dataclass
class CacheStats:
    """Counts from the index alone (no shard reads): unique samples, shards, shard bytes."""

    samples: int
    shards: int
    bytes: int
    duplicates: int
    duplicate_keys: list[str] = field(default_factory=list)


@dataclass
class ShardProblem:
    """One damaged shard or index entry found by `verify`, with what is wrong and the fix."""

    path: str
    problem: str


@dataclass
class VerifyReport:
    """Result of `CacheStore.verify`: what was checked and every damaged or orphaned file."""

    url: str
    shards_checked: int = 0
    samples: int = 0
    bytes_checked: int = 0
    damaged: list[ShardProblem] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no shard or index entry is damaged (orphans are harmless)."""
        return not self.damaged

    def lines(self) -> list[str]:
        """Human-readable report, one finding per line."""
        head = (
            f"{self.url}: {self.shards_checked} shards, {self.samples} samples, "
            f"{self.bytes_checked} bytes checked: {'OK' if self.ok else 'DAMAGED'}"
        )
        out = [head]
        out += [f"  damaged {p.path}: {p.problem}" for p in self.damaged]
        out += [f"  orphan {p} (shard without index entry; rerun preprocess)" for p in self.orphans]
        return out


def _check_name(kind: str, name: Any) -> str:
    """Validate a cache key or sample key: a non-empty name without '/' or spaces."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{kind} {name!r} is not a valid name: use letters, digits, '_', '.', '-' or '=', "
            f"not starting with '.' (a hex content hash is typical)"
        )
    return name


def _check_json(value: Any, where: str) -> None:
    """Raise TypeError naming `where` unless `value` is a JSON value (no tuples/sets/objects)."""
    if isinstance(value, _JSON_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a non-string dict key {key!r}; JSON keys are strings")
            _check_json(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; the cache stores "
        f"torch.Tensor values or JSON values (str, int, float, bool, None, lists, dicts): "
        f"convert it in the unit that produces it"
    )


def _sole_owner(value: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """A detached, contiguous CPU tensor owning its whole storage (views and shared storage are
    cloned: safetensors writes whole storages)."""
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    storage = t.untyped_storage()
    if storage.nbytes() != t.nbytes or storage.data_ptr() in seen:
        t = t.clone()
        storage = t.untyped_storage()
    seen.add(storage.data_ptr())
    return t


def _digest(t: torch.Tensor) -> bytes:
    """Content hash of a contiguous CPU tensor's bytes."""
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return hashlib.blake2b(raw, digest_size=16).digest()


def encode_shard(samples: Mapping[str, Mapping[str, Any]]) -> tuple[bytes, dict[str, Any]]:
    """Serialise samples into safetensors bytes; return them and the index's per-sample specs."""
    if not samples:
        raise ValueError("write_shard got no samples: pass {sample_key: {param: value}}")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    specs: dict[str, dict[str, Any]] = {}
    seen_storage: set[int] = set()
    by_content: dict[tuple, str] = {}  # identical tensors (e.g. the empty-prompt embedding)
    for key in sorted(samples):
        _check_name("sample key", key)
        params = samples[key]
        if not isinstance(params, Mapping):
            raise TypeError(f"sample {key!r} must map param name -> value, got {type(params)}")
        specs[key] = {}
        for param in sorted(params):
            value = params[param]
            if not isinstance(param, str) or not param:
                raise TypeError(f"sample {key!r} has a param name {param!r}; use a non-empty str")
            if isinstance(value, torch.Tensor):
                t = _sole_owner(value, seen_storage)
                spec = {"dtype": str(t.dtype)[6:], "shape": list(t.shape)}
                content = (spec["dtype"], tuple(t.shape), _digest(t))
                if content in by_content:  # stored once per shard, named by every sample
                    spec["same_as"] = by_content[content]
                else:
                    by_content[content] = f"{key}/{param}"
                    tensors[f"{key}/{param}"] = t
                specs[key][param] = spec
            else:
                _check_json(value, f"param {param!r} of sample {key!r}")
                values.setdefault(key, {})[param] = value
                specs[key][param] = "json"
    blob = {"format": FORMAT_VERSION, "values": values}
    meta = {META_KEY: json.dumps(blob, sort_keys=True, separators=(",", ":"), allow_nan=True)}
    return st_save(tensors, metadata=meta), specs


def _read_metadata(data: bytes) -> dict[str, str]:
    """Parse the safetensors header (JSON, never pickle) and return its metadata."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    return header.get("__metadata__") or {}


def decode_shard(data: bytes, entry: IndexEntry) -> dict[str, dict[str, Any]]:
    """Parse verified shard bytes into {sample_key: {param: value}} as listed by the index."""
    tensors = st_load(data)
    values = json.loads(_read_metadata(data)[META_KEY])["values"]
    out: dict[str, dict[str, Any]] = {}
    for key, params in entry.samples.items():
        sample: dict[str, Any] = {}
        for param, spec in params.items():
            if spec == "json":
                sample[param] = values[key][param]
            else:
                sample[param] = tensors[spec.get("same_as", f"{key}/{param}")]
        out[key] = sample
    return out


class CacheStore:
    """The cache under `<url>/<cache_key>/`: write shards, list committed samples, read, verify."""

    def __init__(
        self, url: str, cache_key: str, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        _check_name("cache key", cache_key)
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
        _check_json(dict(manifest), "manifest")
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
