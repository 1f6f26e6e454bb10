"""Metadata files parsed from their bytes: csv, jsonl and parquet, each as (row number, record or
the DataError of a bad row) pairs, with file-level problems raised as DataErrors naming the line.

CSV rows count the header as row 1; JSONL rows are file lines; parquet rows count from 1. Text
must be UTF-8 (a BOM is fine); a file names its samples in an 'image' or a 'video' column (or
both, one per row: DiffSynth-Studio's video metadata) next to 'prompt'; parquet's 'image',
'video' and 'prompt' columns must hold strings.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from collections.abc import Iterator, Sequence
from typing import Any

from splitstage.data.images import DataError

REQUIRED_COLUMNS = ("image", "prompt")
FILE_COLUMNS = ("image", "video")  # a row names its file in one of these (DiffSynth's video rows)
# A row's reference images (edit / kontext / image-to-video inputs): DiffSynth's 'edit_image', or
# the alias 'control_image' (ai-toolkit's and musubi-tuner's "control" images); a path or a list.
REFERENCE_COLUMNS = ("edit_image", "control_image")
METADATA_SUFFIXES = (".csv", ".jsonl", ".parquet")
Records = Iterator[tuple[int, "dict[str, Any] | DataError"]]


def decode_text(data: bytes, name: str, url: str) -> str:
    """A metadata file's bytes as text; DataError naming the line of bad bytes (not UTF-8, NUL)."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DataError(f"{name} is UTF-16 text; save it as UTF-8 (e.g. 'CSV UTF-8')")
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise DataError(
            f"{name} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
            f"{column}); save the file as UTF-8"
        ) from None
    if (nul := text.find("\0")) >= 0:
        raise DataError(
            f"{name} line {text.count(chr(10), 0, nul) + 1}: NUL byte; the file is binary or "
            "UTF-16, save it as UTF-8 text"
        )
    if not text.strip():
        raise DataError(f"metadata file {url} is empty; add an 'image,prompt' header and rows")
    return text


def check_columns(columns: Sequence[str], name: str, where: str) -> None:
    """DataError unless 'prompt' and 'image' or 'video' (or both) are among `columns`."""
    missing = [] if any(c in columns for c in FILE_COLUMNS) else ["image"]
    missing += [] if "prompt" in columns else ["prompt"]
    if missing:
        found = ", ".join(repr(c) for c in columns) or "none"
        raise DataError(
            f"{name} {where}: missing column(s) {', '.join(repr(c) for c in missing)}; "
            f"columns found: {found}. Rename them to 'image' (or 'video') and 'prompt'."
        )


def _csv_problem(exc: csv.Error) -> str:
    """csv's error message, said as what to change."""
    text = str(exc)
    if "unexpected end of data" in text:
        return 'a quote (") opened here is never closed; close it or double quotes inside cells'
    if "field larger than field limit" in text:
        return (
            f"a cell is longer than {csv.field_size_limit():,} characters (an unclosed quote?); "
            "close the quote or shorten the cell"
        )
    if "expected after" in text:
        return 'text after a closing quote; quote the whole cell and write inner quotes as ""'
    return f"bad CSV ({text})"


def csv_records(data: bytes, name: str, url: str, line_offset: int = 0) -> Records:
    """Records of a CSV file (as csv.DictReader with restval=''; cells past the header go under
    None). Strict quoting: an unclosed quote is an error naming its row, never a caption that
    silently swallows the rest of the file."""
    reader = csv.reader(io.StringIO(decode_text(data, name, url), newline=""), strict=True)
    try:
        columns = next(reader, [])
    except csv.Error as exc:
        raise DataError(f"{name} row 1 (header): {_csv_problem(exc)}") from exc
    check_columns(columns, name, "row 1 (header)")
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise DataError(
            f"{name} row 1 (header): column(s) {', '.join(map(repr, repeated))} appear "
            "more than once; rename or remove the copies"
        )
    width = len(columns)
    while True:
        start = reader.line_num + 1 + line_offset
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DataError(f"{name} row {start}: {_csv_problem(exc)}") from exc
        if not cells:
            continue  # a blank line
        record: dict[Any, Any] = dict(zip(columns, cells))
        if len(cells) < width:
            record.update((c, "") for c in columns[len(cells) :])
        elif len(cells) > width:
            record[None] = cells[width:]
        yield reader.line_num + line_offset, record  # the line a record ends on (blanks count)


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) != len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise _RepeatedKey(f"key {key!r} appears twice; keep one")
    return record


