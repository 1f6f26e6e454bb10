"""The data set's usable rows and their sample keys: what both stages agree the data set is.

One listing plus the metadata file find what changed; files are read (and hashed) only when the
hash memo (`data.hash_memo`) does not know them at their current size and version: files up to
STREAM_ABOVE bytes whole, in concurrent batches; larger ones (long videos) in pieces, one at a
time (`dataset.file_digest`), so no file is ever held whole in memory past that size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from splitstage.config.job import SplitstageConfig
from splitstage.data import index_memo, metadata_files
from splitstage.data.dataset import (
    MAX_LINE_CHARS,
    DataError,
    Row,
    file_digest,
    locate_metadata,
    read_image_bytes,
    reference_rels,
    reference_row,
    sample_key_of_digest,
    scan_data_set,
    scan_records,
)
from splitstage.data.hash_memo import (
    HashMemo,
    data_url_of,
    load_memo,
    memo_location,
    needs_save,
    save_memo,
)
from splitstage.data.image_paths import noun
from splitstage.data.images import check_file_size
from splitstage.data.source import DataSource, open_data_source
from splitstage.data.videos import is_video

log = logging.getLogger(__name__)
READ_CHUNK = 1024  # rows whose images are read in one batch
PROGRESS_MIN = READ_CHUNK  # images to hash from which a terminal shows a bar
STREAM_ABOVE = 16 << 20  # files larger than this (listed size) are hashed in pieces


@dataclass
class DataIndex:
    """The data set's usable rows with their sample keys, and what was skipped."""

    rows: Sequence[Row]  # a list, or a RowTable restored from the index memo
    keys: list[str]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    duplicates: int = 0
    source: DataSource | None = None  # travels to worker processes (names only, no secrets)
    hashed: int = 0  # images read and hashed in this run
    memo_hits: int = 0  # images whose hash came from the memo
    from_memo: bool = False  # True: rows and keys came from the index memo (nothing changed)
    grown: int = 0  # rows appended to the metadata file: all that was parsed (0: none / all)


def _read_digests(
    source: DataSource,
    todo: list[tuple[Row, str]],
    sizes: dict[str, tuple],
    skip: bool,
    shown: Shown | None = None,
) -> tuple[dict[str, bytes], list[tuple[int, str]], bool]:
    """sha256 digests of the files of `todo` (row, listing key): small ones read whole in
    batches, those over STREAM_ABOVE in pieces; the flag says a read failed (skipped: such a
    build is not kept as the index memo). `shown` gets the progress."""
    digests: dict[str, bytes] = {}
    bad: list[tuple[int, str]] = []
    failed = False
    ok, pieces = [], []
    for row, rel in todo:  # refuse a huge image from its listed size, before reading it
        try:
            if not is_video(row.image):  # a video's length is not limited: it is seeked
                check_file_size(row.where, source.display(rel), sizes[rel][0])
        except DataError as exc:
            if not skip:
                raise
            bad.append((row.line, str(exc)))
            continue
        (pieces if sizes[rel][0] > STREAM_ABOVE else ok).append((row, rel))
    with _bar(len(ok) + len(pieces), shown) as advance:
        for start in range(0, len(ok), READ_CHUNK):
            chunk = ok[start : start + READ_CHUNK]
            failed |= _digest_chunk(source, chunk, skip, digests, bad)
            advance(len(chunk))
        for row, rel in pieces:
            try:
                digests[rel] = file_digest(row, source)
            except DataError as exc:
                if not skip:
                    raise
                failed = True
                bad.append((row.line, str(exc)))
            advance(1)
    return digests, bad, failed


def _digest_chunk(source: DataSource, chunk: list, skip: bool, digests: dict, bad: list) -> bool:
    """Read and hash one chunk of (row, listing key) into `digests` (bad rows into `bad` under
    `skip`); True when a read failed."""
    failed = False
    if source.local:
        results: list = []
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
                failed = True
                raise _read_error(row, source, rel, got)
            if not is_video(row.image):
                check_file_size(row.where, source.display(rel), len(got))
        except DataError as exc:
            if not skip:
                raise
            bad.append((row.line, str(exc)))
            continue
        digests[rel] = hashlib.sha256(got).digest()
    return failed


@dataclass
class Shown:
    """How an index build shows its hashing: a bar from PROGRESS_MIN images (`bar` None: on a
    terminal only, True: always, False: never), and `report(done, total)` after each chunk."""

    bar: bool | None = None
    report: Callable[[int, int], None] | None = None


