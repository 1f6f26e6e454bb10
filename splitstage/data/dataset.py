"""Image-caption data sets in DiffSynth-Studio's format: a base folder (or any fsspec URL) plus a
metadata file.

The metadata file is `metadata.csv` (header row), `metadata.jsonl` (one JSON object a line) or
`metadata.parquet`, with an `image` or `video` column (path relative to the base; a header may
have both, each row filling one) and a `prompt` column; an `edit_image` column (alias
`control_image`: one path or a list) names the row's reference images (`data.references`); any
other column is kept as a per-sample field. Bad data raises `DataError` naming the file, the
row as numbered in the file (CSV rows count the header as row 1) and how to fix it. Metadata must
be UTF-8 (a UTF-8 BOM is fine); bytes that are not, NUL bytes, an empty file, broken CSV quoting
and repeated columns are file-level errors naming the line; a bad JSONL line (invalid or too
deeply nested JSON, a repeated key, a line over MAX_LINE_CHARS, 'image'/'prompt' of the wrong
JSON type) is a row error, so `skip_bad_rows` can skip it (parsers: `data.metadata_files`).
Images are found present by ONE listing of the data set (`data.source`), not one stat
per row, and decode as `splitstage.data.images` documents.

A sample key is a content hash of the file's bytes (and its reference images'), the prompt and
the extra fields: renaming, moving or reordering files keeps keys (so the stage-1 cache stays
valid); editing an image, a reference or a caption changes them. Processing choices such as
the image size belong to the cache key instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from splitstage.data import metadata_files
from splitstage.data.image_paths import check_image_path, missing_image, noun
from splitstage.data.images import (
    DataError,
    center_crop_resize,
    check_file_size,
    image_to_tensor,
    open_image,
    to_rgb8,
)
from splitstage.data.metadata_files import (  # noqa: F401
    REFERENCE_COLUMNS,
    REQUIRED_COLUMNS,
    json_kind,
)
from splitstage.data.source import DataSource, Listing, relative_key, source_for
from splitstage.data.videos import FIRST_FRAME, is_video, read_clip

METADATA_NAMES = ("metadata.csv", "metadata.jsonl", "metadata.parquet")
SAMPLE_KEY_VERSION = "splitstage-sample-v1"
MAX_LINE_CHARS = 1 << 20  # a JSONL line longer than this is refused, not parsed
HASH_BLOCK = 8 << 20  # bytes `file_digest` reads at a time (a long video is hashed in pieces)
SizeRule = Callable[[int, int], tuple[int, int]]  # source (height, width) -> target (h, w)
_KEY_PREFIX = SAMPLE_KEY_VERSION.encode() + b"\0"
_NOT_EXTRAS = frozenset(("image", "video", "prompt", *REFERENCE_COLUMNS))  # files and caption
_json_text = json.encoder.encode_basestring  # what json.dumps(str, ensure_ascii=False) gives


@dataclass(frozen=True, slots=True)
class Row:
    """One metadata row: image path (relative to the base folder), prompt and extra fields."""

    line: int  # line number in the file, 1-based (a CSV header is row 1)
    image: str
    prompt: str
    extras: dict[str, Any] = field(default_factory=dict)
    source: str = "metadata"  # metadata file name, for messages
    references: tuple[str, ...] = ()  # reference image paths ('edit_image'), relative to the base

    @property
    def where(self) -> str:
        """'metadata.csv row 3', for error messages."""
        return f"{self.source} row {self.line}"


def reference_row(row: Row, path: str) -> Row:
    """The row with reference image `path` as its file: what the readers and hashers take."""
    return replace(row, image=path, references=())


def reference_where(row: Row) -> str:
    """'metadata.csv row 3 (edit_image)': a row's reference images, for error messages."""
    return f"{row.where} ({REFERENCE_COLUMNS[0]})"


class Skipped(NamedTuple):
    """A row left out by load_metadata(skip_bad_rows=True), and why."""

    line: int
    reason: str


