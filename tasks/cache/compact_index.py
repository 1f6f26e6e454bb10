"""The committed index of a cache as arrays: a million samples in tens of bytes each.

Rows are (sample key, shard, spec) for every sample of every committed index entry, sorted by key
then shard id, so the owner of a key (the lowest shard id, which readers use) is its first row.
Keys are encoded as `KeyTable` encodes them, shards are numbers into the sorted shard ids, specs
numbers into a table of distinct {param: spec} maps. `entry(n)` rebuilds one `IndexEntry` when
its shard is read or checked. Built from entries in chunks, so that no million str stay alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numpy as np

import splitstage.tasks.cache.shard_format as fmt
from splitstage.tasks.cache.cache_errors import CacheCorruptError
from splitstage.tasks.cache.group_labels import ImageSizes, group_labels
from splitstage.tasks.cache.index_entry import bad_params
from splitstage.tasks.cache.key_table import KeyTable, _as_ascii, _encode

_CHUNK = 1024  # entries parsed between conversions to arrays


def _strings(values: list[str]) -> np.ndarray:
    """Names (shard ids, checksums) as a UTF-8 bytes array (sorts as the str sort)."""
    return np.array([v.encode() for v in values], "S") if values else np.zeros(0, "S1")


def signature(params: Mapping[str, Any], sequences: Collection[str] = ()) -> tuple:
    """What batches must share: each param's dtype and shape, or 'json' (`same_as` ignored);
    of `sequences` (padded per batch to one length) not the length: dim 0 reads -1."""
    return tuple(
        (p, "json") if spec == "json" else (p, spec["dtype"], _shape(spec["shape"], p in sequences))
        for p, spec in sorted(params.items())
    )


def _shape(shape: list[int], sequence: bool) -> tuple[int, ...]:
    """A spec's shape, its dim 0 as -1 for a sequence param (any length batches together)."""
    return (-1, *shape[1:]) if sequence and shape else tuple(shape)


def group_table(
    specs: list[Mapping[str, Any]], image_sizes: ImageSizes = None, sequences: Collection[str] = ()
) -> tuple[np.ndarray, list[str]]:
    """For a spec table: each spec's group number (groups in sorted-signature order, so every
    process numbers them alike) and a readable, distinct label per group (led by its images'
    size in pixels when `image_sizes` tell it: `group_labels`); `sequences`: params of any
    length in dim 0 (see `signature`)."""
    sigs = [signature(params, sequences) for params in specs]
    order = sorted(set(sigs), key=repr)
    number = {sig: i for i, sig in enumerate(order)}
    labels = group_labels(order, image_sizes)
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        labels[i] = label if seen[label] == 1 else f"{label} #{seen[label]}"
    return np.array([number[s] for s in sigs], np.int32), labels


