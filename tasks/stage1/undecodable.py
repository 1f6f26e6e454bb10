"""Rows skipped as undecodable (`data.skip_bad_rows`): named in the report, not decoded again.

A worker that cannot decode a row's image under `skip_bad_rows` records it beside the cache
(`undecodable/<sample_key>.json`: the reason and the decoder), so later runs know it without
decoding it again: the coordinator's all-cached check (a rerun with nothing new starts no worker
and loads no model), the workers, and the manifest of a run whose shards ran on other machines.
A sample key hashes the image bytes (a fixed file is a new key), and a record counts only under
the same decoder (splitstage's image and video decode versions and Pillow's): after an upgrade
those rows are tried again, and `preprocess --verify` tries them all again.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import PIL

from splitstage.data.dataset import DataError, Row
from splitstage.data.images import DECODE_VERSION
from splitstage.data.index import DataIndex
from splitstage.data.source import DataSource
from splitstage.data.videos import VIDEO_DECODE_VERSION
from splitstage.tasks.cache.store import CacheStore

FOLDER = "undecodable"
IMAGE = "{image}"  # stands for the image's path or URL in a recorded reason
REFERENCE = "{reference%d}"  # stands for the row's i-th reference image's path or URL
DECODER = f"{DECODE_VERSION}+{VIDEO_DECODE_VERSION}+pillow-{PIL.__version__}"


def record(
    store: CacheStore, key: str, row: Row | None, error: DataError, source: DataSource
) -> str:
    """Keep that `key`'s image did not decode; the reason, with its row and image path left
    out (`IMAGE`): the same bytes may sit on another row or path later."""
    reason = str(error)
    if row is not None:
        reason = reason.removeprefix(f"{row.where}: ").replace(source.display(row.image), IMAGE)
        for i, ref in enumerate(row.references):
            reason = reason.replace(source.display(ref), REFERENCE % i)
    store.write_record(FOLDER, key, {"reason": reason, "decoder": DECODER})
    return reason


Records = dict[str, dict[str, Any]]  # every record by sample key, as `store.read_records` gives


def known(
    store: CacheStore, keys: Collection[str], records: Records | None = None
) -> dict[str, str]:
    """{key: reason} of the `keys` recorded as undecodable by this decoder (`records`, if the
    caller read them already; else one listing)."""
    records = store.read_records(FOLDER) if records is None else records
    mine = {
        key: str(value.get("reason", "undecodable"))
        for key, value in records.items()
        if value.get("decoder") == DECODER
    }
    if not mine:
        return {}
    return {key: mine[key] for key in keys if key in mine}


def forget(store: CacheStore, committed: Collection[str], records: Records) -> None:
    """Drop the `records` of samples now cached (a retry under a newer decoder succeeded)."""
    store.remove_records(FOLDER, [key for key in records if key in committed])


def skipped_rows(data: DataIndex, reasons: dict[str, str]) -> list[tuple[int, str]]:
    """(line, message naming the row and image path now) of each undecodable key, in order."""
    if not reasons:
        return []
    found = [(i, key) for i, key in enumerate(data.keys) if key in reasons]  # rows may be lazy
    out = []
    for i, key in found:
        row = data.rows[i]
        shown = data.source.display if data.source is not None else str
        reason = reasons[key].replace(IMAGE, shown(row.image))
        for i, ref in enumerate(row.references):
            reason = reason.replace(REFERENCE % i, shown(ref))
        out.append((row.line, f"{row.where}: {reason}"))
    return out
