"""The one reader of safetensors headers and shard indexes (JSON, never pickle): parse, sniff;
and of a local file's tensors, mapped from disk (torch and safetensors imported on that call),
whose pages a reader that copied them can hand back (`drop_mapped_pages`)."""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
from pathlib import Path
from typing import Any

from splitstage.splitter import UserError

_SIZE = 8  # the header starts with its byte length, little-endian u64

INDEX_SUFFIX = ".safetensors.index.json"  # what save_pretrained(max_shard_size=...) writes


def _split(data: bytes) -> tuple[int, dict[str, Any]]:
    """(the header's byte length, the header) of safetensors bytes; ValueError saying what is
    wrong (shorter than the size field, a size past the end, not a JSON object)."""
    if len(data) < _SIZE:
        raise ValueError(f"safetensors bytes too short ({len(data)} bytes, no header size)")
    size = int.from_bytes(data[:_SIZE], "little")
    if size > len(data) - _SIZE:
        raise ValueError(
            f"safetensors header of {size} bytes runs past the end ({len(data) - _SIZE} follow)"
        )
    try:
        header = json.loads(data[_SIZE : _SIZE + size])
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"safetensors header is a JSON {type(header).__name__}, not an object")
    return size, header


def read_header(data: bytes) -> dict[str, Any]:
    """The JSON header of safetensors bytes (tensor specs plus `__metadata__`), in file order;
    `data` may be the whole file or only its first bytes (as far as the header reaches). The
    one parser of header bytes: files that are local and whole are read by `safetensors.safe_open`.
    """
    return _split(data)[1]


def read_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` strings of safetensors bytes ({} if none)."""
    metadata = read_header(data).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"safetensors __metadata__ is a {type(metadata).__name__}, not an object")
    return metadata


def looks_like_safetensors(head: bytes) -> bool:
    """True when bytes start like safetensors (8-byte header size, then '{'), not a zip."""
    return len(head) > _SIZE and head[:2] != b"PK" and head[_SIZE : _SIZE + 1] == b"{"


def is_index_path(path: str) -> bool:
    """True for a JSON path (a sharded-weights index, `*.safetensors.index.json`), by its name:
    a JSON file is parsed as an index, never handed to a binary reader."""
    return path.lower().endswith(".json")


def index_weight_map(data: bytes) -> dict[str, str]:
    """The {tensor name: shard file} map of a sharded-safetensors index's bytes; a ValueError
    says what is wrong (not JSON, no weight_map, a non-string shard name)."""
    try:
        index = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"is not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            'has no "weight_map" object ({tensor name: shard file}) as save_pretrained writes'
        )
    bad = sorted(str(k) for k, v in weight_map.items() if not isinstance(v, str) or not v)
    if bad:
        raise ValueError(f"has a weight_map without a shard file name for {', '.join(bad[:5])}")
    return weight_map


def canonical(data: bytes) -> bytes:
    """Re-serialize the header with sorted keys: safetensors orders metadata randomly, and equal
    weights must give equal file bytes (file hashes feed cache keys)."""
    size, header = _split(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data section 8-byte aligned
    return len(text).to_bytes(_SIZE, "little") + text + data[_SIZE + size :]


def mapped_state(path: str | Path) -> dict[str, Any]:
    """Every tensor of a local .safetensors file, or of the shards its .safetensors.index.json
    lists, mapped copy-on-write from disk rather than read: a frozen model costs its pages in
    the page cache, touched as it runs, and no anonymous copy. One line names a bad file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if is_index_path(str(path)):
        try:
            weight_map = index_weight_map(path.read_bytes())
        except (OSError, ValueError) as error:
            raise UserError(f"{path} {error}") from None
        state: dict[str, Any] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(mapped_state(path.parent / shard))
        return state
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"{path}: not a readable safetensors file ({reason})") from None


def drop_mapped_pages(tensor: Any) -> int:
    """Hand back this process's pages of a CPU tensor that is a view of a file mapped
    copy-on-write (`safe_open(...).get_tensor`, `mapped_state`) and was never written: its
    whole pages leave the resident set (the page cache keeps them; a later read maps them
    again), so a loader that copied the tensor elsewhere does not hold the file beside its copy.
    Only for such views: on anonymous memory the pages would read back as zeros. Returns the
    bytes handed back (0 where the OS has no madvise: not Linux)."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
    if last <= first:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if madvise(first, last - first, mmap.MADV_DONTNEED) != 0:
        return 0
    return last - first
