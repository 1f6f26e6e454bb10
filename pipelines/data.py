"""Image-caption data sets in DiffSynth-Studio's format: a base folder plus a metadata file.

The metadata file is `metadata.csv` (header row) or `metadata.jsonl` (one JSON object a line) with
an `image` column (path relative to the base folder) and a `prompt` column; any other column is
kept as a per-sample field. Bad data raises `DataError` naming the file, the row as numbered in the
file (CSV rows count the header as row 1) and how to fix it. Metadata must be UTF-8 (a UTF-8
BOM is fine); bytes that are not, NUL bytes, an empty file, broken CSV quoting and repeated columns
are file-level errors naming the line; a bad JSONL line (invalid or too deeply nested JSON, a
repeated key, a line over MAX_LINE_CHARS, 'image'/'prompt' of the wrong JSON type) is a row error,
so `skip_bad_rows` can skip it. Images decode as `splitstage.pipelines.images` documents.

A sample key is a content hash of the image file bytes, the prompt and the extra fields: renaming,
moving or reordering files keeps keys (so the stage-1 cache stays valid); editing an image or a
caption changes them. Processing choices such as the image size belong to the cache key instead.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from splitstage.pipelines.images import (
    DataError,
    center_crop_resize,
    check_file_size,
    image_to_tensor,
    open_image,
    to_rgb8,
)

REQUIRED_COLUMNS = ("image", "prompt")
METADATA_NAMES = ("metadata.csv", "metadata.jsonl")
SAMPLE_KEY_VERSION = "splitstage-sample-v1"
MAX_LINE_CHARS = 1 << 20  # a JSONL line longer than this is refused, not parsed


@dataclass(frozen=True)
class Row:
    """One metadata row: image path (relative to the base folder), prompt and extra fields."""

    line: int  # line number in the file, 1-based (a CSV header is row 1)
    image: str
    prompt: str
    extras: dict[str, Any] = field(default_factory=dict)
    source: str = "metadata"  # metadata file name, for messages

    @property
    def where(self) -> str:
        """'metadata.csv row 3', for error messages."""
        return f"{self.source} row {self.line}"


class Skipped(NamedTuple):
    """A row left out by load_metadata(skip_bad_rows=True), and why."""

    line: int
    reason: str


def find_metadata(base_path: str | Path) -> Path:
    """The base folder's metadata.csv or metadata.jsonl (exactly one must exist)."""
    base = Path(base_path)
    if not base.is_dir():
        raise DataError(f"data set folder {base} does not exist or is not a folder")
    for name in METADATA_NAMES:
        if (base / name).is_dir():
            raise DataError(f"{base / name} is a folder, not a file; move it away or rename it")
    found = [base / name for name in METADATA_NAMES if (base / name).is_file()]
    if not found:
        raise DataError(
            f"no metadata.csv or metadata.jsonl in {base}; add one with 'image' and 'prompt' "
            "columns or pass metadata_path"
        )
    if len(found) > 1:
        raise DataError(f"both {found[0].name} and {found[1].name} in {base}; pass metadata_path")
    return found[0]