@contextlib.contextmanager
def _bar(total: int, shown: Shown | None) -> Iterator[Callable[[int], None]]:
    """`advance(count)` for hashing `total` images, as `shown` says."""
    shown = shown or Shown()
    quiet = total < PROGRESS_MIN or shown.bar is False
    done = 0
    disable = True if quiet else (None if shown.bar is None else False)  # None: on a terminal
    with tqdm(total=total, desc="hash images", unit="image", disable=disable) as bar:

        def advance(count: int) -> None:
            nonlocal done
            done += count
            bar.update(count)
            if shown.report is not None:
                shown.report(done, total)

        yield advance


def _read_error(row: Row, source: DataSource, rel: str, exc: BaseException) -> DataError:
    if isinstance(exc, DataError):
        return exc
    what = noun(row.image)
    if isinstance(exc, FileNotFoundError):
        return DataError(f"{row.where}: cannot read {what} file {source.display(rel)}: not found")
    return source.failure(f"read {what} file ({row.where})", source.display(rel), exc)


def index_data_set(
    config: SplitstageConfig, *, use_memo: bool = True, shown: Shown | None = None
) -> DataIndex:
    """Read the metadata, list the data set once, and key every sample by content (hashing only
    the images the memo does not know, with progress as `shown` says); bad rows raise or are
    counted. A rerun with nothing changed takes everything from the index memo
    (`data.index_memo`) after one stat per file; rows appended to a csv / jsonl file are all it
    parses then (`_grown`)."""
    data = config.data
    source = open_data_source(data)
    memo_at = memo_location(config.cache, source) if use_memo else None
    if memo_at is not None:
        reused = _reuse(memo_at, source, data, shown)
        if reused is not None:
            return reused
    scan = scan_data_set(source, data.metadata_path, skip_bad_rows=data.skip_bad_rows)
    rows = scan.rows if data.limit is None else scan.rows[: data.limit]
    rels = scan.rels[: len(rows)]
    depends = rels + [ref for row in rows for ref in reference_rels(row)]
    memo = load_memo(*memo_at, source) if memo_at is not None else HashMemo()
    index = DataIndex(rows=[], keys=[], skipped=[(s.line, s.reason) for s in scan.skipped])
    skip = data.skip_bad_rows
    keyed = _key_rows(index, rows, rels, scan.listing, memo, source, skip, set(), shown)
    if not index.rows:
        raise DataError(
            f"data set {data.base_path}: no usable rows ({len(index.skipped)} skipped); "
            "check data.base_path and data.metadata_path"
        )
    if memo_at is not None:
        fresh, found, failed = keyed
        if needs_save(scan.listing, fresh, len(memo), index.memo_hits):
            encoded = HashMemo.encode(scan.listing, found, data_url_of(source))
            if encoded is not None:
                save_memo(*memo_at, encoded)
        if not failed:
            name = scan.metadata[1]
            grows = name.lower().endswith((".csv", ".jsonl"))
            whole = scan.metadata_bytes if grows else b""
            _save_index(memo_at, source, data, scan, index, depends, len(found), whole)
    return index


def _key_rows(index, rows, rels, listing, memo, source, skip, seen: set[str], shown=None):
    """Key `rows` (digests from the memo, else read) into `index`: kept rows and keys, skipped
    unreadable ones, duplicates of `seen` or of each other; (fresh, found digests, failed)."""
    files = listing.files
    found: dict[str, bytes] = {}
    todo: list[tuple[Row, str]] = []
    wanted: set[str] = set()
    for row, rel in zip(rows, rels, strict=True):
        files_of_row = [(row, rel)]  # its file, then its reference images (read alike)
        files_of_row += [
            (reference_row(row, ref), ref_rel)
            for ref, ref_rel in zip(row.references, reference_rels(row), strict=True)
        ]
        for file_row, file_rel in files_of_row:
            if file_rel in found or file_rel in wanted:
                continue
            size, version = files[file_rel]
            digest = memo.lookup(file_rel, size, version)
            if digest is None:
                wanted.add(file_rel)
                todo.append((file_row, file_rel))
            else:
                found[file_rel] = digest
    hits = len(found)
    fresh, bad, failed = _read_digests(source, todo, files, skip, shown)
    found.update(fresh)
    index.source, index.hashed, index.memo_hits = source, len(fresh), hits
    index.skipped += bad
    for row, rel in zip(rows, rels, strict=True):
        digest = found.get(rel)
        refs = [found.get(ref_rel) for ref_rel in reference_rels(row)]
        if digest is None or None in refs:  # a file could not be read (skip_bad_rows)
            continue
        key = sample_key_of_digest(digest, row.prompt, row.extras, refs)
        if key in seen:
            index.duplicates += 1
            continue
        seen.add(key)
        index.rows.append(row)
        index.keys.append(key)
    index.skipped.sort()
    return fresh, found, failed


