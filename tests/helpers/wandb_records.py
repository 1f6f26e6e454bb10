"""Read an offline W&B run file (`run-*.wandb`): wandb 0.31's Go core ships no Python reader.

The file is a 7-byte header (`:W&B`, magic, version) then LevelDB's log format: 32 KiB blocks of
chunks, each a 7-byte header (crc32c, little-endian length, type: 1 full, 2 first, 3 middle,
4 last) and its bytes; a record is one protobuf `Record` (wandb.proto.wandb_internal_pb2).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[bytes]:
    """The raw records of the file, chunks joined."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pending, at = [], b"", HEADER
    while at + HEADER <= len(data):
        left_in_block = BLOCK - at % BLOCK
        if left_in_block < HEADER:  # the block's tail is padding
            at += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + HEADER])
        chunk = data[at + HEADER : at + HEADER + length]
        at += HEADER + length
        if kind == 0 and length == 0:  # zero padding
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(pending)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Every `history` record (what `wandb.log` wrote) as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows
