"""Tiny real video files written with PyAV, whose frames say their own index (three bands of
moving squares), so a test can read back which source frames a clip holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH, HEIGHT, SLOT = 64, 48, 8  # 8 slots of 8 px per band; 3 bands of 16 rows: indices < 512


def frame_pixels(index: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """An RGB frame [H, W, 3] whose white squares sit at index % 8, index // 8 % 8, index // 64."""
    array = np.zeros((height, width, 3), np.uint8)
    band = height // 3
    for row, slot in enumerate((index % 8, index // 8 % 8, index // 64 % 8)):
        array[row * band : (row + 1) * band, slot * SLOT : (slot + 1) * SLOT] = 255
    array[:4, -4:, 0] = 255  # a red corner: top right, to see rotations
    return array


def frame_index(array: np.ndarray) -> int:
    """The index frame_pixels drew into an upright decoded RGB frame."""
    gray = array.astype(np.float32).mean(axis=2)
    band = gray.shape[0] // 3
    digits = []
    for row in range(3):
        cols = gray[row * band + 5 : (row + 1) * band - 5].mean(axis=0)
        digits.append(int(np.argmax(cols.reshape(-1, SLOT).mean(axis=1))))
    return digits[0] + 8 * digits[1] + 64 * digits[2]


def write_video(
    path: Path,
    frames: int,
    *,
    rate: int = 10,
    gop: int | None = None,
    rotation: int | None = None,
    codec: str = "libx264",
    times: list[float] | None = None,
) -> Path:
    """Write `frames` index frames at `rate` fps (keyframe every `gop`; display rotation), or
    at the given `times` in seconds (a variable frame rate)."""
    from fractions import Fraction

    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "12", "preset": "ultrafast"}
        if gop:
            stream.codec_context.gop_size = gop
        if rotation is not None:
            stream.set_display_rotation(rotation)
        if times is not None:
            stream.codec_context.time_base = stream.time_base = Fraction(1, 1000)
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(index), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(times[index] * 1000), Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
