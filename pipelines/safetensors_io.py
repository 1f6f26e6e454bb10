"""The one reader of safetensors headers (JSON, never pickle): parse, sniff, re-serialize."""

from __future__ import annotations

import json
import struct
from typing import Any

_SIZE = 8  # the header starts with its byte length, little-endian u64


def read_header(data: bytes) -> dict[str, Any]:
    """The JSON header of safetensors bytes (tensor specs plus `__metadata__`)."""
    (size,) = struct.unpack("<Q", data[:_SIZE])
    return json.loads(data[_SIZE : _SIZE + size])


def read_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` strings of safetensors bytes ({} if none)."""
    return read_header(data).get("__metadata__") or {}


def looks_like_safetensors(head: bytes) -> bool:
    """True when bytes start like safetensors (8-byte header size, then '{'), not a zip."""
    return len(head) > _SIZE and head[:2] != b"PK" and head[_SIZE : _SIZE + 1] == b"{"


def canonical(data: bytes) -> bytes:
    """Re-serialize the header with sorted keys: safetensors orders metadata randomly, and equal
    weights must give equal file bytes (file hashes feed cache keys)."""
    (size,) = struct.unpack("<Q", data[:_SIZE])
    header = json.loads(data[_SIZE : _SIZE + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data section 8-byte aligned
    return struct.pack("<Q", len(text)) + text + data[_SIZE + size :]