def _read_text(path: Path) -> str:
    """The whole metadata file as text; DataError naming the line of bad bytes (not UTF-8, NUL)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read metadata file {path}: {exc.strerror or exc}") from exc
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DataError(f"{path.name} is UTF-16 text; save it as UTF-8 (e.g. 'CSV UTF-8')")
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise DataError(
            f"{path.name} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
            f"{column}); save the file as UTF-8"
        ) from None
    if (nul := text.find("\0")) >= 0:
        raise DataError(
            f"{path.name} line {text.count(chr(10), 0, nul) + 1}: NUL byte; the file is binary or "
            "UTF-16, save it as UTF-8 text"
        )
    if not text.strip():
        raise DataError(f"metadata file {path} is empty; add an 'image,prompt' header and rows")
    return text


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


def _csv_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) pairs of a CSV file; checks the header has image and prompt.

    Strict quoting: an unclosed quote is an error naming its row, never a caption that silently
    swallows the rest of the file.
    """
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""), restval="", strict=True)
    try:
        columns = reader.fieldnames or []
    except csv.Error as exc:
        raise DataError(f"{path.name} row 1 (header): {_csv_problem(exc)}") from exc
    _check_columns(columns, path, "row 1 (header)")
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise DataError(
            f"{path.name} row 1 (header): column(s) {', '.join(map(repr, repeated))} appear "
            "more than once; rename or remove the copies"
        )
    while True:
        start = reader.line_num + 1
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DataError(f"{path.name} row {start}: {_csv_problem(exc)}") from exc
        yield reader.line_num, record  # the file line a record ends on (blank lines count)


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) != len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise _RepeatedKey(f"key {key!r} appears twice; keep one")
    return record


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """(line number, record or the DataError of a bad line) pairs; blank lines are skipped."""
    lines = io.StringIO(_read_text(path), newline=None)
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path.name} row {line_no}"
        if len(line) > MAX_LINE_CHARS:
            yield (
                line_no,
                DataError(
                    f"{where}: line is {len(line):,} characters, over the limit of "
                    f"{MAX_LINE_CHARS:,}; shorten it (one JSON object a line)"
                ),
            )
            continue
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            yield (
                line_no,
                DataError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must "
                    "be one JSON object"
                ),
            )
            continue
        except RecursionError:
            yield line_no, DataError(f"{where}: JSON nested too deeply; one flat object a line")
            continue
        except ValueError as exc:  # a repeated key, an integer too long to convert
            yield line_no, DataError(f"{where}: not usable JSON ({exc})")
            continue
        if not isinstance(record, dict):
            record = DataError(
                f"{where}: expected a JSON object with 'image' and 'prompt', got "
                f"{_json_kind(record)}"
            )
        yield line_no, record


def _json_kind(value: Any) -> str:
    """'a number (3)', 'a list', 'null': a JSON value's type, for messages."""
    if value is None:
        return "null"
    kind = {bool: "true/false", str: "text", list: "a list", dict: "an object"}.get(type(value))
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{kind or 'a number'} ({shown})"


