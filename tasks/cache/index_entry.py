"""Index entries of the cache: what one `index/<shard_id>.json` says, parsed and validated.

An entry commits one shard: its file, byte size, sha256 and each sample's params (a spec
{"dtype", "shape", "same_as"?} per tensor, "json" per JSON value). Format 2 holds a table of
distinct spec maps and a row number per sample; format 1 (a spec map per sample) is still read.
Parsing never trusts the bytes: every field is checked and a bad entry is a CacheCorruptError.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitstage.tasks.cache.cache_errors import CacheCorruptError

FORMAT_VERSION = 2  # 2: index entries hold a table of distinct param specs; 1 is still read
NAME_RE = re.compile(r"^[A-Za-z0-9_=-][A-Za-z0-9_.=-]*$")
_KEYS_RE = re.compile(r"(?:[A-Za-z0-9_=-][A-Za-z0-9_.=-]*\n)+")  # many names, one per line


class SampleSpecs(Mapping[str, Mapping[str, Any]]):
    """An entry's samples, key -> {param: spec}, each spec map shared from a table of distinct
    ones (an entry's samples mostly have identical params: one table row for the whole shard)."""

    __slots__ = ("index", "table")

    def __init__(self, table: list[Mapping[str, Any]], index: dict[str, int]) -> None:
        self.table, self.index = table, index

    def __getitem__(self, key: str) -> Mapping[str, Any]:
        return self.table[self.index[key]]

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


@dataclass(frozen=True)
class IndexEntry:
    """One parsed index file: the shard it commits and each sample's params (spec or 'json')."""

    shard_id: str
    shard: str
    nbytes: int
    sha256: str
    samples: Mapping[str, Mapping[str, Any]]


def seen_digest(data: bytes) -> bytes:
    """A 16-byte digest of an index entry's bytes: what tells a rewrite (quarantine, snapshot)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def spec_key(params: Mapping[str, Any]) -> tuple:
    """A hashable form of valid {param: spec} (cheaper than canonical JSON, as unique)."""
    return tuple(
        (p, spec)
        if spec == "json"
        else (p, spec["dtype"], tuple(spec["shape"]), spec.get("same_as"))
        for p, spec in sorted(params.items())
    )


def spec_table(samples: Mapping[str, Mapping[str, Any]]) -> SampleSpecs:
    """Per-sample param specs as a deduplicated table (rows in first-use order)."""
    table: list[Mapping[str, Any]] = []
    rows: dict[tuple, int] = {}
    index: dict[str, int] = {}
    for key, params in samples.items():
        index[key] = row = rows.setdefault(spec_key(params), len(table))
        if row == len(table):
            table.append(params)
    return SampleSpecs(table, index)


def check_name(kind: str, name: Any) -> str:
    """Validate a cache key or sample key: a non-empty name without '/' or spaces."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"{kind} {name!r} is not a valid name: use letters, digits, '_', '.', '-' or '=', "
            f"not starting with '.' (a hex content hash is typical)"
        )
    return name


def all_names(keys: list[str] | tuple[str, ...]) -> bool:
    """True when every one of many str is a valid sample key (one regex pass over them all)."""
    joined = "\n".join(keys) + "\n"
    return not keys or (joined.count("\n") == len(keys) and bool(_KEYS_RE.fullmatch(joined)))


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


def bad_params(params: Any) -> list[str] | None:
    """The params of a {param: spec} map whose spec is bad ([] when all good), None when it is
    not a non-empty map."""
    if not isinstance(params, dict) or not params:
        return None
    return [p for p, spec in params.items() if _bad_spec(spec)]


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
    fields += (("specs", list),) if raw.get("format") == 2 else ()
    for name, kind in fields:
        if not isinstance(raw.get(name), kind) or isinstance(raw.get(name), bool):
            raise CacheCorruptError(f"{where} has a missing or bad field '{name}'; {fix}")
    if raw["shard"] != shard_file(shard_id) or raw["bytes"] < 0 or not raw["samples"]:
        raise CacheCorruptError(
            f"{where} names shard {raw['shard']!r} (expected {shard_file(shard_id)!r}), "
            f"{raw['bytes']} bytes and {len(raw['samples'])} samples; {fix}"
        )
    samples = _v2_samples(raw) if raw["format"] == 2 else _v1_samples(raw)
    if isinstance(samples, tuple):
        key, bad = samples
        raise CacheCorruptError(f"{where} has a bad entry for sample {key!r} {bad}; {fix}")
    return IndexEntry(shard_id, raw["shard"], raw["bytes"], raw["sha256"], samples)


def _v1_samples(raw: dict[str, Any]) -> SampleSpecs | tuple[str, list[str]]:
    """Format 1: `samples` maps each key to its {param: spec}; (key, bad params) if one is bad."""
    for key, params in raw["samples"].items():
        bad = bad_params(params)
        if not NAME_RE.match(key) or bad is None or bad:
            return key, bad or []
    return spec_table(raw["samples"])


def _v2_samples(raw: dict[str, Any]) -> SampleSpecs | tuple[str, list[str]]:
    """Format 2: `specs` lists distinct {param: spec} maps, `samples` maps each key to a row;
    (key, bad params) for the first sample whose key, row or specs are bad."""
    table, samples = raw["specs"], raw["samples"]
    bad_rows = [bad_params(params) for params in table]
    rows = set(map(type, samples.values())) == {int} and set(samples.values())
    keys_ok = all_names(list(samples))
    if not (keys_ok and rows and all(0 <= r < len(table) and bad_rows[r] == [] for r in rows)):
        for key, row in samples.items():  # the first bad one, for the message
            fits = type(row) is int and 0 <= row < len(table)
            bad = bad_rows[row] if fits else None
            if not NAME_RE.match(key) or bad is None or bad:
                return key, bad or []
    unused = next((i for i, bad in enumerate(bad_rows) if bad is None or bad), None)
    if unused is not None:
        return f"(specs row {unused}, used by none)", bad_rows[unused] or []
    return SampleSpecs(table, raw["samples"])
