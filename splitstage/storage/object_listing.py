"""Object-store listings as many page chains at once: one per folder, and on S3 one per key range.

Listing a prefix is a chain of 1,000-key pages, each request waiting for the one before, so a flat
prefix of a million images costs 1,000 round trips one after another. Folders the rows name are
independent chains; on S3 a folder (or the whole prefix) with many named files is also cut into
ranges of keys at the names the rows give (`StartAfter` = the lower bound, stopped past the upper
one), listed LIST_CONCURRENCY at a time. The ranges cover the key space without gap or overlap
whatever the bounds are, so a file no row names (new, or between two named ones) is found as one
`find` finds it; the names only decide how the work is divided. Each page is checked for the
order this relies on (keys ascending, after StartAfter, under the prefix): a store that breaks it
(S3 Express directory buckets, which are not cut at all, or an S3-compatible store that ignores
StartAfter) gets that folder listed again as one chain, with a warning, never a partial listing.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Awaitable, Sequence
from typing import Any

from fsspec.asyn import sync

log = logging.getLogger(__name__)
LIST_CONCURRENCY = 32  # listing requests in flight
RANGE_KEYS = 3_000  # named keys per key range (3 pages); a folder with fewer than 2x: one chain
MAX_RANGES = 4096  # key ranges per listing at most (bounds the tasks of a huge data set)

Found = dict[str, dict[str, Any]]  # fs path -> fsspec-style info (name, size, type, ETag, ...)


def list_concurrently(fs: Any, root: str, folders: Sequence[str], names: Sequence[str]) -> Found:
    """{path: info} of every file under each of `folders` below `root` ('' is `root` itself;
    recursive, as `fs.find(detail=True)`), listed concurrently on `fs`'s I/O loop; `names`
    (files relative to `root`, as rows name them) set the key ranges on S3. A folder that does
    not exist lists as empty. A folder whose key ranges fail or come back out of order (a store
    that does not sort keys or ignores StartAfter) is listed again as one chain, with a warning."""
    root = root.rstrip("/")
    ranged = _ranges_work(fs, root) and len(names) >= 2 * RANGE_KEYS
    ordered = sorted(names) if ranged else []
    bucket, key = fs.split_path(root)[:2] if ranged else ("", "")
    base = f"{key}/" if key else ""  # a key is base + name
    gate = asyncio.Semaphore(LIST_CONCURRENCY)

    async def chain(listing: Awaitable[Found]) -> Found:
        async with gate:
            return await listing

    async def folder_listing(folder: str) -> Found:
        path = f"{root}/{folder}" if folder else root
        bounds = _bounds(_under(ordered, folder)) if ranged else []
        if bounds:
            edges = [None, *(base + name for name in bounds), None]
            prefix = base + (f"{folder}/" if folder else "")
            ranges = [_list_range(fs, bucket, prefix, a, z) for a, z in zip(edges, edges[1:])]
            parts = await asyncio.gather(*(chain(r) for r in ranges), return_exceptions=True)
            failed = [p for p in parts if isinstance(p, BaseException)]
            if not failed:
                return {name: info for part in parts for name, info in part.items()}
            log.warning(
                "listing %s in %d key ranges failed (%s); listing it as one chain instead",
                path,
                len(ranges),
                f"{type(failed[0]).__name__}: {failed[0]}"[:200],
            )
        return await chain(_find(fs, path))

    async def every() -> list[Found]:
        return await asyncio.gather(*(folder_listing(folder) for folder in folders or [""]))

    found: Found = {}
    for part in sync(fs.loop, every):
        found.update(part)
    return found


class UnorderedListing(Exception):
    """A listing page broke the order key ranges rely on (keys ascending, after StartAfter)."""


def _ranges_work(fs: Any, root: str) -> bool:
    """Whether `fs` lists S3 key ranges: s3fs, not listing object versions, and not an S3
    Express directory bucket (`...--x-s3`: its listings are unordered and take no StartAfter)."""
    if not hasattr(fs, "_call_s3") or getattr(fs, "version_aware", False):
        return False
    return not root.split("/", 1)[0].endswith("--x-s3")


def _under(ordered: list[str], folder: str) -> list[str]:
    """The names (sorted) inside `folder` ('': all): a contiguous run of the sorted list."""
    if not folder:
        return ordered
    start = bisect.bisect_left(ordered, f"{folder}/")
    return ordered[start : bisect.bisect_left(ordered, f"{folder}0")]  # '0' follows '/'


def _bounds(names: list[str]) -> list[str]:
    """Upper bounds of all key ranges but the last (sorted, distinct): every RANGE_KEYS-th name;
    [] where the names fill fewer than two ranges."""
    count = min(len(names) // RANGE_KEYS, MAX_RANGES)
    if count < 2:
        return []
    step = len(names) / count
    return sorted({names[int(i * step) - 1] for i in range(1, count)})


async def _find(fs: Any, path: str) -> Found:
    """`fs._find(path, detail=True)`; {} when nothing is there."""
    try:
        return await fs._find(path, detail=True)
    except FileNotFoundError:
        return {}


async def _list_range(
    fs: Any, bucket: str, prefix: str, after: str | None, last: str | None
) -> Found:
    """Files whose keys start with `prefix` and lie in (`after`, `last`] (None: unbounded), from
    ListObjectsV2 pages until one reaches `last` (folder marker objects, keys ending in '/',
    included as `find` includes them)."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    if after is not None:
        kwargs["StartAfter"] = after
    found: Found = {}
    previous = after
    while True:
        page = await fs._call_s3("list_objects_v2", **kwargs)
        for item in page.get("Contents", ()):
            key = item["Key"]
            if (previous is not None and key <= previous) or not key.startswith(prefix):
                raise UnorderedListing(f"key {key!r} came after {previous!r}")
            previous = key
            if last is not None and key > last:
                return found
            name = f"{bucket}/{key}"
            found[name] = {
                "name": name,
                "size": item.get("Size", 0),
                "type": "file",
                "ETag": item.get("ETag"),
                "LastModified": item.get("LastModified"),
            }
            if key == last:  # the bound itself (a named file, usually there): no page more
                return found
        if not page.get("IsTruncated"):
            return found
        kwargs.pop("StartAfter", None)
        kwargs["ContinuationToken"] = page["NextContinuationToken"]
