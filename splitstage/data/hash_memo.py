"""The hash memo: (path, size, mtime or ETag) -> sha256 of an image's bytes, kept beside the cache
(`<cache.url>/data-memo/<digest of the data set URL>.parquet`), so a rerun with no new
samples costs a listing plus the metadata file instead of reading every image.

Losing it only costs time; it can never give a wrong key: an entry is used only when the file's
size and version (mtime_ns on disks, ETag on object stores) are what the listing sees now, and a
corrupt or foreign memo is ignored with one warning line and rebuilt. Racy mtimes (a file
rewritten within one mtime tick, same size): entries whose mtime is within TRUST_MARGIN_NS of the
listing's start are never written, so such files are hashed again on every run until they age.

Format (Parquet, `storage.parquet_columns`; no pickle, columnar for 10^6 rows): `paths` and, for
ETags, `versions` as NUL-joined UTF-8 bytes; `sizes` and, for mtimes, `mtimes` as int64; the
32-byte `digests` end to end; the format, data set URL, count and version kind as schema
metadata. Every page carries Parquet's CRC-32, verified on load: a flipped byte or a cut file is
a corrupt memo. A memo of the earlier safetensors format (`<digest>.safetensors`) is never read:
the first run after the change hashes every image once and writes the Parquet memo (the old file
is left as it is; deleting it is safe).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from splitstage.data.source import DataSource, Listing
from splitstage.storage.files import (
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageFullError,
    StoragePermissionError,
    StorageReadOnlyError,
    StorageUnreachableError,
    join,
    open_fs,
    translate_error,
    write_atomic,
)
from splitstage.storage.options import with_credentials
from splitstage.storage.parquet_columns import ColumnFile, write_columns

log = logging.getLogger(__name__)
FORMAT = "splitstage-data-memo-v2"
SUFFIX = ".parquet"  # the index memo beside it: `index_memo.SUFFIX`
FOLDER = "data-memo"
TRUST_MARGIN_NS = 2_000_000_000  # coarser than any file system's mtime tick (FAT: 2 s)
_SEP = "\0"  # in neither file names nor object keys


class HashMemo:
    """Digests of image files by their path, valid while size and version are unchanged."""

    def __init__(self, by_mtime: bool = True) -> None:
        self.by_mtime = by_mtime
        self._index: dict[str, int] = {}
        self._sizes: list[int] = []
        self._versions: list[Any] = []
        self._digests = b""

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, path: str, size: int, version: Any) -> bytes | None:
        """The digest recorded for `path` if its size and version are still these; else None."""
        i = self._index.get(path)
        if i is None or version is None:
            return None
        if self._sizes[i] != size or self._versions[i] != version:
            return None
        return self._digests[32 * i : 32 * i + 32]

    # ---- format ----------------------------------------------------------------------------
    @staticmethod
    def encode(listing: Listing, digests: Mapping[str, bytes], data_url: str) -> bytes | None:
        """The memo bytes for `digests` (path -> sha256) as the listing saw the files; None when
        no entry may be kept (all racy, or none)."""
        keep = _trusted(listing, digests)
        if not keep:
            return None
        files = listing.files
        sizes = [files[p][0] for p in keep]
        versions = [files[p][1] for p in keep]
        joined = b"".join(digests[p] for p in keep)
        return _columns(keep, sizes, versions, joined, listing.by_mtime, data_url)

    def encode_with(
        self, listing: Listing, digests: Mapping[str, bytes], data_url: str
    ) -> bytes | None:
        """The memo bytes of this memo's entries plus `digests` as the listing saw the files
        (rows appended: the old entries are kept without listing their files again)."""
        keep = _trusted(listing, digests)
        if not keep or listing.by_mtime != self.by_mtime:
            return None
        paths = list(self._index)
        sizes, versions = list(self._sizes), list(self._versions)
        blob = bytearray(self._digests)
        for p in keep:
            size, version = listing.files[p]
            i = self._index.get(p)
            if i is None:
                paths.append(p)
                sizes.append(size)
                versions.append(version)
                blob += digests[p]
            else:
                sizes[i], versions[i] = size, version
                blob[32 * i : 32 * i + 32] = digests[p]
        return _columns(paths, sizes, versions, bytes(blob), self.by_mtime, data_url)

    @classmethod
    def decode(cls, data: bytes, data_url: str) -> HashMemo:
        """Parse memo bytes; ValueError naming what is wrong, or pyarrow's error for a damaged
        file (the caller warns and rebuilds)."""
        memo = ColumnFile(data)
        meta = memo.meta
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("data_url") != data_url:
            raise ValueError(f"it belongs to data set {meta.get('data_url')!r}")
        tensors = memo.columns()  # a flipped byte fails its page CRC
        count = int(meta["count"])
        paths = tensors["paths"].tobytes().decode("utf-8").split(_SEP)
        by_mtime = meta.get("versions") == "mtime_ns"
        if by_mtime:
            versions = tensors["mtimes"].tolist()
        else:
            versions = tensors["versions"].tobytes().decode("utf-8").split(_SEP)
        sizes = tensors["sizes"].tolist()
        digests = tensors["digests"]
        if not (len(paths) == len(versions) == len(sizes) == count) or len(digests) != 32 * count:
            raise ValueError(f"its columns disagree with its count {count}")
        memo = cls(by_mtime)
        memo._index = dict(zip(paths, range(count)))
        if len(memo._index) != count:
            raise ValueError("it names a path twice")
        memo._sizes, memo._versions, memo._digests = sizes, versions, digests.tobytes()
        return memo


def _trusted(listing: Listing, digests: Mapping[str, bytes]) -> list[str]:
    """The paths of `digests` that may be kept: a known version, and on disks an mtime older
    than the listing's start by TRUST_MARGIN_NS."""
    margin = listing.started_ns - TRUST_MARGIN_NS
    files = listing.files
    return [
        p
        for p in digests
        if files[p][1] is not None and (not listing.by_mtime or files[p][1] < margin)
    ]


