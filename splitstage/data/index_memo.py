"""The index memo: a data set's rows and sample keys as last indexed, kept beside the hash memo
(`<cache.url>/data-memo/<digest of the data set URL>.index.parquet`), so a rerun whose
metadata file and images are unchanged costs one stat per image (a listing on object stores)
plus one file read: no metadata parsing, no row checks, no image reads, no hashing.

It is used only when all of these hold: the same format and rules (the code that parses, checks
and keys rows, and the settings that pick them: skip_bad_rows, limit, the metadata file); the
same data set; the metadata file's (size, version) as recorded; every image file the result
depended on (kept rows, dropped duplicates, rows refused for their size) with the recorded
(size, version); and the files of rows skipped as not found still absent. It is written only when
all of those files and the metadata file are older than the hash memo's trust margin (on disks),
and not when an image read failed (a failure that may not recur). Anything else: the full index
and a new memo. Losing it only costs time; a corrupt one is ignored with one warning line.

Format (Parquet, `storage.parquet_columns`; no pickle, uncompressed): text columns NUL-joined
UTF-8 (`files`, `images`, `prompts`, `extras` as JSON or '', `absent`, and `versions` for ETags),
the 32-byte `keys` end to end, `skipped` as JSON, and int64 `sizes` / `mtimes` / `lines` (little
endian), each stored as Parquet rows (`column`, `dtype`, `piece`) of at most 256 MiB of its bytes
(a Parquet value or page must stay under 2 GiB). The schema metadata holds the format, the
rules digest, the data set URL, the metadata file's stat and the counts. Every page carries
Parquet's CRC-32, verified on load. A memo of the earlier safetensors format
(`.index.safetensors`) is never read: the first run after the change indexes in full and writes
the Parquet memo (the old file is left as it is; deleting it is safe).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitstage.data.dataset import Row
from splitstage.data.file_stats import FileCheck
from splitstage.data.hash_memo import SUFFIX as HASH_MEMO_SUFFIX
from splitstage.data.hash_memo import TRUST_MARGIN_NS, stop_if_cache_unusable
from splitstage.data.row_table import RowTable, extras_text, references_text
from splitstage.data.source import DataSource, Listing
from splitstage.storage.parquet_columns import ColumnFile, write_columns

log = logging.getLogger(__name__)
FORMAT = "splitstage-data-index-v2"
SUFFIX = ".index.parquet"
_SEP = "\0"
_RULE_MODULES = (  # the code whose behaviour the memo's contents depend on
    "splitstage.data.dataset",
    "splitstage.data.metadata_files",
    "splitstage.data.source",
    "splitstage.data.image_paths",
    "splitstage.data.images",
    "splitstage.data.index",
    "splitstage.data.videos",  # which rows are videos (no image size limit, their messages)
    __name__,
)


@dataclass
class IndexResult:
    """What an index build found: the input to a memo, and what a valid memo gives back."""

    rows: Sequence[Row]
    keys: list[str]
    skipped: list[tuple[int, str]]
    duplicates: int
    hits: int  # distinct image files with a content digest


def index_memo_path(memo_path: str) -> str:
    """The index memo's path beside the hash memo at `memo_path`."""
    return memo_path.removesuffix(HASH_MEMO_SUFFIX) + SUFFIX


