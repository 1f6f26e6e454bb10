"""Content-addressed sample cache on object storage: stage 1 writes shards, stage 2 reads them.

Layout under `<url>/<cache_key>/`:
  shards/<shard_id>.safetensors  many samples; tensors named `<sample_key>/<param>`, non-tensor
                                 values as one JSON blob in the safetensors metadata
  index/<shard_id>.json          written only after its shard: byte size, sha256, sample params
  manifest.json                  written by the preprocessing coordinator
  quarantine/                    damaged index entries and shards moved aside, with the problem

`shard_id` hashes the shard bytes, so two workers writing the same samples write the same names.
A sample is visible only once its index entry exists. Reads check size and sha256 before parsing;
nothing is ever unpickled: a cache in a shared bucket cannot run code.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import splitstage.tasks.cache.shard_format as fmt
import splitstage.tasks.cache.storage as st
from splitstage.tasks.cache.shard_format import CacheCorruptError, SampleNotCachedError
from splitstage.tasks.cache.storage import storage_errors, write_chains

_READ_BATCH_BYTES = 256 * 2**20
QUARANTINE, encode_shard = "quarantine", fmt.encode_shard  # (encode_shard: importable from here)


class CacheStore:
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
        with storage_errors(self.url, "open", self._options):
            self.fs, root = st.open_fs(url, self._options)
        self.root = st.join(root, cache_key)
        self._lock = threading.Lock()
        self._entries: dict[str, fmt.IndexEntry] | None = None
        self._owner: dict[str, str] = {}
        self._seen: dict[str, bytes] = {}  # index entry bytes as last read, by shard id

    def __repr__(self) -> str:
        return f"CacheStore(url={self.url!r}, storage_options={st.redact(self._options)!r})"

    def _path(self, rel: str) -> str:
        """Absolute fs path of a file relative to the cache root."""
        return st.join(self.root, rel)

    def _url(self, path: str) -> str:
        """URL of an fs path, for messages (never contains credentials)."""
        return st.display_url(self.fs, path)

    # ---- writing ----------------------------------------------------------------------------
    def write_shard(self, samples: Mapping[str, Mapping[str, Any]]) -> fmt.ShardInfo:
        """Write one shard, then its index entry (the commit); idempotent for identical samples."""
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

        with storage_errors(self.url, "write shards under", self._options):
            write_chains(self.fs, chains())
        with self._lock:
            for info, index in done:
                self._seen[info.shard_id] = index
                if self._entries is not None:
                    self._add_entry(fmt.parse_index_entry(index, info.shard_id, info.path))
        return [info for info, _ in done]

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Write `manifest.json` atomically (the preprocessing coordinator's record of the run)."""
        fmt.check_json(dict(manifest), "manifest")
        fmt.check_manifest(dict(manifest), self._url(self._path("manifest.json")))
        data = json.dumps(manifest, sort_keys=True, indent=2).encode()
        with storage_errors(self.url, "write manifest under", self._options):
            st.write_atomic(self.fs, self._path("manifest.json"), data)

    def read_manifest(self) -> dict[str, Any] | None:
        """Return `manifest.json`, None when not written, CacheCorruptError when not a manifest."""
        path = self._path("manifest.json")
        (data,) = st.read_many(self.fs, [path])
        if isinstance(data, BaseException):
            st.raise_if_storage_error(data, self._url(path), "read", self._options)
            if isinstance(data, FileNotFoundError):
                return None
            raise data
        return fmt.check_manifest(data, self._url(path))

    # ---- the index ----------------------------------------------------------------------------
    def _list(self, rel: str, suffix: str | None) -> dict[str, dict[str, Any]]:
        """ONE listing of a folder: {path: fsspec info (size, mtime)} of its `suffix` files (of
        everything in it, folders too, when `suffix` is None); {} when there is no such folder."""
        path = self._path(rel) if rel else self.root
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)
        with storage_errors(self.url, "list", self._options):
            try:
                infos = self.fs.ls(path, detail=True)
            except (FileNotFoundError, NotADirectoryError) as exc:
                if st.error_code(exc) is not None:
                    raise
                return {}
        keep = (i for i in infos if i.get("type") == "file" and i["name"].endswith(suffix or ""))
        return {i["name"]: i for i in (infos if suffix is None else keep)}

    def _read_index(self) -> tuple[list[fmt.IndexEntry], list[fmt.ShardProblem], dict[str, Any]]:
        """List and read every index entry (one batched read): entries, bad ones, the listing."""
        listing = self._list("index", ".json")
        paths = sorted(listing)
        with storage_errors(self.url, "read the index of", self._options):
            datas = st.read_many(self.fs, paths)
        entries: list[fmt.IndexEntry] = []
        problems: list[fmt.ShardProblem] = []
        for path, data in zip(paths, datas):
            shard_id = path.rsplit("/", 1)[-1].removesuffix(".json")
            if isinstance(data, BaseException):
                st.raise_if_storage_error(data, self._url(path), "read", self._options)
                if isinstance(data, FileNotFoundError):
                    continue  # removed between listing and reading
                raise data
            self._seen[shard_id] = data
            try:
                entries.append(fmt.parse_index_entry(data, shard_id, self._url(path)))
            except CacheCorruptError as exc:
                problems.append(fmt.ShardProblem(self._url(path), str(exc), shard_id, (), "index"))
        return entries, problems, listing

    def _set_entries(self, entries: Iterable[fmt.IndexEntry]) -> None:
        """Replace the cached listing."""
        with self._lock:
            self._entries, self._owner = {}, {}
            for entry in sorted(entries, key=lambda e: e.shard_id):
                self._add_entry(entry)

    def _add_entry(self, entry: fmt.IndexEntry) -> None:
        """Add an entry to the cached listing; duplicates resolve to the lowest shard id."""
        assert self._entries is not None
        self._entries[entry.shard_id] = entry
        for key in entry.samples:
            owner = self._owner.get(key)
            if owner is None or entry.shard_id < owner:
                self._owner[key] = entry.shard_id

    def _load_index(self) -> None:
        """Read the index once (cached until `refresh()`); CacheCorruptError on a bad entry."""
        with self._lock:
            if self._entries is not None:
                return
        entries, problems, _ = self._read_index()
        if problems:
            raise CacheCorruptError(problems[0].problem)
        self._set_entries(entries)

    def refresh(self) -> None:
        """Forget the cached listing so the next call re-reads the index (see other writers)."""
        with self._lock:
            self._entries = None
            self._owner = {}

    def committed_keys(self) -> set[str]:
        """Sample keys with a committed index entry (listing cached until `refresh()`; after
        `check`, only those with an intact copy)."""
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

    def _entry(self, shard_id: str) -> fmt.IndexEntry:
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
    def _verified(self, entry: fmt.IndexEntry, data: bytes | BaseException) -> dict[str, Any]:
        """Check shard bytes against the index (size, sha256) and parse them (tensors as the
        index lists); CacheCorruptError naming the shard and the fix."""
        url = self._url(self._path(entry.shard))
        if isinstance(data, BaseException):
            st.raise_if_storage_error(data, url, "read", self._options)
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
        for group in fmt.byte_groups(entries, _READ_BATCH_BYTES):
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

    # ---- checks and repair ------------------------------------------------------------------
    def check(
        self,
        checksums: str = "changed",
        *,
        keys: Collection[str] | None = None,
        params: Collection[str] | None = None,
        touch: bool = False,
    ) -> fmt.VerifyReport:
        """Check the index against ONE listing of `shards/`: entries parse, shards exist with the
        size named, samples hold exactly `params` (if given); re-read shards (sha256, parse): all,
        those "changed" after their index entry, or "none"; given `keys`, only entries listing one.
        Damaged entries leave the listing, nothing moves; `touch` re-commits changed-but-good."""
        if checksums not in ("all", "changed", "none"):
            raise ValueError(f"checksums must be 'all', 'changed' or 'none', not {checksums!r}")
        report = fmt.VerifyReport(self.url, checksums=checksums)
        entries, report.damaged, index_info = self._read_index()
        shard_info = self._list("shards", ".safetensors")
        wanted = None if keys is None else set(keys)
        intact, reread, changed = [], [], set()
        for entry in entries:
            info = shard_info.get(self._path(entry.shard))
            index_path = self._path(self.index_file(entry.shard_id))
            size = None if info is None else info.get("size", entry.nbytes)
            found = fmt.shard_problem(entry, size, None, self._url(self._path(entry.shard)))
            found = found or fmt.params_problem(entry, params, self._url(index_path))
            if found:
                report.damaged.append(self._problem(entry, *found))
                continue
            newer = fmt.newer(info, index_info.get(index_path))
            relevant = wanted is None or not wanted.isdisjoint(entry.samples)
            if relevant and (checksums == "all" or (checksums == "changed" and newer)):
                reread.append(entry)
                changed.update([entry.shard_id] if newer else [])
            else:
                intact.append(entry)
        for group in fmt.byte_groups(reread, _READ_BATCH_BYTES):
            datas = st.read_many(self.fs, [self._path(e.shard) for e in group])
            for entry, data in zip(group, datas):
                try:
                    self._verified(entry, data)
                except CacheCorruptError as exc:
                    report.damaged.append(self._problem(entry, "content", str(exc)))
                    continue
                report.bytes_checked += entry.nbytes
                intact.append(entry)
                if touch and entry.shard_id in changed:
                    path = self._path(self.index_file(entry.shard_id))
                    with storage_errors(self.url, "rewrite an index entry under", self._options):
                        st.write_atomic(self.fs, path, self._seen[entry.shard_id])
        self._set_entries(intact)
        owned = self.committed_keys()
        report.shards_checked, report.samples = len(entries), len(owned)
        report.lost = sorted({k for p in report.damaged for k in p.samples} - owned)
        named = {self._path(e.shard) for e in entries}
        named |= {self._path(self.shard_file(p.shard_id)) for p in report.damaged}
        report.orphans = [self._url(p) for p in sorted(shard_info) if p not in named]
        return report

    def _problem(self, entry: fmt.IndexEntry, kind: str, text: str) -> fmt.ShardProblem:
        path = self._url(self._path(entry.shard))
        return fmt.ShardProblem(path, text, entry.shard_id, tuple(sorted(entry.samples)), kind)

    def verify(self, params: Collection[str] | None = None) -> fmt.VerifyReport:
        """Re-read every shard (size, sha256, parse, tensors as the index lists them), check the
        params when given, and compare with the manifest when there is one. Moves nothing."""
        report = self.check("all", params=params)
        try:
            manifest = self.read_manifest()
        except CacheCorruptError as exc:
            path = self._url(self._path("manifest.json"))
            report.damaged.append(fmt.ShardProblem(path, str(exc), kind="manifest"))
            return report
        if manifest is not None and "samples" in manifest:
            report.manifest_samples = len(manifest["samples"])
            report.missing = sorted(set(manifest["samples"]) - self.committed_keys())
        return report

    def quarantine(self, problems: Iterable[fmt.ShardProblem]) -> list[str]:
        """Move damaged index entries, then their shard files, to `quarantine/` (with
        `<id>.problem.txt` saying why): no reader sees them again, the next preprocess recomputes
        them. Entries repaired since the check are left alone. Returns the index entries moved."""
        moved = []
        for problem in (p for p in problems if p.shard_id):  # not the manifest: preprocess rewrites
            rel = self.index_file(problem.shard_id)
            (data,) = st.read_many(self.fs, [self._path(rel)])
            if data != self._seen.get(problem.shard_id) or self._healed(problem, data):
                continue  # gone, rewritten or repaired since the check
            if self._move_aside(rel):
                self._move_aside(self.shard_file(problem.shard_id))
                note = self._path(f"{QUARANTINE}/{problem.shard_id}.problem.txt")
                with storage_errors(self.url, "write under", self._options):
                    st.write_atomic(self.fs, note, f"{problem.problem}\n".encode())
                moved.append(self._url(self._path(rel)))
        return moved

    def _healed(self, problem: fmt.ShardProblem, data: bytes) -> bool:
        """True when a damaged shard now verifies (another writer rewrote it since the check)."""
        if problem.kind in ("index", "params"):
            return False
        entry = fmt.parse_index_entry(data, problem.shard_id, problem.path)
        try:
            self._verified(entry, st.read_many(self.fs, [self._path(entry.shard)])[0])
        except CacheCorruptError:
            return False
        return True

    def _move_aside(self, rel: str) -> bool:
        """Move one cache file into `quarantine/`; False when it is not there."""
        dst = self._path(f"{QUARANTINE}/{rel.rsplit('/', 1)[-1]}")
        with storage_errors(self.url, "move a damaged file under", self._options):
            if st.is_local(self.fs):
                self.fs.makedirs(self._path(QUARANTINE), exist_ok=True)
            try:
                self.fs.mv(self._path(rel), dst)
            except FileNotFoundError:
                return False
        return True

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
        """Samples, shards, shard bytes and duplicated sample keys, from the index alone."""
        self._load_index()
        with self._lock:
            entries = list((self._entries or {}).values())
            owner = dict(self._owner)
        counts = Counter(k for e in entries for k in e.samples)
        dups = sorted(k for k, n in counts.items() if n > 1)
        return fmt.CacheStats(
            len(owner), len(entries), sum(e.nbytes for e in entries), len(dups), dups
        )
