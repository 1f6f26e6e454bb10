"""Key files: written as Parquet, read back equal; the earlier safetensors files (a cache
manifest's samples file written before the change) still read; damage is a KeyFileError."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from splitstage.storage.parquet_columns import write_columns
from splitstage.tasks.cache import manifest as mf
from splitstage.tasks.cache.key_table import KeyFileError, KeyTable

HEX = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(5)]
ASCII = ["a-1", "b", "Zz", "a"]


def old_bytes(table: KeyTable) -> bytes:
    """The file the safetensors format wrote for `table` (its uint8 [N, width] tensor)."""
    rows = np.frombuffer(table.array.tobytes(), np.uint8)
    rows = rows.reshape(len(table), table.array.dtype.itemsize)  # as the old to_bytes did
    meta = {"format": 1, "encoding": "hex" if table.hexed else "ascii"}
    return st_save({"keys": rows}, metadata={"splitstage-keys": json.dumps(meta)})


@pytest.mark.parametrize("keys", [HEX, ASCII, []], ids=["hex", "ascii", "empty"])
def test_tables_are_written_as_parquet_and_old_files_still_read(keys):
    table = KeyTable.from_keys(keys)
    data = table.to_bytes()
    assert data[:4] == b"PAR1"
    assert KeyTable.from_bytes(data, "new") == table and len(table) == len(set(keys))
    assert KeyTable.from_bytes(old_bytes(table), "old") == table


def test_a_manifest_naming_an_old_samples_file_still_reads():
    data = old_bytes(KeyTable.from_keys(HEX[:3]))
    named = {"name": "manifest-samples-x.safetensors", "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"samples_file": {**named, "count": 3}, "report": {}}
    got = mf.decode_samples(manifest, data, "cache/manifest.json")
    assert list(got["samples"]) == sorted(HEX[:3]) and "samples_file" not in got


def test_a_flipped_byte_or_a_wrong_count_is_a_key_file_error_naming_it():
    data = KeyTable.from_keys(HEX).to_bytes()
    raw = bytes.fromhex(sorted(HEX)[2])
    at = data.index(raw)
    flipped = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
    with pytest.raises(KeyFileError, match="k.parquet is not a splitstage sample-keys file.*CRC"):
        KeyTable.from_bytes(flipped, "k.parquet")
    table = KeyTable.from_keys(HEX)
    rows = np.frombuffer(table.array.tobytes(), np.uint8)
    meta = {"format": "splitstage-keys-v2", "encoding": "hex", "width": "32", "count": "4"}
    with pytest.raises(KeyFileError, match="160 bytes of keys for 4 keys of 32"):
        KeyTable.from_bytes(write_columns({"keys": rows}, meta), "k.parquet")
    with pytest.raises(KeyFileError, match="format"):
        KeyTable.from_bytes(write_columns({"keys": rows}, {**meta, "format": "3"}), "k")