def rules_digest(data: Any, metadata: str) -> str:
    """Digest of what decides the rows and keys besides the files: code and settings."""
    digest = hashlib.sha256(FORMAT.encode())
    for name in _RULE_MODULES:
        module = sys.modules.get(name)
        source = getattr(module, "__file__", None)
        digest.update(Path(source).read_bytes() if source else name.encode())
    settings = {"skip_bad_rows": data.skip_bad_rows, "limit": data.limit, "metadata": metadata}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def encode(
    result: IndexResult,
    *,
    data_url: str,
    rules: str,
    metadata_stat: Any,
    listing: Listing,
    depends: Sequence[str],
    absent: Sequence[str],
    metadata_bytes: bytes = b"",
) -> bytes | None:
    """The memo bytes; None when it may not be kept (a racy file, an unknown version, or text
    that cannot be stored)."""
    files = sorted(set(depends))  # grouped by folder: one open folder per run of stats
    stats = [listing.files.get(p) for p in files]
    if metadata_stat is None or any(s is None or s[1] is None for s in stats):
        return None
    if listing.by_mtime:
        margin = listing.started_ns - TRUST_MARGIN_NS
        if metadata_stat[1] >= margin or any(s[1] >= margin for s in stats):
            return None
    extras = [extras_text(row.extras) for row in result.rows]
    text = {
        "files": _join(files),
        "images": _join([row.image for row in result.rows]),
        "prompts": _join([row.prompt for row in result.rows]),
        "extras": None if None in extras else _join(extras),
        "absent": _join(list(absent)),
    }
    if any(row.references for row in result.rows):  # absent: no row has reference images
        text["references"] = _join([references_text(row.references) for row in result.rows])
    if listing.by_mtime:
        versions = {"mtimes": np.fromiter((s[1] for s in stats), np.int64, len(stats))}
    else:
        versions = {"versions": _join([str(s[1]) for s in stats])}
    if any(v is None for v in (*text.values(), *versions.values())):
        return None
    tensors = {name: np.frombuffer(value, np.uint8) for name, value in text.items()}
    if "versions" in versions:
        tensors["versions"] = np.frombuffer(versions["versions"], np.uint8)
    else:
        tensors["mtimes"] = versions["mtimes"]
    tensors["sizes"] = np.fromiter((s[0] for s in stats), np.int64, len(stats))
    tensors["lines"] = np.fromiter((row.line for row in result.rows), np.int64, len(result.rows))
    keys = bytes.fromhex("".join(result.keys))
    tensors["keys"] = np.frombuffer(keys, np.uint8).reshape(-1, 32)
    skipped = json.dumps([list(s) for s in result.skipped], ensure_ascii=False).encode()
    tensors["skipped"] = np.frombuffer(skipped, np.uint8)
    source = result.rows[0].source if result.rows else ""
    meta = {
        "format": FORMAT,
        "rules": rules,
        "data_url": data_url,
        "metadata_stat": json.dumps(list(metadata_stat)),
        "by_mtime": str(listing.by_mtime),
        "rows": str(len(result.rows)),
        "files": str(len(files)),
        "duplicates": str(result.duplicates),
        "hits": str(result.hits),
        "source": source,
    }
    if metadata_bytes:  # so that rows appended later are all a rerun parses (`appended`)
        meta["metadata_length"] = str(len(metadata_bytes))
        meta["metadata_sha256"] = hashlib.sha256(metadata_bytes).hexdigest()
    return write_columns(tensors, meta)


def appended(meta: Mapping[str, str], data: bytes, name: str) -> tuple[bytes, int] | None:
    """(what to parse, line offset) when metadata file `name` (csv / jsonl) only grew since the
    memo: its recorded bytes are the start of `data` and end at a line end. CSV gets its header
    line in front, so records and messages number lines as in the whole file. Else None."""
    length, digest = int(meta.get("metadata_length", 0)), meta.get("metadata_sha256")
    kind = name.lower().rsplit(".", 1)[-1]
    if kind not in ("csv", "jsonl") or not digest or not 0 < length < len(data):
        return None
    prefix, tail = data[:length], data[length:]
    if not prefix.endswith(b"\n") or b"\r" in prefix or tail.startswith(b"\xef\xbb\xbf"):
        return None  # \r: line counts would depend on how each parser reads it
    if hashlib.sha256(prefix).hexdigest() != digest:
        return None
    lines = prefix.count(b"\n")
    if kind == "jsonl":
        return tail, lines
    header = prefix[: prefix.index(b"\n") + 1]
    if b'"' in header:  # a quoted header could span lines
        return None
    return header + tail, lines - 1


def load(
    fs: Any, path: str, url: str, *, data_url: str, rules: str
) -> tuple[dict[str, str], dict[str, np.ndarray]] | None:
    """The memo's header and columns when it was made by these rules for this data set; None
    when missing, made for something else, or (with a warning) corrupt."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    except Exception as exc:
        stop_if_cache_unusable(exc, fs, url, "read")
        log.warning("index memo %s not read (%s); indexing every row", url, type(exc).__name__)
        return None
    try:
        memo = ColumnFile(data)
        meta = memo.meta
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        if (meta.get("rules"), meta.get("data_url")) != (rules, data_url):
            return None  # the code, the settings or the data set changed: not an error
        tensors = memo.columns()  # a flipped byte fails its page CRC
        if "keys" in tensors:
            tensors["keys"] = tensors["keys"].reshape(-1, 32)
        return meta, tensors
    except Exception as exc:
        log.warning("index memo %s is unusable (%s); indexing every row", url, exc)
        return None


def files_of(got: tuple[Mapping[str, str], Mapping[str, np.ndarray]]) -> list[str]:
    """The files the memo's result depended on."""
    return _split(got[1]["files"], int(got[0]["files"]))


