"""Image-caption data sets in DiffSynth-Studio's format: a base folder plus a metadata file.

The metadata file is `metadata.csv` (header row) or `metadata.jsonl` (one JSON object a line) with
an `image` column (path relative to the base folder) and a `prompt` column; any other column is
kept as a per-sample field. Bad data raises `DataError` naming the file, the row as numbered in the
file (CSV rows count the header as row 1) and how to fix it.

A sample key is a content hash of the image file bytes, the prompt and the extra fields: renaming,
moving or reordering files keeps keys (so the stage-1 cache stays valid); editing an image or a
caption changes them. Processing choices such as the image size belong to the cache key instead.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from splitstage.splitter import UserError

REQUIRED_COLUMNS = ("image", "prompt")
METADATA_NAMES = ("metadata.csv", "metadata.jsonl")
SAMPLE_KEY_VERSION = "splitstage-sample-v1"


class DataError(UserError, ValueError):
    """Bad data set content; the message names the file, the row and the fix."""


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
    found = [base / name for name in METADATA_NAMES if (base / name).is_file()]
    if not found:
        raise DataError(
            f"no metadata.csv or metadata.jsonl in {base}; add one with 'image' and 'prompt' "
            "columns or pass metadata_path"
        )
    if len(found) > 1:
        raise DataError(f"both {found[0].name} and {found[1].name} in {base}; pass metadata_path")
    return found[0]


def _csv_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) pairs of a CSV file; checks the header has image and prompt."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, restval="")
        try:
            columns = reader.fieldnames or []
        except (csv.Error, UnicodeDecodeError) as exc:
            raise DataError(f"{path} is not a readable CSV file: {exc}") from exc
        _check_columns(columns, path, "row 1 (header)")
        while True:
            try:
                record = next(reader)
            except StopIteration:
                return
            except (csv.Error, UnicodeDecodeError) as exc:
                raise DataError(f"{path.name} row {reader.line_num}: bad CSV: {exc}") from exc
            yield reader.line_num, record  # the file line a record ends on (blank lines count)


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """(line number, record or the DataError of a bad line) pairs; blank lines are skipped."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield (
                    line_no,
                    DataError(
                        f"{path.name} row {line_no}: not valid JSON ({exc.msg} at column "
                        f"{exc.colno}); each line must be one JSON object"
                    ),
                )
                continue
            if not isinstance(record, dict):
                record = DataError(
                    f"{path.name} row {line_no}: expected a JSON object with 'image' and 'prompt', "
                    f"got {type(record).__name__}"
                )
            yield line_no, record


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


def _to_row(line: int, record: Mapping[str, Any] | DataError, base: Path, source: Path) -> Row:
    """Validate one record (columns, non-empty prompt, image file present) into a Row."""
    if isinstance(record, DataError):
        raise record
    where = f"{source.name} row {line}"
    if None in record:  # csv.DictReader puts cells beyond the header under None
        raise DataError(f"{where}: more cells than header columns; quote cells that hold commas")
    if source.suffix.lower() == ".jsonl":
        _check_columns(list(record), source, f"row {line}")
    image, prompt = record.get("image"), record.get("prompt")
    if not isinstance(image, str) or not image.strip():
        raise DataError(f"{where}: empty 'image' field; give the image path relative to {base}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: empty 'prompt' for image {image!r}; write a caption")
    if not (base / image).is_file():
        raise DataError(f"{where}: image file {base / image} not found; fix the path or remove row")
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
    than in load_sample. File-level problems (missing columns, bad format) always raise.
    """
    base = Path(base_path)
    path = Path(metadata_path) if metadata_path is not None else find_metadata(base)
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
    return (rows, skipped) if skip_bad_rows else rows


def read_image_bytes(row: Row, base_path: str | Path) -> bytes:
    """The image file's bytes; DataError naming the row if it cannot be read."""
    path = Path(base_path) / row.image
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"{row.where}: cannot read image file {path}: {exc.strerror}") from exc


def decode_image(data: bytes, row: Row, base_path: str | Path) -> Image.Image:
    """Decode image bytes to an RGB PIL image; DataError naming the row and file if corrupt."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        reason = "unknown image format" if isinstance(exc, UnidentifiedImageError) else str(exc)
        raise DataError(
            f"{row.where}: image file {Path(base_path) / row.image} is corrupt or not an image "
            f"({reason}); re-export it or remove the row"
        ) from exc


def _center_crop_resize(img: Image.Image, height: int, width: int) -> Image.Image:
    """Scale to cover height x width, then crop the center (DiffSynth's ImageCropAndResize)."""
    if img.size == (width, height):
        return img
    scale = max(height / img.height, width / img.width)
    new_w, new_h = max(width, round(img.width * scale)), max(height, round(img.height * scale))
    img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = (new_w - width) // 2, (new_h - height) // 2
    return img.crop((left, top, left + width, top + height))


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float tensor [3,H,W] in [-1,1]."""
    array = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 127.5 - 1.0


def load_sample(
    row: Row,
    base_path: str | Path,
    size: int | tuple[int, int] = 64,
    image_bytes: bytes | None = None,
) -> dict[str, Any]:
    """One sample: image [3,H,W] in [-1,1], prompt, height, width, then the row's extra fields.

    Pass image_bytes if already read (e.g. for the sample key) to avoid reading the file twice.
    Extra fields never override image/prompt/height/width.
    """
    height, width = (size, size) if isinstance(size, int) else size
    data = read_image_bytes(row, base_path) if image_bytes is None else image_bytes
    img = _center_crop_resize(decode_image(data, row, base_path), height, width)
    return {
        **row.extras,
        "image": image_to_tensor(img),
        "prompt": row.prompt,
        "height": height,
        "width": width,
    }


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
