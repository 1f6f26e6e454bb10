"""The cache's shard format: safetensors bytes holding many samples, their index entries, checks.

Tensors are named `<sample_key>/<param>` (identical tensors of a shard stored once, named by every
sample); non-tensor values are JSON in ONE metadata key. Nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from splitstage.pipelines.safetensors_io import read_metadata
from splitstage.splitter import UserError

FORMAT_VERSION = 1
META_KEY = "splitstage"  # ONE metadata key: safetensors writes several keys in random order
_NAME_RE = re.compile(r"^[A-Za-z0-9_=-][A-Za-z0-9_.=-]*$")
_JSON_SCALARS = (str, int, float, bool, type(None))


class CacheCorruptError(UserError, RuntimeError):
    """A shard or index entry is damaged or missing; the message names the file and the fix."""


class CacheNotFoundError(UserError, FileNotFoundError):
    """The cache (its folder, its bucket or the cache-key folder under it) does not exist."""


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
    """A damaged shard or index entry: the file, what is wrong, the shard id and (when the entry
    was readable) its sample keys. `kind`: index, missing, size, content, params or manifest."""

    path: str
    problem: str
    shard_id: str = ""
    samples: tuple[str, ...] = ()
    kind: str = ""


@dataclass
class VerifyReport:
    """Result of `CacheStore.check` / `verify`: what was checked (`checksums`: "all", "changed"
    or "none"), damaged and orphaned files, samples left without an intact copy (`lost`), those
    the manifest lists that are not committed (`missing`), index entries moved aside."""

    url: str
    shards_checked: int = 0
    samples: int = 0
    bytes_checked: int = 0
    damaged: list[ShardProblem] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    manifest_samples: int | None = None
    checksums: str = "all"
    quarantined: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is damaged and every manifest sample is committed (orphans: ok)."""
        return not self.damaged and not self.missing

    def lines(self, fix: str = "rerun preprocess") -> list[str]:
        """Human-readable report, one finding per line; `fix` is the command that repairs."""
        state = "OK" if self.ok else ("DAMAGED" if self.damaged else "INCOMPLETE")
        out = [
            f"{self.url}: {self.shards_checked} shards, {self.samples} samples, "
            f"{self.bytes_checked} bytes checked: {state}"
        ]
        out += [f"  damaged {p.path}: {p.problem}" for p in self.damaged]
        if self.missing:
            out.append(
                f"  missing {len(self.missing)} of the {self.manifest_samples} samples the "
                f"manifest lists have no intact copy (e.g. {', '.join(self.missing[:3])}); {fix}"
            )
        return out + [f"  orphan {p} (shard without index entry; {fix})" for p in self.orphans]


def check_name(kind: str, name: Any) -> str:
    """Validate a cache key or sample key: a non-empty name without '/' or spaces."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{kind} {name!r} is not a valid name: use letters, digits, '_', '.', '-' or '=', "
            f"not starting with '.' (a hex content hash is typical)"
        )
    return name


def check_json(value: Any, where: str) -> None:
    """Raise TypeError naming `where` unless `value` is a JSON value (no tuples/sets/objects)."""
    if isinstance(value, _JSON_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a non-string dict key {key!r}; JSON keys are strings")
            check_json(item, f"{where}[{key!r}]")
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
        check_name("sample key", key)
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
                check_json(value, f"param {param!r} of sample {key!r}")
                values.setdefault(key, {})[param] = value
                specs[key][param] = "json"
    blob = {"format": FORMAT_VERSION, "values": values}
    meta = {META_KEY: json.dumps(blob, sort_keys=True, separators=(",", ":"), allow_nan=True)}
    return st_save(tensors, metadata=meta), specs


def decode_shard(data: bytes, entry: IndexEntry) -> dict[str, dict[str, Any]]:
    """Parse verified shard bytes into {sample_key: {param: value}} as listed by the index;
    ValueError when the shard does not hold what the index lists (name, dtype, shape)."""
    tensors = st_load(data)
    values = json.loads(read_metadata(data)[META_KEY])["values"]
    out: dict[str, dict[str, Any]] = {}
    for key, params in entry.samples.items():
        sample: dict[str, Any] = {}
        for param, spec in params.items():
            if spec == "json":
                if param not in values.get(key, {}):
                    raise ValueError(f"no JSON value {param!r} for sample {key}")
                sample[param] = values[key][param]
                continue
            name = spec.get("same_as", f"{key}/{param}")
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"no tensor {name!r}, which the index lists")
            got, want = (str(t.dtype)[6:], list(t.shape)), (spec["dtype"], list(spec["shape"]))
            if got != want:
                raise ValueError(
                    f"tensor {name!r} is {got[0]} {got[1]}, the index says {want[0]} {want[1]}"
                )
            sample[param] = t
        out[key] = sample
    return out


def shard_file(shard_id: str) -> str:
    """Relative path of a shard file."""
    return f"shards/{shard_id}.safetensors"


def index_file(shard_id: str) -> str:
    """Relative path of a shard's index entry."""
    return f"index/{shard_id}.json"


def _bad_spec(spec: Any) -> bool:
    """True unless `spec` is "json" or {"dtype": str, "shape": [int >= 0, ...], "same_as"?}."""
    if spec == "json":
        return False
    if not isinstance(spec, dict) or set(spec) - {"dtype", "shape", "same_as"}:
        return True
    shape, types = spec.get("shape"), (spec.get("dtype"), spec.get("same_as", ""))
    ints = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
    return not ints or not all(isinstance(t, str) for t in types)


