"""The cache's shard format: safetensors bytes holding many samples, and a shard's checks.

Tensors are named `<sample_key>/<param>` (identical tensors of a shard stored once, named by every
sample); non-tensor values are JSON in ONE metadata key. Nothing here unpickles. Index entries
(what commits a shard) are parsed in `index_entry`; their names are re-exported here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch
from safetensors.torch import load as st_load

from splitstage.storage.safetensors_io import read_metadata
from splitstage.tasks.cache.cache_errors import (  # noqa: F401  (re-exported: importers use fmt.X)
    CacheCorruptError,
    CacheNotFoundError,
    SampleNotCachedError,
)
from splitstage.tasks.cache.index_entry import (  # noqa: F401  (re-exported, as above)
    FORMAT_VERSION,
    IndexEntry,
    SampleSpecs,
    check_name,
    index_file,
    parse_index_entry,
    shard_file,
    spec_key,
    spec_table,
)
from splitstage.tasks.cache.shard_encode import Dedupe, flat_bytes, serialize

META_KEY = "splitstage"  # ONE metadata key: safetensors writes several keys in random order
_JSON_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class ShardInfo:
    """What `write_shard` committed: the shard's id, file, size, checksum and sample keys."""

    shard_id: str
    path: str
    nbytes: int
    sha256: str
    sample_keys: tuple[str, ...]


@dataclass
class CacheStats:
    """Counts from the index alone (no shard reads): unique samples, shards, shard bytes."""

    samples: int
    shards: int
    bytes: int
    duplicates: int
    duplicate_keys: list[str] = field(default_factory=list)
    buckets: dict[str, int] = field(default_factory=dict)  # bucket (param-spec group) -> samples


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
    temp_files_removed: int = 0  # an interrupted writer's temporary files deleted
    bytes_reclaimed: int = 0  # their bytes

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
        out += [f"  orphan {p} (shard without index entry; {fix})" for p in self.orphans]
        if self.temp_files_removed:
            out.append(f"  {reclaimed_text(self.temp_files_removed, self.bytes_reclaimed)}")
        return out


def reclaimed_text(files: int, nbytes: int) -> str:
    """What a sweep of an interrupted writer's temporary files gave back, in words."""
    return (
        f"removed {files} unfinished temporary file(s) an interrupted run left "
        f"({nbytes / 1e6:.2f} MB reclaimed)"
    )


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
    t = value.detach() if value.requires_grad else value
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    storage = t.untyped_storage()
    if storage.nbytes() != t.nbytes or storage.data_ptr() in seen:
        t = t.clone()
        storage = t.untyped_storage()
    seen.add(storage.data_ptr())
    return t


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the dtype as the index entry names it."""
    return str(dtype)[6:]


def encode_shard(samples: Mapping[str, Mapping[str, Any]]) -> tuple[bytes, dict[str, Any]]:
    """Serialise samples into safetensors bytes; return them and the index's per-sample specs."""
    if not samples:
        raise ValueError("write_shard got no samples: pass {sample_key: {param: value}}")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    specs: dict[str, dict[str, Any]] = {}
    seen_storage: set[int] = set()
    dedupe = Dedupe()  # identical tensors (e.g. the empty-prompt embedding)
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
                spec = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
                name, raw = f"{key}/{param}", flat_bytes(t)
                same = dedupe.first(t, name, raw)
                if same is not None:  # stored once per shard, named by every sample
                    spec["same_as"] = same
                else:
                    tensors[name] = t
                specs[key][param] = spec
            else:
                if not isinstance(value, _JSON_SCALARS):  # (the common case, checked first)
                    check_json(value, f"param {param!r} of sample {key!r}")
                values.setdefault(key, {})[param] = value
                specs[key][param] = "json"
    blob = {"format": FORMAT_VERSION, "values": values}
    meta = {META_KEY: json.dumps(blob, sort_keys=True, separators=(",", ":"), allow_nan=True)}
    return serialize(tensors, meta), specs


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


def prepare_shard(samples: Mapping[str, Mapping[str, Any]]) -> tuple[ShardInfo, bytes, bytes]:
    """Encode one shard: its info, shard bytes and index-entry bytes (the id hashes the bytes)."""
    data, specs = encode_shard(samples)
    digest = hashlib.sha256(data).hexdigest()
    info = ShardInfo(digest[:32], shard_file(digest[:32]), len(data), digest, tuple(specs))
    entry = {"format": FORMAT_VERSION, "shard": info.path, "bytes": info.nbytes}
    table = spec_table(specs)
    entry |= {"sha256": digest, "specs": table.table, "samples": table.index}
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
