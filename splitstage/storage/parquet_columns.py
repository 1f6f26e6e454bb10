"""Named 1-D numeric columns and str metadata as one Parquet file (pyarrow), for the memos,
snapshots and key tables: no pickle, no home-made checksum, zero-copy reads.

Each column is stored as Parquet rows (`column`, `dtype`, `piece`): its little-endian bytes cut
into pieces of at most PIECE bytes (a Parquet value or page must stay under 2 GiB; an empty
column is one empty piece). Uncompressed, no dictionary, no statistics, one value per write
batch (so a page ends after any large piece); every page carries Parquet's CRC-32, written and
verified on read, so a flipped byte or a truncated file raises instead of reading wrong. The
metadata is the schema metadata. Shapes are the caller's: it reshapes what it reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PIECE = 256 << 20  # bytes per Parquet value
DTYPES = ("uint8", "int32", "int64")  # the column types a file may hold


def write_columns(columns: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
    """The Parquet file of `columns` (flattened, little endian) with `meta` as schema metadata."""
    names, dtypes, pieces = [], [], []
    for name, column in columns.items():
        if column.dtype.name not in DTYPES:
            raise ValueError(f"column {name} has type {column.dtype}, not one of {DTYPES}")
        raw = np.ascontiguousarray(column, column.dtype.newbyteorder("<"))
        raw = raw.reshape(-1).view(np.uint8)
        ends = np.array([*range(0, max(len(raw), 1), PIECE), len(raw)], np.int64)  # >= 1 piece
        buffers = [None, pa.py_buffer(ends), pa.py_buffer(raw)]  # the bytes are not copied
        pieces.append(pa.Array.from_buffers(pa.large_binary(), len(ends) - 1, buffers))
        names += [name] * (len(ends) - 1)
        dtypes += [column.dtype.name] * (len(ends) - 1)
    table = pa.table(
        {
            "column": pa.array(names, pa.string()),
            "dtype": pa.array(dtypes, pa.string()),
            "piece": pa.chunked_array(pieces, pa.large_binary()),
        }
    ).replace_schema_metadata(dict(meta))
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        compression="none",
        use_dictionary=False,
        write_statistics=False,
        write_page_checksum=True,
        write_batch_size=1,  # a page ends after any piece past 1 MiB: pages stay under 2 GiB
    )
    return sink.getvalue().to_pybytes()


class ColumnFile:
    """A Parquet column file opened from bytes: its metadata now, its columns on `columns()`."""

    def __init__(self, data: bytes) -> None:
        """Parse the footer (a truncated or foreign file raises); pages are checked on read."""
        self._file = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
        found = self._file.schema_arrow.metadata or {}
        self.meta = {k.decode(): v.decode() for k, v in found.items()}

    def columns(self) -> dict[str, np.ndarray]:
        """Every column as a read-only 1-D array viewing the file's buffers (joined only when
        it spans pieces); ValueError for a type outside DTYPES, or one that changes between
        pieces; a page whose CRC-32 fails raises (pyarrow's OSError)."""
        table = self._file.read(use_threads=False)
        pieces: dict[str, list[memoryview]] = {}
        dtypes: dict[str, str] = {}
        rows = zip(
            table.column("column").to_pylist(),
            table.column("dtype").to_pylist(),
            (p for chunk in table.column("piece").chunks for p in _pieces(chunk)),
            strict=True,
        )
        for name, dtype, piece in rows:
            if dtypes.setdefault(name, dtype) != dtype or dtype not in DTYPES:
                raise ValueError(f"its column {name} has type {dtype}")
            pieces.setdefault(name, []).append(piece)
        columns = {}
        for name, parts in pieces.items():
            joined = parts[0] if len(parts) == 1 else b"".join(parts)
            columns[name] = np.frombuffer(joined, np.dtype(dtypes[name]).newbyteorder("<"))
            columns[name].flags.writeable = False  # shared with the file's other columns
        return columns


def _pieces(chunk: pa.LargeBinaryArray) -> list[memoryview]:
    """The values of a binary array as views of its data buffer (iterating would be slower)."""
    _, offsets, data = chunk.buffers()
    ends = np.frombuffer(offsets, np.int64)[chunk.offset : chunk.offset + len(chunk) + 1]
    view = memoryview(data if data is not None else b"")
    return [view[start:end] for start, end in zip(ends[:-1].tolist(), ends[1:].tolist())]
