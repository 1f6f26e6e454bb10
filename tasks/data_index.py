"""The data set's usable rows and their sample keys: what both stages agree the data set is."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.data import DataError, Row, load_metadata, read_image_bytes, sample_key


@dataclass
class DataIndex:
    """The data set's usable rows with their sample keys, and what was skipped."""

    rows: list[Row]
    keys: list[str]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    duplicates: int = 0


def index_data_set(config: SplitstageConfig) -> DataIndex:
    """Read the metadata and hash every sample's content; bad rows raise or are counted."""
    data = config.data
    loaded = load_metadata(data.base_path, data.metadata_path, skip_bad_rows=data.skip_bad_rows)
    rows, skipped = loaded if data.skip_bad_rows else (loaded, [])
    skipped = [(s.line, s.reason) for s in skipped]
    if data.limit is not None:
        rows = rows[: data.limit]
    index = DataIndex(rows=[], keys=[], skipped=skipped)
    seen: set[str] = set()
    for row in rows:
        try:
            key = sample_key(read_image_bytes(row, data.base_path), row.prompt, row.extras)
        except DataError as error:
            if not data.skip_bad_rows:
                raise
            index.skipped.append((row.line, str(error)))
            continue
        if key in seen:
            index.duplicates += 1
            continue
        seen.add(key)
        index.rows.append(row)
        index.keys.append(key)
    if not index.rows:
        raise DataError(
            f"data set {data.base_path}: no usable rows ({len(index.skipped)} skipped); "
            "check data.base_path and data.metadata_path"
        )
    return index
