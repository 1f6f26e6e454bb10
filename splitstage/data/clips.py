"""Any row as a clip sample for video families: video rows decode their `[data.video]` frames,
animated images (GIF, APNG, WebP) their frames by duration, still image rows become one-frame
clips (as Wan trains on images), all cropped by the same rule; or as its uncropped frames
(`clip_frames`), for families that crop by their own rule. A file is a video by its suffix or,
whatever its name, when Pillow does not open it and PyAV finds a video stream in it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

from splitstage.data.dataset import Row, SizeRule, decode_image, load_sample, read_image_bytes
from splitstage.data.media_kind import animated_frames, video_container
from splitstage.data.source import DataSource, source_for
from splitstage.data.videos import (
    Clip,
    FrameSettings,
    clip_sample,
    decode_animation,
    decode_clip,
    is_video,
    read_clip,
    shown_path,
)


def load_clip_sample(
    row: Row,
    base_path: str | Path | DataSource,
    settings: FrameSettings | None = None,
    size: int | tuple[int, int] | SizeRule = 64,
) -> dict[str, Any]:
    """A row's sample with `video` [frames, 3, H, W] in [-1, 1] (1 frame for a still image row),
    prompt, height, width, num_frames, source_size and the row's extra fields."""
    clip, data = _row_clip(row, base_path, settings)
    if clip is not None:
        return clip_sample(row, clip, size)
    sample = load_sample(row, base_path, size, data, source_size=True)
    sample["video"] = sample.pop("image").unsqueeze(0)
    sample["num_frames"] = 1
    return sample


def clip_frames(
    row: Row, base_path: str | Path | DataSource, settings: FrameSettings | None = None
) -> list[Image.Image]:
    """A row's frames as upright 8-bit RGB PIL images at the file's size: the `[data.video]`
    frames of a video or animated image row, the one image of a still image row (what
    DiffSynth's video loader gives)."""
    clip, data = _row_clip(row, base_path, settings)
    if clip is not None:
        return clip.frames
    return [decode_image(data, row, base_path)]


def _row_clip(
    row: Row, base_path: str | Path | DataSource, settings: FrameSettings | None
) -> tuple[Clip | None, bytes]:
    """(the row's clip, b'') for a video or an animated image; (None, its bytes) for a still
    image (or a file that is neither, which the image decoder then names)."""
    if is_video(row.image):
        return read_clip(row, base_path, settings), b""
    data = read_image_bytes(row, base_path)
    frames = animated_frames(data)
    if frames == 1 or (frames == 0 and video_container(data) is None):
        return None, data
    if settings is None:
        from splitstage.config.job import VideoConfig

        settings = VideoConfig()
    shown = shown_path(row.image, source_for(base_path))
    if frames > 1:
        return decode_animation(data, row.where, shown, settings), b""
    return decode_clip(io.BytesIO(data), row.where, shown, settings), b""
