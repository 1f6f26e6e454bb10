"""Video rows against the job's family, before stage 1 loads a model: a family that trains on
images refuses rows whose file is a video (by its suffix) in one line naming those rows and the
families that take video, instead of calling each clip a corrupt image in stage 1."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from splitstage.config.families import config_class, family_names
from splitstage.data.dataset import Row
from splitstage.data.images import DataError
from splitstage.data.videos import is_video

if TYPE_CHECKING:
    from splitstage.config.job import SplitstageConfig

SHOWN = 3  # rows named in one refusal


def video_takers() -> list[str]:
    """How each registered family takes video rows (its config group's `video_rows`)."""
    takers = []
    for name in family_names():
        try:
            note = getattr(config_class(name), "video_rows", "")
        except Exception:  # noqa: BLE001 - a plugin that does not import takes none here
            continue
        if note:
            takers.append(note)
    return takers


def check_video_rows(config: SplitstageConfig, rows: Iterable[Row]) -> None:
    """DataError naming the first video rows (and how many in all) when the job's family
    trains on images; nothing for a family that takes video."""
    group = config.pipeline
    if group.takes_video():
        return
    named: list[str] = []
    count = 0
    for row in rows:
        if is_video(row.image):
            count += 1
            if len(named) < SHOWN:
                named.append(f"{row.where} ({row.image[:200]})")
    if not count:
        return
    more = f" and {count - len(named)} more rows" if count > len(named) else ""
    takers = " or ".join(video_takers()) or "none is registered"
    raise DataError(
        f"{', '.join(named)}{more}: video files, but the {group.name!r} family trains on "
        f"images; video rows train with {takers}: set pipeline.name to one of them, or give "
        "image files in those rows"
    )