def absent_of(got: tuple[Mapping[str, str], Mapping[str, np.ndarray]]) -> list[str]:
    """The files of rows the memo skipped as not found."""
    return _split(got[1]["absent"], None)


def merged_listing(
    got: tuple[Mapping[str, str], Mapping[str, np.ndarray]], listing: Listing
) -> Listing:
    """`listing` plus the memo's files as it recorded them (checked unchanged by the caller)."""
    meta, tensors = got
    files = files_of(got)
    if listing.by_mtime:
        versions: list[Any] = tensors["mtimes"].tolist()
    else:
        versions = _split(tensors["versions"], len(files))
    merged = dict(zip(files, zip(tensors["sizes"].tolist(), versions, strict=True), strict=True))
    merged.update(listing.files)
    return Listing(merged, listing.started_ns, listing.by_mtime)


def still_valid(
    meta: Mapping[str, str],
    tensors: Mapping[str, np.ndarray],
    source: DataSource,
) -> bool:
    """True when every file the memo depended on is as recorded, and absent ones still are."""
    with MemoCheck(meta, tensors, source) as check:
        return check.valid()


class MemoCheck:
    """Whether every file the memo depended on is as recorded and absent ones still are: on a
    disk the stats start in child processes at once (restore the rows meanwhile) and `valid()`
    waits for them; object stores answer from one listing of their folders (or the prefix)."""

    def __init__(self, meta: Mapping[str, str], tensors: Mapping[str, np.ndarray], source):
        count = int(meta["files"])
        self.absent = _split(tensors["absent"], None)
        self.source, self.files, self.answer = source, None, None
        sizes = tensors["sizes"]
        if len(sizes) != count:
            raise ValueError("its file columns disagree")
        if source.local:
            if meta["by_mtime"] != "True" or len(tensors["mtimes"]) != count:
                raise ValueError("its file columns disagree")
            names = tensors["files"].tobytes()
            self.files = FileCheck(source.local_root, names, sizes, tensors["mtimes"])
            return
        files = _split(tensors["files"], count)
        listing = source.listing([*files, *self.absent])
        versions = _split(tensors["versions"], len(files))
        now = [listing.files.get(p) for p in files]
        unchanged = now == list(zip(sizes.tolist(), versions))
        self.answer = unchanged and not any(rel in listing.files for rel in self.absent)

    def __enter__(self) -> MemoCheck:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def valid(self) -> bool:
        """The answer (waits for a local check to finish)."""
        if self.answer is None:
            assert self.files is not None
            root = self.source.local_root
            self.answer = not self.files.changed() and not any(
                os.path.isfile(os.path.join(root, rel)) for rel in self.absent
            )
        return self.answer

    def close(self) -> None:
        """Stop a local check that is no longer wanted."""
        if self.files is not None:
            self.files.close()


def restore(meta: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> IndexResult:
    """The rows, keys and skipped rows the memo holds (its rows made into objects lazily)."""
    count = int(meta["rows"])
    digests = tensors["keys"]
    if digests.shape != (count, 32) or len(tensors["lines"]) != count:
        raise ValueError(f"its row columns disagree with its count {count}")
    keys = digests.tobytes().hex(" ", 32).split(" ") if count else []
    named = ("images", "prompts", "extras", *(("references",) if "references" in tensors else ()))
    for name in named:  # split on first use; counted now
        if count and int(np.count_nonzero(tensors[name] == 0)) != count - 1:
            raise ValueError(f"its {name} column disagrees with its count {count}")
    rows = RowTable(
        tensors["lines"],
        tensors["images"].tobytes(),
        tensors["prompts"].tobytes(),
        tensors["extras"].tobytes(),
        meta["source"],
        tensors["references"].tobytes() if "references" in tensors else None,
    )
    skipped = [
        (int(line), str(reason)) for line, reason in json.loads(tensors["skipped"].tobytes())
    ]
    return IndexResult(rows, keys, skipped, int(meta["duplicates"]), int(meta["hits"]))


def _join(values: Sequence[str]) -> bytes | None:
    """NUL-joined UTF-8, or None when a value holds a NUL (it would split wrongly)."""
    joined = _SEP.join(values)
    if joined.count(_SEP) != max(0, len(values) - 1):
        return None
    try:
        return joined.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON escapes
        return None


def _split(column: np.ndarray, count: int | None) -> list[str]:
    """A NUL-joined text column back into `count` values (any number when None)."""
    text = column.tobytes().decode("utf-8")
    values = text.split(_SEP) if text or count == 1 else []
    if count is not None and len(values) != count:
        raise ValueError(f"a text column holds {len(values)} values, expected {count}")
    return values