@dataclass
class Scan:
    """What reading a data set found: its rows, the rows skipped, and the one listing."""

    rows: list[Row]
    skipped: list[Skipped]
    listing: Listing
    source: DataSource
    rels: list[str] = field(default_factory=list)  # each row's listing key (relative_key)
    absent: list[str] = field(default_factory=list)  # listing keys of rows skipped as not found
    metadata: tuple[DataSource, str, Any] | None = None  # (source, name, stat) of the metadata
    metadata_bytes: bytes = b""  # the metadata file as read


def find_metadata(base_path: str | Path | DataSource) -> str:
    """The base's metadata.csv, metadata.jsonl or metadata.parquet (exactly one must exist)."""
    source = source_for(base_path)
    base = source.display("").rstrip("/") if not source.local else source.local_root
    if source.local and not os.path.isdir(base):
        raise DataError(f"data set folder {base} does not exist or is not a folder")
    kinds = {name: source.kind(name) for name in METADATA_NAMES}
    for name, kind in kinds.items():
        if kind == "folder":
            raise DataError(
                f"{source.display(name)} is a folder, not a file; move it away or rename it"
            )
    found = [name for name, kind in kinds.items() if kind == "file"]
    if not found and (bucket := source.missing_bucket()):
        raise DataError(
            f"data.base_path {source.url}: bucket '{bucket}' does not exist; create it or fix "
            "the bucket name"
        )
    if not found:
        raise DataError(
            f"no metadata.csv or metadata.jsonl (or metadata.parquet) in {base}; add one with "
            "'image' and 'prompt' columns or pass metadata_path"
        )
    if len(found) > 1:
        raise DataError(f"both {found[0]} and {found[1]} in {base}; pass metadata_path")
    return source.display(found[0])


def locate_metadata(
    source: DataSource, metadata_path: str | Path | None = None
) -> tuple[DataSource, str]:
    """(source, relative name) of the data set's metadata file, which must be a file."""
    where = metadata_path if metadata_path is not None else find_metadata(source)
    meta, rel = source.locate(str(where))
    kind = meta.kind(rel)
    if kind == "folder":
        shown = meta.display(rel)
        raise DataError(f"metadata file {shown} is a folder; give the .csv or .jsonl file in it")
    if kind == "missing":
        bucket = meta.missing_bucket()
        why = f"its bucket '{bucket}' does not exist" if bucket else "it does not exist"
        raise DataError(f"metadata file {meta.display(rel)}: {why}; fix data.metadata_path")
    return meta, rel


def _to_row(line: int, record: Mapping[str, Any] | DataError, base: str, name: str) -> Row:
    """Validate one record (columns, text prompt and path) into a Row; images are checked later."""
    if isinstance(record, DataError):
        raise record
    if None in record:  # csv puts cells beyond the header under None
        raise DataError(
            f"{name} row {line}: more cells than header columns; quote cells that hold commas"
        )
    jsonl = name.lower().endswith(".jsonl")
    if jsonl:
        metadata_files.check_columns(list(record), name, f"row {line}")
    column = _file_column(record, f"{name} row {line}", base)
    image, prompt = record.get(column), record.get("prompt")
    if image is not None and not isinstance(image, str):
        raise DataError(
            f"{name} row {line}: {column!r} must be a path string, got {json_kind(image)}"
        )
    if not image or not image.strip():
        raise DataError(
            f"{name} row {line}: empty {column!r} field; give the {column} path relative to {base}"
        )
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(
            f"{name} row {line}: 'prompt' must be text, got {json_kind(prompt)}; put the caption "
            "in quotes"
        )
    if not prompt or not prompt.strip():
        raise DataError(
            f"{name} row {line}: empty 'prompt' for {noun(image)} {image!r}; write a caption"
        )
    if jsonl:  # JSON escapes such as "\ud800" decode to no character (UTF-8 text cannot hold one)
        try:
            json.dumps(dict(record), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DataError(
                f"{name} row {line}: text holds an unpaired surrogate escape "
                f"({exc.object[exc.start]!r}); fix the \\u escape"
            ) from exc
    references = _references(record, f"{name} row {line}", base)
    extras = {k: v for k, v in record.items() if k not in _NOT_EXTRAS} if len(record) > 2 else {}
    return Row(line, image, prompt, extras, name, references)


def _references(record: Mapping[str, Any], where: str, base: str) -> tuple[str, ...]:
    """The row's reference image paths ('edit_image' or its alias 'control_image'): none, one
    path, or a list (in a CSV cell, a JSON list such as ["a.png", "b.png"])."""
    given = [c for c in REFERENCE_COLUMNS if c in record and not _blank(record[c])]
    given = [c for c in given if record[c] != []]
    if not given:
        return ()
    if len(given) > 1:
        raise DataError(
            f"{where}: both {given[0]!r} and {given[1]!r} are set; both name the reference "
            "images: keep one"
        )
    column, value = given[0], record[given[0]]
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where}: {column!r} {value[:80]!r} is not a JSON list of paths ({exc.msg}); "
                'write one path, or a list such as ["a.png", "b.png"]'
            ) from None
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise DataError(
            f"{where}: {column!r} must be a path or a list of paths, got {json_kind(value)}"
        )
    if any(not p.strip() for p in paths):
        raise DataError(
            f"{where}: {column!r} holds an empty path; give each reference image's path "
            f"relative to {base}"
        )
    return tuple(paths)


