"""The cache manifest: the preprocessing coordinator's record of a run, its sample list compact.

`manifest.json` is JSON. Its sample keys (a million would be 70 MB of JSON, seconds to parse)
go into a Parquet key table `manifest-samples-<sha256[:16]>.parquet` beside it, written
first; the manifest names it with its sha256 and count (`samples_file`). Both writes are atomic
and the name follows the bytes, so a reader sees the old pair or the new one. Readers get
`samples` as a `KeyTable` (a sorted Sequence[str]), and never `samples_file`. Nothing is
unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from splitstage.tasks.cache.cache_errors import CacheCorruptError
from splitstage.tasks.cache.index_entry import all_names
from splitstage.tasks.cache.key_table import SUFFIX, KeyFileError, KeyTable

MANIFEST = "manifest.json"
SAMPLES_FILE = "samples_file"
_SAMPLES_NAME = re.compile(r"^manifest-samples-[0-9a-f]{16}\.parquet$")
_REWRITE = "rerun preprocess to rewrite it"


def _not_a_manifest(where: str, why: str) -> CacheCorruptError:
    """The one-line error for a manifest that is not what splitstage writes."""
    return CacheCorruptError(f"manifest {where} is not a splitstage manifest ({why}); {_REWRITE}")


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """Return a stored manifest (JSON bytes, or parsed) after checking its shape: an object
    whose 'samples_file', when there, names a samples file with its sha256 and count (its
    sample keys are never inline); CacheCorruptError naming `where`."""
    with contextlib.suppress(ValueError, RecursionError):
        manifest = json.loads(manifest) if isinstance(manifest, bytes) else manifest
    if not isinstance(manifest, dict):
        raise _not_a_manifest(where, "not a JSON object")
    if "samples" in manifest:
        raise _not_a_manifest(where, f"its sample keys are inline, not in a '{SAMPLES_FILE}'")
    named = manifest.get(SAMPLES_FILE)
    if named is not None:
        ok = isinstance(named, dict) and _SAMPLES_NAME.match(str(named.get("name", "")))
        ok = ok and isinstance(named.get("sha256"), str) and type(named.get("count")) is int
        if not ok:
            raise _not_a_manifest(where, f"a bad '{SAMPLES_FILE}' field: {named!r}")
    return manifest


def sample_table(samples: Any, where: str) -> KeyTable:
    """The manifest's `samples` (a KeyTable, or a list of sample keys) as a KeyTable."""
    if isinstance(samples, KeyTable):
        return samples
    if not isinstance(samples, (list, tuple)) or not all(isinstance(k, str) for k in samples):
        raise _not_a_manifest(where, "'samples' is not a list of sample keys")
    if not all_names(samples):
        raise _not_a_manifest(where, "'samples' holds a name that is not a sample key")
    return KeyTable.from_keys(samples)


def encode_manifest(
    manifest: Mapping[str, Any], where: str
) -> tuple[bytes, tuple[str, bytes] | None]:
    """The manifest's JSON bytes and, when it has `samples`, the samples file (name, bytes)
    that the JSON names in their place."""
    record = dict(manifest)
    samples_file = None
    if "samples" in record:
        table = sample_table(record.pop("samples"), where)
        data = table.to_bytes()
        digest = hashlib.sha256(data).hexdigest()
        name = f"manifest-samples-{digest[:16]}{SUFFIX}"
        record[SAMPLES_FILE] = {"name": name, "sha256": digest, "count": len(table)}
        samples_file = (name, data)
    check_manifest(record, where)
    return json.dumps(record, sort_keys=True, indent=2).encode(), samples_file


def decode_samples(manifest: dict[str, Any], data: bytes | None, where: str) -> dict[str, Any]:
    """The manifest as readers see it: the named samples file's keys (`data`, checked against
    the sha256 and count the manifest records) under `samples`; CacheCorruptError if they
    do not match."""
    out = dict(manifest)
    named = out.pop(SAMPLES_FILE, None)
    if named is None:  # a manifest of no samples
        return out
    file_where = f"{where.rsplit('/', 1)[0]}/{named['name']}"
    if data is None:
        raise CacheCorruptError(
            f"samples file {file_where}, which manifest {where} names, is missing; {_REWRITE}"
        )
    if hashlib.sha256(data).hexdigest() != named["sha256"]:
        raise CacheCorruptError(
            f"samples file {file_where} fails its checksum (the manifest records another "
            f"sha256); {_REWRITE}"
        )
    try:
        table = KeyTable.from_bytes(data, file_where)
    except KeyFileError as exc:
        raise CacheCorruptError(f"{exc}".split("; ")[0] + f"; {_REWRITE}") from None
    if len(table) != named["count"]:
        raise CacheCorruptError(
            f"samples file {file_where} holds {len(table)} keys, the manifest says "
            f"{named['count']}; {_REWRITE}"
        )
    out["samples"] = table
    return out


def samples_file_name(manifest: Mapping[str, Any] | None) -> str | None:
    """The samples file a raw (as stored) manifest names, if any."""
    named = (manifest or {}).get(SAMPLES_FILE)
    return named.get("name") if isinstance(named, dict) else None
