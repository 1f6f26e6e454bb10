"""Any row as a clip sample for video families: video rows decode their `[data.video]` frames,
image rows become one-frame clips (as Wan trains on images), both cropped by the same rule;
or as its uncropped frames (`clip_frames`), for families that crop by their own rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from splitstage.data.dataset import Row, SizeRule, decode_image, load_sample, read_image_bytes
from splitstage.data.source import DataSource
from splitstage.data.videos import FrameSettings, is_video, load_video_sample, read_clip


def load_clip_sample(
    row: Row,
    base_path: str | Path | DataSource,
    settings: FrameSettings | None = None,
    size: int | tuple[int, int] | SizeRule = 64,
) -> dict[str, Any]:
    """A row's sample with `video` [frames, 3, H, W] in [-1, 1] (1 frame for an image row), prompt,
    height, width, num_frames, source_size and the row's extra fields."""
    if is_video(row.image):
        return load_video_sample(row, base_path, settings, size)
    sample = load_sample(row, base_path, size, source_size=True)
    sample["video"] = sample.pop("image").unsqueeze(0)
    sample["num_frames"] = 1
    return sample


def clip_frames(
    row: Row, base_path: str | Path | DataSource, settings: FrameSettings | None = None
) -> list[Image.Image]:
    """A row's frames as upright 8-bit RGB PIL images at the file's size: the `[data.video]`
    frames of a video row, the one image of an image row (what DiffSynth's video loader gives)."""
    if is_video(row.image):
        return read_clip(row, base_path, settings).frames
    return [decode_image(read_image_bytes(row, base_path), row, base_path)]