def _file_column(record: Mapping[str, Any], where: str, base: str) -> str:
    """The column naming the row's file: 'image' or 'video' (a file whose suffix is a video's
    is a clip either way); a row filling both, or a header with both and a row filling
    neither, is refused."""
    given = [c for c in metadata_files.FILE_COLUMNS if c in record]
    if len(given) < 2:
        return given[0] if given else "image"
    filled = [c for c in given if not _blank(record[c])]
    if len(filled) == 2:
        raise DataError(
            f"{where}: both 'image' ({record['image']!r}) and 'video' ({record['video']!r}) "
            "are set; a row names one file: keep one, or split it into two rows"
        )
    if not filled:
        raise DataError(
            f"{where}: neither 'image' nor 'video' is set; give one file path relative to {base}"
        )
    return filled[0]


def _blank(value: Any) -> bool:
    """An unset cell: null, or text of only whitespace."""
    return value is None or (isinstance(value, str) and not value.strip())


def scan_data_set(
    base_path: str | Path | DataSource,
    metadata_path: str | Path | None = None,
    *,
    skip_bad_rows: bool = False,
    check_images: bool = False,
) -> Scan:
    """Read and validate the metadata rows and list the data set's files once (load_metadata)."""
    source = source_for(base_path)
    meta, meta_rel = locate_metadata(source, metadata_path)
    shown = meta.display(meta_rel)
    name = meta_rel.rsplit("/", 1)[-1]
    identity = meta.stat(meta_rel)  # before reading: a later edit can only make it look changed
    data = meta.read_metadata(meta_rel)
    records = metadata_files.records(data, name, shown, MAX_LINE_CHARS)
    scan = scan_records(source, records, name, skip_bad_rows, check_images)
    if not scan.rows and not scan.skipped:
        raise DataError(f"metadata file {shown} has no rows; add one row per image")
    scan.metadata = (meta, meta_rel, identity)
    scan.metadata_bytes = data
    return scan


