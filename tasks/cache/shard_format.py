"""The cache's shard format: safetensors bytes holding many samples, their index entries, checks.

Tensors are named `<sample_key>/<param>` (identical tensors of a shard stored once, named by every
sample); non-tensor values are JSON in ONE metadata key. Nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
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
    """Parse verified shard bytes into {sample_key: {param: value}} as listed by the index."""
    tensors = st_load(data)
    values = json.loads(read_metadata(data)[META_KEY])["values"]
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