def _check_columns(columns: Sequence[str], path: Path, where: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        found = ", ".join(repr(c) for c in columns) or "none"
        raise DataError(
            f"{path.name} {where}: missing column(s) {', '.join(repr(c) for c in missing)}; "
            f"columns found: {found}. Rename them to 'image' and 'prompt'."
        )


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _csv_records(path)
    if suffix == ".jsonl":
        return _jsonl_records(path)
    raise DataError(f"metadata file {path} is not .csv or .jsonl; convert it to one of those")


def _check_image_file(where: str, path: Path) -> None:
    try:
        found = path.is_file()
    except (OSError, ValueError) as exc:  # e.g. a name too long for the file system
        reason = getattr(exc, "strerror", None) or exc
        raise DataError(f"{where}: image path {str(path)[:200]!r} is unusable: {reason}") from exc
    if not found:
        raise DataError(f"{where}: image file {path} not found; fix the path or remove row")


def _to_row(line: int, record: Mapping[str, Any] | DataError, base: Path, source: Path) -> Row:
    """Validate one record (columns, text prompt and path, image file present) into a Row."""
    if isinstance(record, DataError):
        raise record
    where = f"{source.name} row {line}"
    if None in record:  # csv.DictReader puts cells beyond the header under None
        raise DataError(f"{where}: more cells than header columns; quote cells that hold commas")
    if source.suffix.lower() == ".jsonl":
        _check_columns(list(record), source, f"row {line}")
    image, prompt = record.get("image"), record.get("prompt")
    if image is not None and not isinstance(image, str):
        raise DataError(f"{where}: 'image' must be a path string, got {_json_kind(image)}")
    if not image or not image.strip():
        raise DataError(f"{where}: empty 'image' field; give the image path relative to {base}")
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(
            f"{where}: 'prompt' must be text, got {_json_kind(prompt)}; put the caption in quotes"
        )
    if not prompt or not prompt.strip():
        raise DataError(f"{where}: empty 'prompt' for image {image!r}; write a caption")
    try:
        json.dumps(dict(record), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON escapes such as "\ud800" decode to no character
        raise DataError(
            f"{where}: text holds an unpaired surrogate escape ({exc.object[exc.start]!r}); "
            "fix the \\u escape"
        ) from exc
    _check_image_file(where, base / image)
    extras = {k: v for k, v in record.items() if k not in REQUIRED_COLUMNS}
    return Row(line=line, image=image, prompt=prompt, extras=extras, source=source.name)


def load_metadata(
    base_path: str | Path,
    metadata_path: str | Path | None = None,
    *,
    skip_bad_rows: bool = False,
    check_images: bool = False,
) -> list[Row] | tuple[list[Row], list[Skipped]]:
    """Read and validate the metadata rows of a data set.

    Raises DataError at the first bad row; with skip_bad_rows=True returns (good rows, skipped).
    check_images=True also decodes every image (slower) so corrupt files are found here rather
    than in load_sample. File-level problems always raise: missing or repeated columns, bad
    format, bytes that are not UTF-8 or hold NUL, an empty file, broken CSV quoting.
    """
    base = Path(base_path)
    path = Path(metadata_path) if metadata_path is not None else find_metadata(base)
    if path.is_dir():
        raise DataError(f"metadata file {path} is a folder; give the .csv or .jsonl file in it")
    if not path.is_file():
        raise DataError(f"metadata file {path} does not exist")
    rows: list[Row] = []
    skipped: list[Skipped] = []
    for line, record in _records(path):
        try:
            row = _to_row(line, record, base, path)
            if check_images:
                decode_image(read_image_bytes(row, base), row, base)
        except DataError as exc:
            if not skip_bad_rows:
                raise
            skipped.append(Skipped(line, str(exc)))
            continue
        rows.append(row)
    if not rows and not skipped:
        raise DataError(f"metadata file {path} has no rows; add one row per image")
    return (rows, skipped) if skip_bad_rows else rows


def read_image_bytes(row: Row, base_path: str | Path) -> bytes:
    """The image file's bytes; DataError naming the row if it cannot be read or is too big."""
    path = Path(base_path) / row.image
    try:
        check_file_size(row.where, path, path.stat().st_size)
        return path.read_bytes()
    except (OSError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        reason = getattr(exc, "strerror", None) or exc
        raise DataError(f"{row.where}: cannot read image file {path}: {reason}") from exc


def decode_image(data: bytes, row: Row, base_path: str | Path) -> Image.Image:
    """Decode image bytes to an 8-bit RGB PIL image; DataError naming the row and file if bad.

    The choices of `splitstage.pipelines.images` apply (EXIF orientation, first frame, alpha onto
    white, 16-bit and float range checks, bomb guard). 16-bit and float images are rounded to 8
    bits here; load_sample keeps their full precision.
    """
    return to_rgb8(open_image(data, row.where, Path(base_path) / row.image))


def load_sample(
    row: Row,
    base_path: str | Path,
    size: int | tuple[int, int] = 64,
    image_bytes: bytes | None = None,
    *,
    source_size: bool = False,
) -> dict[str, Any]:
    """One sample: image [3,H,W] in [-1,1], prompt, height, width, then the row's extra fields
    (and `source_size` = [h, w] of the decoded file, for families conditioned on it).

    Pass image_bytes if already read (e.g. for the sample key) to avoid reading the file twice.
    Extra fields never override image/prompt/height/width. 16-bit and float images are resized
    and converted in float, never through 8 bits (see `splitstage.pipelines.images`).
    """
    height, width = (size, size) if isinstance(size, int) else size
    data = read_image_bytes(row, base_path) if image_bytes is None else image_bytes
    img = open_image(data, row.where, Path(base_path) / row.image)
    sample = {
        **row.extras,
        "image": image_to_tensor(center_crop_resize(img, height, width)),
        "prompt": row.prompt,
        "height": height,
        "width": width,
    }
    if source_size:
        sample["source_size"] = [img.height, img.width]
    return sample


def sample_key(image_bytes: bytes, prompt: str, extras: Mapping[str, Any] | None = None) -> str:
    """Content hash (sha256 hex) of image bytes, prompt and sorted extra fields; not of paths."""
    fields = json.dumps(
        {"prompt": prompt, "extras": dict(extras or {})},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
        default=str,
    )
    h = hashlib.sha256(SAMPLE_KEY_VERSION.encode() + b"\0")
    h.update(hashlib.sha256(image_bytes).digest())
    h.update(fields.encode("utf-8"))
    return h.hexdigest()


def row_key(row: Row, base_path: str | Path) -> str:
    """Sample key of one row (reads its image file)."""
    return sample_key(read_image_bytes(row, base_path), row.prompt, row.extras)


def sample_keys(rows: Iterable[Row], base_path: str | Path) -> list[str]:
    """Sample keys of all rows, in order, reading each image file once."""
    return [row_key(row, base_path) for row in rows]