def scan_records(
    source: DataSource,
    records: metadata_files.Records,
    name: str,
    skip_bad_rows: bool,
    check_images: bool = False,
) -> Scan:
    """Check `records` of metadata file `name` into rows and list the folders their images are
    in (once); bad rows raise or, with `skip_bad_rows`, are skipped with their reason."""
    base = source.display("").rstrip("/") if not source.local else source.local_root
    rows: list[Row] = []
    rels: list[str] = []
    skipped: list[Skipped] = []
    first_error: DataError | None = None
    for line, record in records:
        try:
            row = _to_row(line, record, base, name)
            rel = relative_key(row.image)
            check_image_path(row.where, row.image, rel, source.local, base)
            _check_reference_paths(row, source.local, base)
        except DataError as exc:
            if not skip_bad_rows:
                first_error = exc
                break
            skipped.append(Skipped(line, str(exc)))
            continue
        rows.append(row)
        rels.append(rel)
    listing = source.listing(set(rels).union(*(reference_rels(row) for row in rows)))
    good: list[Row] = []
    good_rels: list[str] = []
    absent: list[str] = []
    files = listing.files
    for row, rel in zip(rows, rels, strict=True):
        missing = rel
        try:
            if rel not in files:
                missing_image(row.where, row.image, source, listing)
            for ref, ref_rel in zip(row.references, reference_rels(row), strict=True):
                missing = ref_rel
                if ref_rel not in files:
                    missing_image(reference_where(row), ref, source, listing)
        except DataError as exc:
            if not skip_bad_rows:
                raise
            skipped.append(Skipped(row.line, str(exc)))
            absent.append(missing)
            continue
        try:
            if check_images and is_video(row.image):
                read_clip(row, source, FIRST_FRAME)  # opens, seeks and decodes: a first check
            elif check_images:
                decode_image(read_image_bytes(row, source), row, source)
            for ref in row.references if check_images else ():
                ref_row = reference_row(row, ref)
                decode_image(read_image_bytes(ref_row, source), ref_row, source)
        except DataError as exc:
            if not skip_bad_rows:
                raise
            skipped.append(Skipped(row.line, str(exc)))
            continue
        good.append(row)
        good_rels.append(rel)
    if first_error is not None:
        raise first_error
    skipped.sort(key=lambda s: s.line)
    scan = Scan(rows=good, skipped=skipped, listing=listing, source=source, rels=good_rels)
    scan.absent = absent
    return scan


def reference_rels(row: Row) -> list[str]:
    """The listing keys (`relative_key`) of a row's reference images."""
    return [relative_key(ref) for ref in row.references]


def _check_reference_paths(row: Row, local: bool, base: str) -> None:
    """DataError for a reference path that cannot name an image file of the data set."""
    where = reference_where(row)
    for ref, rel in zip(row.references, reference_rels(row), strict=True):
        if is_video(ref):
            raise DataError(
                f"{where}: {ref[:200]!r} is a video; reference images are images (a still "
                "frame as .png or .jpg)"
            )
        check_image_path(where, ref, rel, local, base)


