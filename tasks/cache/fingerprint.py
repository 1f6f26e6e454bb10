"""Content fingerprints: model weights and the cache key (sorted, versioned inputs, stable)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CACHE_FORMAT_VERSION = "splitstage-cache-v1"
_CHUNK = 1 << 20


def file_digest(path: str | Path) -> str:
    """sha256 of a file, memoized on disk by (path, size, mtime) so big weights hash once."""
    path = Path(path).resolve()
    stat = path.stat()
    memo_dir = Path(os.environ.get("SPLITSTAGE_HOME", Path.home() / ".cache" / "splitstage"))
    memo = memo_dir / "file-digests.json"
    token = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if token in known:
        return known[token]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    known[token] = digest.hexdigest()
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    except OSError:
        pass  # a read-only home only costs re-hashing next time
    return known[token]


def stable_hash(payload: Any) -> str:
    """sha256 of canonical JSON (sorted keys): equal inputs give equal keys in any order."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def cache_key(
    *,
    pipeline: str,
    v2_units: list[dict[str, Any]],
    boundary_params: list[str],
    model_fingerprints: dict[str, str],
    settings: dict[str, Any],
    dtype: str,
) -> str:
    """Name of a cache: changes when anything that determines V2's outputs changes, nothing else.

    World size, worker count, batch size, paths and the order of fields do not enter it.
    """
    return stable_hash(
        {
            "format": CACHE_FORMAT_VERSION,
            "pipeline": pipeline,
            "v2_units": v2_units,
            "boundary_params": sorted(boundary_params),
            "models": model_fingerprints,
            "settings": settings,
            "dtype": dtype,
        }
    )[:32]