def json_kind(value: Any) -> str:
    """'a number (3)', 'a list', 'null': a JSON value's type, for messages."""
    if value is None:
        return "null"
    kind = {bool: "true/false", str: "text", list: "a list", dict: "an object"}.get(type(value))
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{kind or 'a number'} ({shown})"


def jsonl_records(
    data: bytes, name: str, url: str, max_line_chars: int, line_offset: int = 0
) -> Records:
    """Records of a JSONL file; a bad line is a row error (so skip_bad_rows can skip it)."""
    lines = io.StringIO(decode_text(data, name, url), newline=None)
    for line_no, line in enumerate(lines, start=1 + line_offset):
        if not line.strip():
            continue
        where = f"{name} row {line_no}"
        if len(line) > max_line_chars:
            message = (
                f"{where}: line is {len(line):,} characters, over the limit of "
                f"{max_line_chars:,}; shorten it (one JSON object a line)"
            )
            yield line_no, DataError(message)
            continue
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            message = (
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be "
                "one JSON object"
            )
            yield line_no, DataError(message)
            continue
        except RecursionError:
            yield line_no, DataError(f"{where}: JSON nested too deeply; one flat object a line")
            continue
        except ValueError as exc:  # a repeated key, an integer too long to convert
            yield line_no, DataError(f"{where}: not usable JSON ({exc})")
            continue
        if not isinstance(record, dict):
            kind = json_kind(record)
            record = DataError(
                f"{where}: expected a JSON object with 'image' (or 'video') and 'prompt', "
                f"got {kind}"
            )
        yield line_no, record


def parquet_records(data: bytes, name: str, url: str) -> Records:
    """Records of a parquet file: 'image' and/or 'video' and 'prompt' string columns, other
    columns as extras."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(
            f"{name}: not a readable parquet file ({str(exc)[:200]}); write it with "
            "pandas.DataFrame.to_parquet or pyarrow.parquet.write_table"
        ) from None
    columns = list(table.column_names)
    check_columns(columns, name, "(columns)")
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise DataError(
            f"{name}: column(s) {', '.join(map(repr, repeated))} appear more than once; "
            "rename or remove the copies"
        )
    for column in (c for c in REFERENCE_COLUMNS if c in columns):
        kind = table.schema.field(column).type
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        inner = kind.value_type if listed else kind
        if not (pa.types.is_string(inner) or pa.types.is_large_string(inner) or inner == pa.null()):
            raise DataError(
                f"{name}: column {column!r} is {kind}, not strings; store each reference image "
                "path (relative to the base folder) as a string, or a list of strings"
            )
    for column in (c for c in (*FILE_COLUMNS, "prompt") if c in columns):
        kind = table.schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or kind == pa.null()):
            what = (
                f"the {column} path relative to the base folder" if column != "prompt" else "text"
            )
            raise DataError(
                f"{name}: column {column!r} is {kind}, not strings; store {what} as strings"
            )
    if table.num_rows == 0:
        return
    values = [table.column(c).to_pylist() for c in columns]
    for number, cells in enumerate(zip(*values, strict=True), start=1):
        yield number, dict(zip(columns, cells))


def records(data: bytes, name: str, url: str, max_line_chars: int, line_offset: int = 0) -> Records:
    """The records of a metadata file, by its suffix (.csv, .jsonl, .parquet); `line_offset`
    numbers the rows of an appended part (csv: after its header line) as in the whole file."""
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    if suffix == ".csv":
        return csv_records(data, name, url, line_offset)
    if suffix == ".jsonl":
        return jsonl_records(data, name, url, max_line_chars, line_offset)
    if suffix == ".parquet":
        return parquet_records(data, name, url)
    raise DataError(
        f"metadata file {url} is not .csv or .jsonl (nor .parquet); convert it to one of those"
    )