def load_metadata(
    base_path: str | Path | DataSource,
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
    scan = scan_data_set(
        base_path, metadata_path, skip_bad_rows=skip_bad_rows, check_images=check_images
    )
    return (scan.rows, scan.skipped) if skip_bad_rows else scan.rows


def read_image_bytes(row: Row, base_path: str | Path | DataSource) -> bytes:
    """The image file's bytes; DataError naming the row if it cannot be read or is too big."""
    source = source_for(base_path)
    what = noun(row.image)
    if source.local:
        path = Path(source.local_root) / row.image
        try:
            check_file_size(row.where, path, path.stat().st_size)
            return path.read_bytes()
        except (OSError, ValueError) as exc:
            if isinstance(exc, DataError):
                raise
            reason = getattr(exc, "strerror", None) or exc
            raise DataError(f"{row.where}: cannot read {what} file {path}: {reason}") from exc
    shown = source.display(relative_key(row.image))
    try:
        data = source.read(relative_key(row.image))
    except FileNotFoundError:
        raise DataError(f"{row.where}: cannot read {what} file {shown}: not found") from None
    except Exception as exc:
        raise source.failure(f"read {what} file ({row.where})", shown, exc) from None
    check_file_size(row.where, shown, len(data))
    return data


def file_digest(row: Row, base_path: str | Path | DataSource) -> bytes:
    """sha256 digest of a row's file read in HASH_BLOCK pieces: a long video is never held
    whole (on object stores each piece is one ranged read); DataError naming the row."""
    source = source_for(base_path)
    what = noun(row.image)
    if source.local:
        path = Path(source.local_root) / row.image
        try:
            with open(path, "rb") as handle:
                return _stream_digest(handle)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise DataError(f"{row.where}: cannot read {what} file {path}: {reason}") from exc
    rel = relative_key(row.image)
    shown = source.display(rel)
    try:
        with source.fs.open(
            source.path(rel), "rb", block_size=HASH_BLOCK, cache_type="none"
        ) as handle:
            return _stream_digest(handle)
    except FileNotFoundError:
        raise DataError(f"{row.where}: cannot read {what} file {shown}: not found") from None
    except Exception as exc:
        raise source.failure(f"read {what} file ({row.where})", shown, exc) from None


def _stream_digest(handle: Any) -> bytes:
    """sha256 of a binary file object, read into one reused HASH_BLOCK buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    while count := handle.readinto(buffer):
        digest.update(view[:count])
    return digest.digest()


def decode_image(data: bytes, row: Row, base_path: str | Path | DataSource) -> Image.Image:
    """Decode image bytes to an 8-bit RGB PIL image; DataError naming the row and file if bad.

    The choices of `splitstage.data.images` apply (EXIF orientation, first frame, alpha onto
    white, 16-bit and float range checks, bomb guard). 16-bit and float images are rounded to 8
    bits here; load_sample keeps their full precision.
    """
    return to_rgb8(open_image(data, row.where, source_for(base_path).display(row.image)))


def load_sample(
    row: Row,
    base_path: str | Path | DataSource,
    size: int | tuple[int, int] | SizeRule = 64,
    image_bytes: bytes | None = None,
    *,
    source_size: bool = False,
) -> dict[str, Any]:
    """One sample: image [3,H,W] in [-1,1], prompt, height, width, then the row's extra fields
    (and `source_size` = [h, w] of the decoded file, for families conditioned on it).

    `size` is a square side, (height, width), or a rule (source h, w) -> (h, w) such as an
    aspect-ratio bucket's `Buckets.size_for`; the image is scaled to cover it and center-cropped.
    Pass image_bytes if already read (e.g. for the sample key) to avoid reading the file twice.
    Extra fields never override image/prompt/height/width. 16-bit and float images are resized
    and converted in float, never through 8 bits (see `splitstage.data.images`).
    """
    source = source_for(base_path)  # the one handed down, or the folder / URL opened here
    data = read_image_bytes(row, source) if image_bytes is None else image_bytes
    img = open_image(data, row.where, source.display(row.image))
    if callable(size):
        height, width = size(img.height, img.width)
    else:
        height, width = (size, size) if isinstance(size, int) else size
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


def sample_key_of_digest(
    image_digest: bytes,
    prompt: str,
    extras: Mapping[str, Any] | None = None,
    references: Sequence[bytes] = (),
) -> str:
    """Sample key from the sha256 digest of the image bytes (what the hash memo keeps) and those
    of the row's reference images, in order (a row without any keys as before they existed)."""
    if references:
        fields = json.dumps(
            {
                "prompt": prompt,
                "extras": dict(extras or {}),
                "references": [digest.hex() for digest in references],
            },
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
            default=str,
        )
    elif extras:
        fields = json.dumps(
            {"prompt": prompt, "extras": dict(extras)},
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
            default=str,
        )
    else:  # the same text json.dumps gives for {"extras": {}, "prompt": prompt}, faster
        fields = '{"extras":{},"prompt":' + _json_text(prompt) + "}"
    return hashlib.sha256(_KEY_PREFIX + image_digest + fields.encode("utf-8")).hexdigest()


def sample_key(
    image_bytes: bytes,
    prompt: str,
    extras: Mapping[str, Any] | None = None,
    references: Sequence[bytes] = (),
) -> str:
    """Content hash (sha256 hex) of image bytes, prompt, sorted extra fields and reference image
    bytes; not of paths."""
    digests = [hashlib.sha256(data).digest() for data in references]
    return sample_key_of_digest(hashlib.sha256(image_bytes).digest(), prompt, extras, digests)


def row_key(row: Row, base_path: str | Path | DataSource) -> str:
    """Sample key of one row (hashes its file and its references in pieces: `file_digest`)."""
    refs = [file_digest(reference_row(row, ref), base_path) for ref in row.references]
    return sample_key_of_digest(file_digest(row, base_path), row.prompt, row.extras, refs)


def sample_keys(rows: Iterable[Row], base_path: str | Path | DataSource) -> list[str]:
    """Sample keys of all rows, in order, reading each file once (in pieces)."""
    return [row_key(row, base_path) for row in rows]