def _columns(
    paths: list[str],
    sizes: list[int],
    versions: list[Any],
    digests: bytes,
    by_mtime: bool,
    data_url: str,
) -> bytes:
    """The memo file: columns and header (see the module docstring)."""
    tensors = {
        "paths": np.frombuffer(_SEP.join(paths).encode("utf-8"), dtype=np.uint8),
        "sizes": np.array(sizes, dtype=np.int64),
        "digests": np.frombuffer(digests, dtype=np.uint8),
    }
    if by_mtime:
        tensors["mtimes"] = np.array(versions, dtype=np.int64)
    else:
        tensors["versions"] = np.frombuffer(_SEP.join(map(str, versions)).encode(), np.uint8)
    meta = {"format": FORMAT, "data_url": data_url, "count": str(len(paths))}
    meta["versions"] = "mtime_ns" if by_mtime else "etag"
    return write_columns(tensors, meta)


def needs_save(listing: Listing, fresh: Mapping[str, bytes], loaded: int, hits: int) -> bool:
    """True when the memo on storage would change: entries it holds went stale or unused, or a
    newly hashed file may be kept (racy ones are hashed again next run anyway)."""
    if loaded != hits:
        return True
    if not listing.by_mtime:
        return bool(fresh)
    margin = listing.started_ns - TRUST_MARGIN_NS
    return any(listing.files[p][1] < margin for p in fresh)


def data_url_of(source: DataSource) -> str:
    """The data set's identity in the memo: its URL (an absolute path on disks)."""
    return os.path.abspath(source.local_root) if source.local else source.url


def memo_location(cache: Any, source: DataSource) -> tuple[Any, str, str]:
    """(fs, path, URL) of the memo of this data set under `cache` (a CacheConfig)."""
    options = with_credentials(
        cache.url, cache.storage_options, cache.credentials_block, field="cache.credentials_block"
    )
    fs, root = open_fs(cache.url, options, field="cache.url")
    name = hashlib.sha256(data_url_of(source).encode("utf-8")).hexdigest()[:32] + SUFFIX
    return fs, join(root, FOLDER, name), f"{cache.url.rstrip('/')}/{FOLDER}/{name}"


# Memo failures every cache operation meets too: the run stops on the cache's own one line.
CACHE_WIDE = (StorageCredentialsError, StorageUnreachableError, StorageBucketNotFoundError)
CACHE_FIELD = "cache.storage_options"  # the memos live under cache.url


def stop_if_cache_unusable(exc: BaseException, fs: Any, url: str, action: str) -> None:
    """Raise the cache's error when a memo failed for a reason the cache cannot survive (no or
    wrong credentials, an unreachable endpoint, no bucket) instead of warning about each memo."""
    options = getattr(fs, "storage_options", None)
    mapped = exc if isinstance(exc, CACHE_WIDE) else translate_error(exc, url, action, options)
    if isinstance(mapped, CACHE_WIDE):
        if mapped is not exc:
            mapped = translate_error(exc, url, action, options, field=CACHE_FIELD)
        raise mapped from None


def load_memo(fs: Any, path: str, url: str, source: DataSource) -> HashMemo:
    """The memo at `path`; an empty one when missing, or (with one warning line) unusable."""
    try:
        fs.invalidate_cache(path.rsplit("/", 1)[0])  # another worker may have written it
        data = fs.cat_file(path)
    except FileNotFoundError:
        return HashMemo()
    except Exception as exc:  # unreadable: only costs time
        stop_if_cache_unusable(exc, fs, url, "read")
        log.warning("hash memo %s not read (%s); hashing every image", url, type(exc).__name__)
        return HashMemo()
    try:
        return HashMemo.decode(data, data_url_of(source))
    except Exception as exc:
        log.warning("hash memo %s is unusable (%s); ignoring it and rebuilding it", url, exc)
        return HashMemo()


# The cache folder cannot be written at all: preprocess refuses it in one line of its own (before
# indexing); `train` and `validate` may read a read-only cache, where the memo is only not kept.
UNWRITABLE = (StorageReadOnlyError, StoragePermissionError, StorageFullError)


def save_memo(fs: Any, path: str, url: str, data: bytes) -> None:
    """Write the memo atomically; a failure is one warning line (the memo only saves time), and
    none where the cache cannot be written at all (read-only, forbidden or full)."""
    try:
        write_atomic(fs, path, data, url, field=CACHE_FIELD)
    except UNWRITABLE as exc:
        log.debug("hash memo %s not written: %s", url, exc)
    except Exception as exc:
        stop_if_cache_unusable(exc, fs, url, "write")
        log.warning("hash memo %s not written (%s); the next run hashes again", url, exc)
