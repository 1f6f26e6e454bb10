"""The data set's usable rows and their sample keys: what both stages agree the data set is.

One listing plus the metadata file find what changed; image bytes are read (and hashed) only for
files the hash memo (`tasks.hash_memo`) does not know at their current size and version.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.data import (
    DataError,
    Row,
    read_image_bytes,
    sample_key_of_digest,
    scan_data_set,
)
from splitstage.pipelines.data_source import DataSource, open_data_source
from splitstage.pipelines.images import check_file_size
from splitstage.tasks.hash_memo import (
    HashMemo,
    data_url_of,
    load_memo,
    memo_location,
    needs_save,
    save_memo,
)

READ_CHUNK = 1024  # rows whose images are read in one batch


@dataclass
class DataIndex:
    """The data set's usable rows with their sample keys, and what was skipped."""

    rows: list[Row]
    keys: list[str]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    duplicates: int = 0
    source: DataSource | None = None  # travels to worker processes (names only, no secrets)
    hashed: int = 0  # images read and hashed in this run
    memo_hits: int = 0  # images whose hash came from the memo


def _read_digests(
    source: DataSource, todo: list[tuple[Row, str]], sizes: dict[str, tuple], skip: bool
) -> tuple[dict[str, bytes], list[tuple[int, str]]]:
    """sha256 digests of the images of `todo` (row, listing key), read in batches."""
    digests: dict[str, bytes] = {}
    bad: list[tuple[int, str]] = []
    ok = []
    for row, rel in todo:  # refuse a huge file from its listed size, before reading it
        try:
            check_file_size(row.where, source.display(rel), sizes[rel][0])
            ok.append((row, rel))
        except DataError as exc:
            if not skip:
                raise
            bad.append((row.line, str(exc)))
    for start in range(0, len(ok), READ_CHUNK):
        chunk = ok[start : start + READ_CHUNK]
        if source.local:
            results = []
            for row, _ in chunk:
                try:
                    results.append(read_image_bytes(row, source))
                except DataError as exc:
                    results.append(exc)
        else:
            results = source.read_many([rel for _, rel in chunk])
        for (row, rel), got in zip(chunk, results, strict=True):
            try:
                if isinstance(got, BaseException):
                    raise _read_error(row, source, rel, got)
                check_file_size(row.where, source.display(rel), len(got))
            except DataError as exc:
                if not skip:
                    raise
                bad.append((row.line, str(exc)))
                continue
            digests[rel] = hashlib.sha256(got).digest()
    return digests, bad


def _read_error(row: Row, source: DataSource, rel: str, exc: BaseException) -> DataError:
    if isinstance(exc, DataError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return DataError(f"{row.where}: cannot read image file {source.display(rel)}: not found")
    return source.failure(f"read image file ({row.where})", source.display(rel), exc)


def index_data_set(config: SplitstageConfig, *, use_memo: bool = True) -> DataIndex:
    """Read the metadata, list the data set once, and key every sample by content (hashing only
    the images the memo does not know); bad rows raise or are counted."""
    data = config.data
    source = open_data_source(data)
    scan = scan_data_set(source, data.metadata_path, skip_bad_rows=data.skip_bad_rows)
    rows = scan.rows if data.limit is None else scan.rows[: data.limit]
    rels = scan.rels[: len(rows)]
    files = scan.listing.files
    memo = HashMemo(scan.listing.by_mtime)
    if use_memo:
        fs, path, url = memo_location(config.cache, source)
        memo = load_memo(fs, path, url, source)
    found: dict[str, bytes] = {}
    todo: list[tuple[Row, str]] = []
    wanted: set[str] = set()
    for row, rel in zip(rows, rels, strict=True):
        if rel in found or rel in wanted:
            continue
        size, version = files[rel]
        digest = memo.lookup(rel, size, version)
        if digest is None:
            wanted.add(rel)
            todo.append((row, rel))
        else:
            found[rel] = digest
    hits = len(found)
    fresh, bad = _read_digests(source, todo, files, data.skip_bad_rows)
    found.update(fresh)
    index = DataIndex(rows=[], keys=[], skipped=[(s.line, s.reason) for s in scan.skipped])
    index.source, index.hashed, index.memo_hits = source, len(fresh), hits
    index.skipped += bad
    seen: set[str] = set()
    for row, rel in zip(rows, rels, strict=True):
        digest = found.get(rel)
        if digest is None:  # its image could not be read (skip_bad_rows)
            continue
        key = sample_key_of_digest(digest, row.prompt, row.extras)
        if key in seen:
            index.duplicates += 1
            continue
        seen.add(key)
        index.rows.append(row)
        index.keys.append(key)
    index.skipped.sort()
    if use_memo and needs_save(scan.listing, fresh, len(memo), hits):
        encoded = HashMemo.encode(scan.listing, found, data_url_of(source))
        if encoded is not None:
            save_memo(fs, path, url, encoded)
    if not index.rows:
        raise DataError(
            f"data set {data.base_path}: no usable rows ({len(index.skipped)} skipped); "
            "check data.base_path and data.metadata_path"
        )
    return index
