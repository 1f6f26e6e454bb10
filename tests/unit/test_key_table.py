"""Key files: written as Parquet, read back equal; any other file (the safetensors format of an
unreleased build among them) and damage are a KeyFileError naming the file."""

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
def test_tables_are_written_as_parquet_and_read_back_equal(keys):
    table = KeyTable.from_keys(keys)
    data = table.to_bytes()
    assert data[:4] == b"PAR1"
    assert KeyTable.from_bytes(data, "new") == table and len(table) == len(set(keys))


def test_a_safetensors_key_file_is_refused_naming_it():
    with pytest.raises(KeyFileError, match="old.safetensors is not a splitstage sample-keys file"):
        KeyTable.from_bytes(old_bytes(KeyTable.from_keys(HEX)), "old.safetensors")


def test_a_manifest_with_inline_samples_or_a_safetensors_samples_file_is_refused():
    where = "cache/manifest.json"
    with pytest.raises(mf.CacheCorruptError, match="manifest.json is not a splitstage manifest"):
        mf.check_manifest({"samples": HEX[:3]}, where)
    named = {"name": "manifest-samples-0123456789abcdef.safetensors", "sha256": "x", "count": 3}
    with pytest.raises(mf.CacheCorruptError, match="a bad 'samples_file' field"):
        mf.check_manifest({"samples_file": named}, where)


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
