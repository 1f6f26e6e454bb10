"""storage/parquet_columns.py: named numeric columns round-trip through one Parquet file, a
flipped byte or a cut file raises, and only the listed column types are written or read."""

from __future__ import annotations

import numpy as np
import pytest

from splitstage.storage import parquet_columns
from splitstage.storage.parquet_columns import ColumnFile, write_columns


def test_columns_and_metadata_round_trip_flattened(monkeypatch):
    monkeypatch.setattr(parquet_columns, "PIECE", 5)
    columns = {
        "text": np.frombuffer("ü\0b".encode(), np.uint8),
        "rows": np.arange(64, dtype=np.uint8).reshape(2, 32),
        "small": np.array([-1, 2**31 - 1], np.int32),
        "big": np.array([2**40, -3], ">i8"),  # big endian in memory: stored little endian
        "empty": np.zeros(0, np.int64),
    }
    file = ColumnFile(write_columns(columns, {"format": "f", "n": "2"}))
    assert file.meta == {"format": "f", "n": "2"}
    got = file.columns()
    assert sorted(got) == sorted(columns)
    for name, column in columns.items():
        assert got[name].dtype.name == column.dtype.name
        assert np.array_equal(got[name], column.reshape(-1))
        assert not got[name].flags.writeable  # a view of the file's buffers


def test_a_flipped_byte_fails_the_page_checksum_and_a_cut_file_the_footer():
    data = write_columns({"text": np.frombuffer(b"a prompt to damage" * 4, np.uint8)}, {})
    at = data.index(b"a prompt to damage")
    flipped = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
    with pytest.raises(OSError, match="CRC"):
        ColumnFile(flipped).columns()
    with pytest.raises(Exception):  # noqa: B017 (pyarrow's error for a file without footer)
        ColumnFile(data[: len(data) // 2])


def test_only_the_listed_types_are_written():
    with pytest.raises(ValueError, match="float32"):
        write_columns({"x": np.zeros(2, np.float32)}, {})