def parse_index_entry(data: bytes, shard_id: str, url: str) -> IndexEntry:
    """Parse and validate one index entry (fields, shard name, sample keys, param specs);
    CacheCorruptError naming it (`url`) on any problem."""
    where = f"index entry {url}"
    fix = "rerun preprocess: it moves the entry aside and recomputes that shard's samples"
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CacheCorruptError(f"{where} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(raw, dict):
        raise CacheCorruptError(f"{where} is not a JSON object; {fix}")
    if isinstance(raw.get("format"), int) and raw["format"] > FORMAT_VERSION:
        raise CacheCorruptError(
            f"{where} has format {raw['format']}, newer than this splitstage reads "
            f"({FORMAT_VERSION}); upgrade splitstage"
        )
    fields = (("format", int), ("shard", str), ("bytes", int), ("sha256", str), ("samples", dict))
    for name, kind in fields:
        if not isinstance(raw.get(name), kind) or isinstance(raw.get(name), bool):
            raise CacheCorruptError(f"{where} has a missing or bad field '{name}'; {fix}")
    if raw["shard"] != shard_file(shard_id) or raw["bytes"] < 0 or not raw["samples"]:
        raise CacheCorruptError(
            f"{where} names shard {raw['shard']!r} (expected {shard_file(shard_id)!r}), "
            f"{raw['bytes']} bytes and {len(raw['samples'])} samples; {fix}"
        )
    for key, params in raw["samples"].items():
        bad = [p for p, spec in params.items() if _bad_spec(spec)] if params else []
        if not _NAME_RE.match(key) or not isinstance(params, dict) or not params or bad:
            raise CacheCorruptError(f"{where} has a bad entry for sample {key!r} {bad}; {fix}")
    return IndexEntry(shard_id, raw["shard"], raw["bytes"], raw["sha256"], raw["samples"])


def byte_groups(entries: list[IndexEntry], limit: int) -> list[list[IndexEntry]]:
    """Split entries into consecutive groups of at most `limit` shard bytes (at least one each)."""
    groups: list[list[IndexEntry]] = []
    size = limit + 1
    for entry in entries:
        if size + entry.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    return groups


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """Return a manifest (JSON bytes, or parsed) after checking its shape: an object whose
    'samples', when there, is a list of sample keys; CacheCorruptError naming `where`."""
    with contextlib.suppress(ValueError, RecursionError):
        manifest = json.loads(manifest) if isinstance(manifest, bytes) else manifest
    samples = manifest.get("samples", []) if isinstance(manifest, dict) else None
    if not isinstance(samples, list) or not all(isinstance(k, str) for k in samples):
        samples = None
    if samples is None or not all(_NAME_RE.match(k) for k in samples):
        raise CacheCorruptError(
            f"manifest {where} is not a splitstage manifest (not JSON, or 'samples' is not a list "
            f"of sample keys); rerun preprocess to rewrite it"
        )
    return manifest


def prepare_shard(samples: Mapping[str, Mapping[str, Any]]) -> tuple[ShardInfo, bytes, bytes]:
    """Encode one shard: its info, shard bytes and index-entry bytes (the id hashes the bytes)."""
    data, specs = encode_shard(samples)
    digest = hashlib.sha256(data).hexdigest()
    info = ShardInfo(digest[:32], shard_file(digest[:32]), len(data), digest, tuple(specs))
    entry = {"format": FORMAT_VERSION, "shard": info.path, "bytes": info.nbytes}
    entry |= {"sha256": digest, "samples": specs}
    return info, data, json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()


def repair_hint(entry: IndexEntry) -> str:
    """How messages about a damaged entry end: the fix."""
    n, index = len(entry.samples), index_file(entry.shard_id)
    return f"rerun preprocess: it moves {index} aside and recomputes the shard's {n} samples"


def shard_problem(
    entry: IndexEntry, size: int | None, data: bytes | None, url: str
) -> tuple[str, str] | None:
    """(kind, message) when a shard file is not what its index entry names: missing (`size`
    None), of another size, or (given its `data`) of another sha256."""
    digest = hashlib.sha256(data).hexdigest() if data is not None and size == entry.nbytes else ""
    kind = "missing" if size is None else "size" if size != entry.nbytes else "checksum"
    if kind == "checksum" and digest in ("", entry.sha256):
        return None
    what = {
        "missing": "is missing but its index entry exists",
        "size": f"has the wrong size: the index says {entry.nbytes} bytes, the file has {size}",
        "checksum": f"fails its checksum: sha256 is {digest[:16]}..., the index says "
        f"{entry.sha256[:16]}... (bytes changed in storage)",
    }[kind]
    return kind, f"shard file {url} {what}; {repair_hint(entry)}"


def params_problem(entry: IndexEntry, params: Any, index_url: str) -> tuple[str, str] | None:
    """("params", message) when a sample of an entry does not hold exactly `params` (if any)."""
    odd = [k for k, p in entry.samples.items() if params is not None and set(p) != set(params)]
    if not odd:
        return None
    return "params", (
        f"index entry {index_url} lists sample {odd[0]} with params "
        f"{sorted(entry.samples[odd[0]])}, but this job's stage 1 caches {sorted(params)} "
        f"(written by another version, or copied in?); {repair_hint(entry)}"
    )


def newer(shard: Mapping[str, Any] | None, index: Mapping[str, Any] | None) -> bool:
    """True when a shard file was modified after its index entry was written (an edit): times
    from a listing (local, S3, GCS, Azure, memory)."""
    times = []
    for info in (shard or {}, index or {}):
        for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
            value = info.get(name)
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                value = datetime.fromisoformat(value) if isinstance(value, str) else value
                times.append(value.timestamp() if isinstance(value, datetime) else float(value))
                break
    return len(times) == 2 and times[0] > times[1]
