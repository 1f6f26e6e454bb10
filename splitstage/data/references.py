"""Reference images beside a row's target (edit and kontext inputs): the rule a family states for
them, loading them at the size it says, and refusing rows the family cannot train.

A row names them in 'edit_image' (DiffSynth's name; 'control_image' is an alias): one path or a
list, relative to the data set's base like its image. They are part of the sample key by content
(`dataset.sample_key_of_digest`), are listed, hashed and found missing with the row's image, and
load through the same decode path (`data.images`), so a bad one is a bad row like a bad image.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitstage.data.dataset import (
    REFERENCE_COLUMNS,
    DataError,
    Row,
    read_image_bytes,
    reference_row,
)
from splitstage.data.images import center_crop_resize, image_to_tensor, open_image
from splitstage.data.row_table import RowTable
from splitstage.data.source import DataSource, source_for

SHOWN = 3  # rows named in a refusal (then a count of the rest)


@dataclass(frozen=True)
class ReferenceImages:
    """What a family takes as reference images: whether each row needs them, how many at most,
    and their size (the target's, or their own aspect ratio at about `max_pixels`)."""

    required: bool = True
    most: int = 1
    max_pixels: int | None = None  # None: cropped to the target's size (its bucket)
    multiple: int = 16  # each side of a max_pixels-sized reference is a multiple of this

    def size(self, source: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
        """(height, width) a reference of `source` size loads at, beside a `target`-sized image."""
        if self.max_pixels is None:
            return target
        height, width = source
        scale = math.sqrt(self.max_pixels / (height * width))
        step = self.multiple
        return (
            max(step, int(height * scale) // step * step),
            max(step, int(width * scale) // step * step),
        )


def load_references(
    row: Row,
    base_path: str | Path | DataSource,
    rule: ReferenceImages,
    target: tuple[int, int],
) -> list[Any]:
    """The row's reference images as [3, H, W] tensors in [-1, 1], each at `rule.size`; a bad
    or missing file is a DataError naming the row and the file."""
    source = source_for(base_path)
    images = []
    for ref in row.references:
        ref_row = reference_row(row, ref)
        data = read_image_bytes(ref_row, source)
        img = open_image(data, row.where, source.display(ref))
        height, width = rule.size((img.height, img.width), target)
        images.append(image_to_tensor(center_crop_resize(img, height, width)))
    return images


def check_reference_rows(
    rows: Iterable[Row],
    rule: ReferenceImages | None,
    family: str,
    takers: Callable[[], Sequence[str]],
) -> None:
    """One DataError line (its first rows, then a count) when rows do not fit the family: rows
    with reference images for a family without a rule (`takers()` names the families that take
    them), rows without them for a family that needs them, rows with more than it takes."""
    if isinstance(rows, RowTable) and not rows.has_references() and not (rule and rule.required):
        return  # a restored table without the column: no row to build
    column = REFERENCE_COLUMNS[0]
    problems: list[str] = []
    count = 0
    fix = ""
    for row in rows:
        found = len(row.references)
        if rule is None and found:
            problem = f"{row.where} has {column!r}"
            if not fix:
                names = ", ".join(repr(name) for name in takers()) or "none is registered"
                fix = (
                    f"the {family} family takes no reference images; set pipeline.name to "
                    f"a family that does ({names}) or remove the {column!r} column"
                )
        elif rule is not None and rule.required and not found:
            problem = f"{row.where} has no {column!r}"
            fix = (
                fix
                or f"the {family} family trains on a reference image beside each target; add one"
            )
        elif rule is not None and found > rule.most:
            problem = f"{row.where} has {found} reference images"
            fix = fix or f"the {family} family takes at most {rule.most}; keep {rule.most}"
        else:
            continue
        count += 1
        if len(problems) < SHOWN:
            problems.append(problem)
    if count:
        more = f" (and {count - len(problems)} more rows)" if count > len(problems) else ""
        raise DataError(f"{', '.join(problems)}{more}: {fix}")
