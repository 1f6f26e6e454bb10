"""Checks and repair of a cache: find damaged index entries and shards, move them aside.

`CacheChecks` is the part of `CacheStore` that checks the index against ONE listing of the
shards (`check`), re-reads every shard (`verify`) and moves damaged entries with their shards to
`quarantine/` (`quarantine`), so no reader sees them again and the next preprocess recomputes
their samples. A check takes the entries the index snapshot holds by their listing stamps, as
readers do (`snapshot_check`), and reads every entry itself when the snapshot does not hold or
anything needs a closer look (then it sees each entry as it is now).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import splitstage.storage.files as st
import splitstage.tasks.cache.shard_format as fmt
from splitstage.storage.files import storage_errors
from splitstage.tasks.cache.cache_errors import CacheCorruptError
from splitstage.tasks.cache.index_entry import seen_digest
from splitstage.tasks.cache.manifest import MANIFEST
from splitstage.tasks.cache.snapshot_check import snapshot_check

QUARANTINE = "quarantine"
READ_BATCH_BYTES = 256 * 2**20


class CacheChecks:
    """check / verify / quarantine of a `CacheStore` (mixed into it; uses its index and I/O)."""

    def _read_index(
        self,
    ) -> tuple[list[fmt.IndexEntry], list[fmt.ShardProblem], dict[str, Any], dict[str, bytes]]:
        """List and read every index entry: entries, bad ones, the listing, the bytes read."""
        listing = self._list("index", ".json")
        entries: list[fmt.IndexEntry] = []
        problems: list[fmt.ShardProblem] = []
        datas: dict[str, bytes] = {}
        for shard_id, path, data in self._scan(sorted(listing)):
            self._seen[shard_id] = datas[shard_id] = data
            try:
                entries.append(fmt.parse_index_entry(data, shard_id, self._url(path)))
            except CacheCorruptError as exc:
                problems.append(fmt.ShardProblem(self._url(path), str(exc), shard_id, (), "index"))
        return entries, problems, listing, datas

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
        wanted = None if keys is None else set(keys)
        if checksums != "all":  # reads only the entries the index snapshot does not hold
            quick = snapshot_check(self, checksums, wanted, params)
            if quick is not None:
                return quick
        report = fmt.VerifyReport(self.url, checksums=checksums)
        entries, report.damaged, index_info, entry_bytes = self._read_index()
        shard_info = self._list("shards", ".safetensors")
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
        for group in fmt.byte_groups(reread, READ_BATCH_BYTES):
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
                    with storage_errors(
                        self.url,
                        "rewrite an index entry under",
                        self._options,
                        field="cache.storage_options",
                    ):
                        st.write_atomic(self.fs, path, entry_bytes[entry.shard_id])
        self._set_entries(intact)
        damaged = sorted({k for p in report.damaged for k in p.samples})
        report.shards_checked, report.samples = len(entries), len(self.key_table())
        report.lost = [k for k, kept in zip(damaged, self.contains(damaged)) if not kept]
        named = {self._path(e.shard) for e in entries}
        named |= {self._path(self.shard_file(p.shard_id)) for p in report.damaged}
        report.orphans = [self._url(p) for p in sorted(shard_info) if p not in named]
        return report

    def _problem(self, entry: fmt.IndexEntry, kind: str, text: str) -> fmt.ShardProblem:
        path = self._url(self._path(entry.shard))
        return fmt.ShardProblem(path, text, entry.shard_id, tuple(sorted(entry.samples)), kind)

    def verify(self, params: Collection[str] | None = None) -> fmt.VerifyReport:
        """Re-read every shard (size, sha256, parse, tensors as the index lists them), check the
        params when given, and compare with the manifest when there is one. Moves nothing but
        the temporary files an interrupted writer left (deleted, their bytes reported)."""
        swept = self.sweep_temp_files()
        report = self.check("all", params=params)
        report.temp_files_removed, report.bytes_reclaimed = swept
        try:
            manifest = self.read_manifest()
        except CacheCorruptError as exc:
            path = self._url(self._path(MANIFEST))
            report.damaged.append(fmt.ShardProblem(path, str(exc), kind="manifest"))
            return report
        if manifest is not None and "samples" in manifest:
            report.manifest_samples = len(manifest["samples"])
            report.missing = self.missing(manifest["samples"]).to_list()
        return report

    def quarantine(self, problems: Iterable[fmt.ShardProblem]) -> list[str]:
        """Move damaged index entries, then their shard files, to `quarantine/` (with
        `<id>.problem.txt` saying why): no reader sees them again, the next preprocess recomputes
        them. Entries repaired since the check are left alone. Returns the index entries moved."""
        moved = []
        for problem in (p for p in problems if p.shard_id):  # not the manifest: preprocess rewrites
            rel = self.index_file(problem.shard_id)
            (data,) = st.read_many(self.fs, [self._path(rel)])
            seen = self._seen_digest(problem.shard_id)
            if not isinstance(data, bytes) or seen_digest(data) != seen:
                continue  # gone or rewritten since the check
            if self._healed(problem, data):
                continue  # repaired since the check
            if self._move_aside(rel):
                self._move_aside(self.shard_file(problem.shard_id))
                note = self._path(f"{QUARANTINE}/{problem.shard_id}.problem.txt")
                with storage_errors(
                    self.url, "write under", self._options, field="cache.storage_options"
                ):
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
        with storage_errors(
            self.url, "move a damaged file under", self._options, field="cache.storage_options"
        ):
            if st.is_local(self.fs):
                self.fs.makedirs(self._path(QUARANTINE), exist_ok=True)
            try:
                self.fs.mv(self._path(rel), dst)
            except FileNotFoundError:
                return False
        return True