def _reuse(memo_at: tuple, source: DataSource, data, shown: Shown | None) -> DataIndex | None:
    """The data index from a still-valid index memo (or one rows were appended to), else None
    (the full build runs)."""
    fs, path, url = memo_at
    url = index_memo.index_memo_path(url)
    try:
        meta_source, rel = locate_metadata(source, data.metadata_path)
    except DataError:
        return None  # the full build says what is wrong
    stat = meta_source.stat(rel)
    rules = index_memo.rules_digest(data, meta_source.display(rel))
    got = index_memo.load(
        fs, index_memo.index_memo_path(path), url, data_url=data_url_of(source), rules=rules
    )
    if got is None or stat is None:
        return None
    try:
        if got[0].get("metadata_stat") != json.dumps(list(stat)):
            return _grown(memo_at, source, data, got, (meta_source, rel, stat), shown)
        with index_memo.MemoCheck(*got, source) as check:  # stats run while rows restore
            result = index_memo.restore(*got)
            if not check.valid():
                return None
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        log.warning("index memo %s is unusable (%s); indexing every row", url, exc)
        return None
    index = DataIndex(rows=result.rows, keys=result.keys, skipped=result.skipped)
    index.duplicates, index.source, index.memo_hits = result.duplicates, source, result.hits
    index.from_memo = True
    return index


def _grown(memo_at, source, data, got, metadata, shown: Shown | None) -> DataIndex | None:
    """Rows appended to the metadata file since the memo, with every file the memo depended on
    unchanged: parse, check and key only the new lines; None when that does not hold (or the
    new part has a file-level error: the full build then names it as in the whole file)."""
    meta_source, rel, stat = metadata
    name = rel.rsplit("/", 1)[-1]
    if data.limit is not None:
        return None
    whole = meta_source.read_metadata(rel)
    part = index_memo.appended(got[0], whole, name)
    if part is None:
        return None
    if not index_memo.still_valid(*got, source):
        return None
    old = index_memo.restore(*got)
    where = meta_source.display(rel)
    try:
        records = metadata_files.records(part[0], name, where, MAX_LINE_CHARS, part[1])
        scan = scan_records(source, records, name, data.skip_bad_rows)  # lists the new folders
    except DataError:
        return None
    memo = load_memo(*memo_at, source)
    new = DataIndex(rows=[], keys=[], skipped=[(s.line, s.reason) for s in scan.skipped])
    skip, seen = data.skip_bad_rows, set(old.keys)
    fresh, found, failed = _key_rows(
        new, scan.rows, scan.rels, scan.listing, memo, source, skip, seen, shown
    )
    rows = old.rows.plus(new.rows)
    if rows is None or failed:
        return None
    index = DataIndex(
        rows=rows, keys=old.keys + new.keys, skipped=sorted(old.skipped + new.skipped)
    )
    index.duplicates = old.duplicates + new.duplicates
    index.source, index.hashed, index.memo_hits = source, new.hashed, old.hits + new.memo_hits
    index.grown = len(scan.rows) + len(scan.skipped)
    if fresh:
        encoded = memo.encode_with(scan.listing, fresh, data_url_of(source))
        if encoded is not None:
            save_memo(*memo_at, encoded)
    listing = index_memo.merged_listing(got, scan.listing)
    scan.metadata, scan.metadata_bytes = metadata, whole
    scan.absent = index_memo.absent_of(got) + scan.absent
    depends = index_memo.files_of(got) + scan.rels
    depends += [ref for row in scan.rows for ref in reference_rels(row)]
    _save_index(memo_at, source, data, scan, index, depends, len(found) + old.hits, whole, listing)
    return index


def _save_index(
    memo_at, source, data, scan, index: DataIndex, rels, hits: int, whole: bytes, listing=None
) -> None:
    """Keep this build as the index memo when every file it depended on may be trusted."""
    fs, path, url = memo_at
    meta_source, rel, stat = scan.metadata
    result = index_memo.IndexResult(index.rows, index.keys, index.skipped, index.duplicates, hits)
    encoded = index_memo.encode(
        result,
        data_url=data_url_of(source),
        rules=index_memo.rules_digest(data, meta_source.display(rel)),
        metadata_stat=stat,
        listing=listing or scan.listing,
        depends=rels,
        absent=scan.absent,
        metadata_bytes=whole,
    )
    if encoded is not None:
        save_memo(fs, index_memo.index_memo_path(path), index_memo.index_memo_path(url), encoded)