class CompactIndex:
    """Immutable arrays of a cache's committed index (see the module docstring)."""

    def __init__(
        self,
        shards: dict[str, np.ndarray],
        rows: dict[str, np.ndarray],
        hexed: bool,
        specs: list[Mapping[str, Any] | bytes],
        spec_ids: dict[tuple | bytes, int],
        spec_base: list[int],
    ) -> None:
        self.shard_ids, self.shard_bytes = shards["ids"], shards["nbytes"]
        self.shard_sha, self.shard_seen = shards["sha"], shards["seen"]
        self.keys, self.hexed = rows["keys"], hexed
        self.shard, self.spec = rows["shard"], rows["spec"]
        self.specs, self.spec_ids, self.spec_base = specs, spec_ids, spec_base
        self.by_shard = np.argsort(self.shard, kind="stable").astype(np.int32)
        self.starts = np.searchsorted(self.shard[self.by_shard], np.arange(len(self.shard_ids) + 1))
        first = np.ones(len(self.keys), bool)
        first[1:] = self.keys[1:] != self.keys[:-1]
        self.unique = None if first.all() else np.flatnonzero(first)  # None: no duplicates
        self._groups: tuple[np.ndarray, list[str]] | None = None

    def _owned(self, column: np.ndarray) -> np.ndarray:
        """A row column restricted to each key's owner row."""
        return column if self.unique is None else column[self.unique]

    def table(self) -> KeyTable:
        """The distinct committed keys."""
        return KeyTable.from_sorted(self._owned(self.keys), self.hexed)

    def lookup(self, keys: Iterable[str] | KeyTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each key of `keys`: committed?, its owner's shard number, its owner's spec."""
        pos, found = self.table().positions(keys)
        if not len(self.keys):
            return found, pos.astype(np.int32), pos.astype(np.int32)
        return found, self._owned(self.shard)[pos], self._owned(self.spec)[pos]

    def shard_number(self, shard_id: str) -> int | None:
        """The number of a committed shard id, None when it has no entry."""
        want = np.array([shard_id.encode()], "S")
        n = int(np.searchsorted(self.shard_ids, want)[0])
        return n if n < len(self.shard_ids) and self.shard_ids[n] == want[0] else None

    def seen(self, n: int) -> bytes:
        """The digest of shard number `n`'s entry bytes as read (b"" when not known)."""
        raw = self.shard_seen[n : n + 1].tobytes()
        return raw if raw.strip(b"\0") else b""

    def shard_id(self, n: int) -> str:
        """The shard id of shard number `n`."""
        return self.shard_ids[n].decode()

    def entry(self, n: int) -> fmt.IndexEntry:
        """The index entry of shard number `n`, rebuilt from the arrays."""
        rows = self.by_shard[self.starts[n] : self.starts[n + 1]]
        keys = KeyTable.from_sorted(self.keys[rows], self.hexed).to_list()
        local: dict[int, int] = {}
        index = {k: local.setdefault(int(s), len(local)) for k, s in zip(keys, self.spec[rows])}
        table = [self.spec_map(s) for s in local]
        sid = self.shard_id(n)
        sha = self.shard_sha[n].decode()
        nbytes = int(self.shard_bytes[n])
        return fmt.IndexEntry(sid, fmt.shard_file(sid), nbytes, sha, fmt.SampleSpecs(table, index))

    def entries(self) -> list[fmt.IndexEntry]:
        """Every committed entry, in shard id order."""
        return [self.entry(n) for n in range(len(self.shard_ids))]

    def duplicate_keys(self) -> list[str]:
        """Keys committed by more than one shard, sorted."""
        if self.unique is None:
            return []
        counts = np.diff(np.append(self.unique, len(self.keys)))
        dups = self.keys[self.unique[counts > 1]]
        return KeyTable.from_sorted(dups, self.hexed).to_list()

    def spec_map(self, number: int) -> Mapping[str, Any]:
        """Spec map `number` (those naming a `same_as` tensor are kept as their JSON bytes: one
        per shard that stores a tensor once, e.g. the empty-prompt embedding)."""
        spec = self.specs[number]
        if not isinstance(spec, bytes):
            return spec
        try:  # validated here, when used (a snapshot holds tens of thousands)
            params = json.loads(spec)
        except ValueError:
            params = None
        if bad_params(params) != []:
            raise CacheCorruptError(
                f"the cache index holds a bad param spec {spec[:80]!r}; rerun preprocess (it "
                "rewrites the index snapshot)"
            )
        return params

    def groups(
        self, image_sizes: ImageSizes = None, sequences: Collection[str] = ()
    ) -> tuple[np.ndarray, list[str]]:
        """Each spec's group number and the groups' labels (see `group_table`; a store passes
        the same `image_sizes` and `sequences` every time); a spec with `same_as` is in the
        group of the same spec without it."""
        if self._groups is None:
            base = np.asarray(self.spec_base, np.int64)
            plain = np.flatnonzero(base == np.arange(len(base)))
            specs = [self.specs[i] for i in plain]
            numbers, labels = group_table(specs, image_sizes, sequences)
            of_plain = np.zeros(len(base), np.int32)
            of_plain[plain] = numbers
            self._groups = of_plain[base], labels
        return self._groups

    def group_counts(
        self, image_sizes: ImageSizes = None, sequences: Collection[str] = ()
    ) -> dict[str, int]:
        """Committed samples per group label."""
        of_spec, labels = self.groups(image_sizes, sequences)
        counts = np.bincount(of_spec[self._owned(self.spec)], minlength=len(labels))
        return {label: int(n) for label, n in zip(labels, counts) if n}


class IndexBuilder:
    """Collects index entries (a later entry of a shard replaces an earlier one, a `base` index
    comes first) and builds a `CompactIndex`, turning each chunk of entries into arrays."""

    def __init__(self, base: CompactIndex | None = None) -> None:
        self.specs: list[Mapping[str, Any] | bytes] = list(base.specs) if base else []
        self.spec_ids: dict[tuple | bytes, int] = dict(base.spec_ids) if base else {}
        self.spec_base: list[int] = list(base.spec_base) if base else []
        self._shards: list[dict[str, np.ndarray]] = []
        self._rows: list[tuple[np.ndarray, bool, np.ndarray, np.ndarray]] = []
        self._records = 0
        self._new: dict[str, list] = {"ids": [], "nbytes": [], "sha": [], "seen": []}
        self._keys: list[str] = []
        self._rec: list[np.ndarray] = []
        self._spec: list[np.ndarray] = []
        if base is not None:
            shards = {"ids": base.shard_ids, "nbytes": base.shard_bytes}
            self._shards.append(shards | {"sha": base.shard_sha, "seen": base.shard_seen})
            self._rows.append((base.keys, base.hexed, base.shard.astype(np.int64), base.spec))
            self._records = len(base.shard_ids)

    def _spec_id(self, params: Mapping[str, Any]) -> int:
        """The number of a {param: spec} map in the interned table."""
        aliased = any(spec != "json" and "same_as" in spec for spec in params.values())
        key = canonical(params) if aliased else fmt.spec_key(params)
        number = self.spec_ids.get(key)
        if number is None:
            plain = {
                p: v if v == "json" else {"dtype": v["dtype"], "shape": v["shape"]}
                for p, v in params.items()
            }
            base = self._spec_id(plain) if aliased else len(self.specs)
            number = self.spec_ids[key] = len(self.specs)
            self.specs.append(key if aliased else params)
            self.spec_base.append(base)
        return number

    def add(self, entry: fmt.IndexEntry, seen: bytes = b"") -> None:
        """Add one parsed entry; `seen` is the digest of its bytes as read."""
        samples = entry.samples
        if not isinstance(samples, fmt.SampleSpecs):
            samples = fmt.spec_table(samples)
        numbers = np.array([self._spec_id(p) for p in samples.table], np.int32)
        self._keys.extend(samples.index)
        rows = np.fromiter(samples.index.values(), np.int32, len(samples.index))
        self._spec.append(numbers[rows])
        self._rec.append(np.full(len(rows), self._records, np.int64))
        self._records += 1
        for name, value in zip(self._new, (entry.shard_id, entry.nbytes, entry.sha256, seen)):
            self._new[name].append(value)
        if len(self._new["ids"]) >= _CHUNK:
            self._flush()

    def add_all(self, entries: Iterable[fmt.IndexEntry]) -> IndexBuilder:
        """Add many entries (digests unknown)."""
        for entry in entries:
            self.add(entry)
        return self

    def _flush(self) -> None:
        """Turn the entries added since the last flush into arrays."""
        if not self._new["ids"]:
            return
        new = self._new
        self._shards.append(
            {
                "ids": _strings(new["ids"]),
                "nbytes": np.array(new["nbytes"], np.int64),
                "sha": _strings(new["sha"]),
                "seen": np.array(new["seen"], "S16"),
            }
        )
        keys, hexed = _encode(self._keys)
        self._rows.append((keys, hexed, np.concatenate(self._rec), np.concatenate(self._spec)))
        self._new = {name: [] for name in new}
        self._keys, self._rec, self._spec = [], [], []

    def build(self) -> CompactIndex:
        """The index of everything added."""
        self._flush()
        shards = {
            name: np.concatenate([c[name] for c in self._shards]) if self._shards else empty
            for name, empty in (
                ("ids", np.zeros(0, "S1")),
                ("nbytes", np.zeros(0, np.int64)),
                ("sha", np.zeros(0, "S1")),
                ("seen", np.zeros(0, "S16")),
            )
        }
        order = np.argsort(shards["ids"], kind="stable")
        ids = shards["ids"][order]
        last = np.ones(len(ids), bool)  # the latest record of each shard id wins
        last[:-1] = ids[1:] != ids[:-1]
        kept = order[last]
        number = np.full(self._records, -1, np.int64)
        number[kept] = np.arange(len(kept))
        shards = {name: column[kept] for name, column in shards.items()}
        keys, hexed = _join_keys([(k, h) for k, h, _, _ in self._rows])
        records = [r for _, _, r, _ in self._rows] or [np.zeros(0, np.int64)]
        shard = number[np.concatenate(records)]
        spec = np.concatenate([s for _, _, _, s in self._rows] or [np.zeros(0, np.int32)])
        live = shard >= 0
        keys, shard, spec = keys[live], shard[live].astype(np.int32), spec[live]
        rows = np.lexsort((shard, keys))
        columns = {"keys": keys[rows], "shard": shard[rows], "spec": spec[rows].astype(np.int32)}
        return CompactIndex(shards, columns, hexed, self.specs, self.spec_ids, self.spec_base)


def canonical(params: Mapping[str, Any]) -> bytes:
    """Compact canonical JSON of a spec map (how aliased specs are kept, and snapshotted)."""
    return json.dumps(params, sort_keys=True, separators=(",", ":")).encode()


def release_freed_memory() -> None:
    """Hand the C heap freed after parsing the index back to the OS (glibc keeps it otherwise:
    about 90 bytes per sample of resident memory after a million-sample load)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _join_keys(parts: list[tuple[np.ndarray, bool]]) -> tuple[np.ndarray, bool]:
    """Concatenate encoded key arrays, re-encoding all as ASCII when their encodings differ."""
    parts = [(k, h) for k, h in parts if len(k)]
    if not parts:
        return np.zeros(0, "S1"), False
    if all(h for _, h in parts) and len({k.dtype for k, _ in parts}) == 1:
        return np.concatenate([k for k, _ in parts]), True
    width = max(k.dtype.itemsize * (2 if h else 1) for k, h in parts)
    return np.concatenate([_as_ascii(k, h, width) for k, h in parts]), False
