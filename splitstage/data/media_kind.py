"""What a row's file is by its content, as PyAV and Pillow report it (not by its name): a video
container, a still picture that FFmpeg reads through an image demuxer, or an animated image."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

ANIMATED_FORMATS = ("GIF", "PNG", "WEBP")  # Pillow formats whose frames are a clip (APNG is PNG)


def still_image_format(container: Any) -> str | None:
    """The picture format ('PNG', 'JPEG') when PyAV opened a file through one of FFmpeg's
    single-picture demuxers ('image2', 'png_pipe', 'jpeg_pipe', ...), else None."""
    name = container.format.name
    if name.endswith("_pipe"):
        return name.removesuffix("_pipe").upper()
    if name == "image2":
        streams = container.streams.video
        return streams[0].codec_context.name.upper() if streams else "IMAGE"
    return None


def describe_container(container: Any) -> str:
    """A container's name for messages: FFmpeg's long name and its short one."""
    long_name = getattr(container.format, "long_name", "") or container.format.name
    return f"{long_name}, '{container.format.name}'"


def video_container(data: bytes) -> str | None:
    """The container (`describe_container`) when PyAV finds a video stream in `data` outside a
    still-picture demuxer; None when it is no video, or PyAV is not installed."""
    try:
        import av
    except ImportError:
        return None
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video or still_image_format(container):
                return None
            return describe_container(container)
    except Exception:  # noqa: BLE001 - whatever FFmpeg's probe raises: not a video it reads
        return None


def animated_frames(data: bytes) -> int:
    """Frames in an animated image (GIF, APNG, WebP) that Pillow opens; 1 for a still image
    (a multi-page TIFF too: pages are no clip) and 0 for bytes Pillow does not open."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            animated = getattr(img, "is_animated", False) and img.format in ANIMATED_FORMATS
            return int(img.n_frames) if animated else 1
    except Exception:  # noqa: BLE001 - Pillow's plugins raise many types; the decoder says why
        return 0
