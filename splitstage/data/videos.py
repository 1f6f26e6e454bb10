"""Video files -> clips: the frames `[data.video]` selects, decoded with PyAV by seeking (never a
whole video into memory), upright, as PIL images or a [frames, 3, H, W] tensor in [-1, 1]; a bad
file raises one DataError line naming the row, the file and the fix.

Choices (the same for every file, so a clip depends only on the file's bytes and the settings):

- frames are chosen by timestamp: target times are start + i * stride / fps of the stream
  ('first' with frame_stride), start + i / fps ('first' with fps) or num_frames spread evenly over
  the stream's duration ('uniform'); each target takes the frame shown at that time (the last
  frame whose timestamp is not after it). Variable-frame-rate files are therefore sampled by time.
- targets further apart than SEEK_GAP_SECONDS are reached by a new seek to the keyframe before
  them; between targets frames are decoded and dropped, never kept. A file whose keyframes are
  so sparse that a clip needs more than MAX_EXTRA_DECODED extra decoded frames is refused.
- the stream's display rotation (phone videos) is applied: frames come out as viewers show them.
  Rotations that are not a multiple of 90 degrees, and display matrices that mirror, are refused.
- a video with fewer frames than a clip needs is refused by name (`short_clips = "refuse"`),
  padded with its last frame (`"repeat_last"`) or cut to the largest 4k+1 frames it has
  (`"shorten"`, as DiffSynth's video loader does: clips then fall into frame-count buckets); a
  file with no decodable frame is always refused.
- the first video stream is used; audio and other streams are ignored.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from splitstage.data.images import DataError, center_crop_resize, image_to_tensor
from splitstage.data.source import DataSource, relative_key, source_for

if TYPE_CHECKING:
    import torch

VIDEO_DECODE_VERSION = "splitstage-video-v1"  # bump when the frames a file decodes to change
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts")
READ_BLOCK = 1 << 20  # object stores: bytes a block fetches (an LRU of blocks: none read twice)
SEEK_GAP_SECONDS = 2.0  # targets further apart are reached by seeking, not by decoding through
MAX_EXTRA_DECODED = 10_000  # decoded-and-dropped frames one clip may cost (sparse keyframes)
REENCODE = (
    "re-encode it (e.g. ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT.mp4) or remove the row"
)
NO_FRAMES = f"has no decodable frames (empty or truncated); {REENCODE}"
SizeRule = Callable[[int, int], tuple[int, int]]


class FrameSettings(Protocol):
    """What frame sampling reads: `[data.video]` (splitstage.config.job.VideoConfig) or alike."""

    num_frames: int
    frame_stride: int | None
    fps: float | None
    start: str
    short_clips: str


@dataclass(frozen=True)
class FrameChoice:
    """Frame settings without a config (tests, checks): the fields of `[data.video]`."""

    num_frames: int = 1
    frame_stride: int | None = None
    fps: float | None = None
    start: str = "first"
    short_clips: str = "refuse"


FIRST_FRAME = FrameChoice()  # what `load_metadata(check_images=True)` decodes of a video row


@dataclass(frozen=True)
class Clip:
    """A decoded clip: upright RGB frames and what decoding them cost."""

    frames: list[Image.Image]
    decoded: int  # frames the decoder produced (seeking keeps this near len(frames))
    fps: float  # the stream's average frame rate
    rotation: int  # display rotation applied, degrees counterclockwise
    padded: int = 0  # frames repeated at the end (short_clips = "repeat_last")
    shortened: int = 0  # frames the clip is short of num_frames (short_clips = "shorten")
    fetched: int | None = None  # bytes read from an object store (None: a local file)


def is_video(path: str) -> bool:
    """True when a row's file is a video, by its suffix (a `video` column names one too)."""
    return posixpath.splitext(path.lower())[1] in VIDEO_SUFFIXES


def video_key_settings(settings: FrameSettings) -> dict[str, Any]:
    """What about video decoding changes stage-1 outputs: for the cache key of a video family."""
    fields = ("num_frames", "frame_stride", "fps", "start", "short_clips")
    chosen = {name: getattr(settings, name) for name in fields}
    return {"video": {**chosen, "decode": VIDEO_DECODE_VERSION}}


def _av() -> Any:
    """PyAV, imported on first use: image-only installs do not need it."""
    try:
        import av
    except ImportError:
        raise DataError(
            "video rows need PyAV; `pip install 'splitstage[video]'` (or `pip install av`)"
        ) from None
    return av


def _refuse(where: str, shown: str, what: str) -> DataError:
    return DataError(f"{where}: video file {shown} {what}")


@contextlib.contextmanager
def open_video(rel: str, source: DataSource, where: str) -> Iterator[Any]:
    """A path (disks) or a seekable fsspec file (object stores): PyAV reads what it seeks."""
    if source.local:
        path = Path(source.local_root) / rel
        if not path.is_file():
            raise _refuse(where, str(path), "not found; fix the path or remove the row")
        yield str(path)
        return
    shown = source.display(relative_key(rel))
    try:
        handle = source.fs.open(
            source.path(relative_key(rel)), "rb", block_size=READ_BLOCK, cache_type="blockcache"
        )
    except FileNotFoundError:
        raise _refuse(where, shown, "not found; fix the path or remove the row") from None
    except Exception as exc:
        raise source.failure(f"read video file ({where})", shown, exc) from None
    with handle:
        yield _StoredFile(
            handle, lambda exc: source.failure(f"read video file ({where})", shown, exc)
        )


class _StoredFile:
    """A remote file for PyAV that keeps the storage error a read raised (PyAV would report it
    as bad data), so the row's message names the storage problem, not the video."""

    def __init__(self, handle: Any, failure: Callable[[BaseException], Exception]) -> None:
        self._handle, self._failure = handle, failure
        self.error: Exception | None = None

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._handle, method)(*args)
        except Exception as exc:
            self.error = self._failure(exc)
            raise

    def read(self, size: int = -1) -> bytes:
        """Bytes from the object (a ranged GET per block)."""
        return self._call("read", size)

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move within the object (no request until the next read)."""
        return self._call("seek", offset, whence)

    def tell(self) -> int:
        """The current offset."""
        return self._handle.tell()

    @property
    def fetched(self) -> int | None:
        """Bytes fetched from the store so far, in whole blocks (fsspec's block cache counts
        them; a file's short last block counts whole, so the sum is capped at the file size)."""
        asked = getattr(getattr(self._handle, "cache", None), "total_requested_bytes", None)
        return None if asked is None else min(asked, getattr(self._handle, "size", asked))


def _targets(stream: Any, container: Any, settings: FrameSettings, where: str, shown: str):
    """(target times in seconds, stream start, frame rate, frames in the header or None)."""
    rate = stream.average_rate or stream.guessed_rate
    if not rate or rate <= 0:
        raise _refuse(where, shown, f"has no frame rate in its header; {REENCODE}")
    fps = float(rate)
    base = stream.time_base or Fraction(1, 1)
    start = float(stream.start_time * base) if stream.start_time is not None else 0.0
    header_frames = stream.frames or None
    count = settings.num_frames
    if settings.start == "uniform":
        if stream.duration:
            duration = float(stream.duration * base)
        elif container.duration:
            duration = container.duration / 1_000_000  # AV_TIME_BASE
        else:
            raise _refuse(
                where,
                shown,
                f"has no duration in its header, so 'uniform' cannot spread "
                f"frames over it; use data.video.start = 'first' or {REENCODE}",
            )
        total = header_frames or max(1, round(duration * fps))
        spread = (total - 1) / (count - 1) if count > 1 and total > count else 1.0
        return [start + round(i * spread) / fps for i in range(count)], start, fps, header_frames
    step = 1.0 / settings.fps if settings.fps else (settings.frame_stride or 1) / fps
    return [start + i * step for i in range(count)], start, fps, header_frames


def _groups(times: list[float]) -> list[tuple[int, int]]:
    """[first, last) target ranges close enough to decode through; each other one is a seek."""
    groups, first = [], 0
    for index in range(1, len(times) + 1):
        if index == len(times) or times[index] - times[index - 1] > SEEK_GAP_SECONDS:
            groups.append((first, index))
            first = index
    return groups


def _mirrored(frame: Any) -> bool:
    """True when the frame's display matrix flips it (a negative determinant), e.g. a front
    camera's mirror image: only rotations are applied."""
    for data in frame.side_data:
        if getattr(data.type, "name", "") == "DISPLAYMATRIX":
            m = np.frombuffer(bytes(data)[:36], dtype=np.int32).astype(np.int64)
            return m[0] * m[4] - m[1] * m[3] < 0
    return False


def _upright(frame: Any, rotation: int) -> Image.Image:
    """A decoded frame as an upright RGB image (rotated counterclockwise by `rotation`)."""
    if rotation % 360 == 0:
        return frame.to_image()
    array = frame.to_ndarray(format="rgb24")
    return Image.fromarray(np.ascontiguousarray(np.rot90(array, k=(rotation // 90) % 4)))


def decode_clip(file: Any, where: str, shown: str, settings: FrameSettings) -> Clip:
    """The frames `settings` selects from a video (a path or a seekable file), by seeking."""
    av = _av()
    try:
        with av.open(file, mode="r") as container:
            streams = container.streams.video
            if not streams:
                raise _refuse(where, shown, f"has no video stream; {REENCODE}")
            clip = _decode(container, streams[0], where, shown, settings)
            return replace(clip, fetched=getattr(file, "fetched", None))
    except DataError:
        raise
    except EOFError as exc:  # av.error.EOFError too: the stream ends before any frame
        raise _refuse(where, shown, NO_FRAMES) from exc
    except (av.FFmpegError, ValueError, OSError) as exc:
        if (stored := getattr(file, "error", None)) is not None:  # storage, not the video
            raise stored from exc
        reason = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).strip()
        raise _refuse(where, shown, f"is corrupt or not a video ({reason}); {REENCODE}") from exc


def _decode(container: Any, stream: Any, where: str, shown: str, settings: FrameSettings) -> Clip:
    times, start, fps, header_frames = _targets(stream, container, settings, where, shown)
    width, height = stream.codec_context.width, stream.codec_context.height
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise _refuse(
            where,
            shown,
            f"is {width}x{height} pixels, over Pillow's {limit:,}-pixel "
            "limit; downscale it or remove the row",
        )
    tol = 0.25 / fps
    picked: list[Image.Image | None] = [None] * len(times)
    decoded, rotation = 0, None
    groups = _groups(times)
    span = sum(round((times[last - 1] - times[first]) * fps) + 1 for first, last in groups)
    for first, last in groups:
        if times[first] > start + tol:
            container.seek(int(times[first] / stream.time_base), stream=stream, backward=True)
        j, prev, prev_time, prev_image = first, None, None, None
        for frame in container.decode(stream):
            decoded += 1
            if decoded > span + MAX_EXTRA_DECODED:
                raise _refuse(
                    where,
                    shown,
                    f"needed over {MAX_EXTRA_DECODED:,} extra decoded "
                    "frames for one clip (keyframes too sparse to seek); re-encode it "
                    "with a keyframe every few seconds (ffmpeg -g 250) or remove it",
                )
            if rotation is None:
                rotation = int(round(frame.rotation or 0))
                if rotation % 90:
                    raise _refuse(
                        where,
                        shown,
                        f"has a display rotation of {rotation} degrees; "
                        f"only multiples of 90 are applied; {REENCODE}",
                    )
                if _mirrored(frame):
                    raise _refuse(
                        where, shown, f"is mirrored by its display matrix (not applied); {REENCODE}"
                    )
            now = (
                frame.time
                if frame.time is not None
                else (prev_time + 1 / fps if prev_time is not None else start)
            )
            while j < last and now > times[j] + tol:
                if prev is not None and prev_image is None:
                    prev_image = _upright(prev, rotation)
                picked[j] = prev_image if prev is not None else _upright(frame, rotation)
                j += 1
            if j == last:
                break
            prev, prev_time, prev_image = frame, now, None
        else:  # the end of the stream: the last frame is shown for one frame interval
            while j < last and prev is not None and times[j] < prev_time + 1 / fps - tol:
                picked[j] = prev_image or _upright(prev, rotation)
                prev_image = picked[j]
                j += 1
            if j < last:
                break
    frames = [image for image in picked if image is not None]
    frames = frames[: next((i for i, im in enumerate(picked) if im is None), len(picked))]
    if not frames:
        raise _refuse(where, shown, NO_FRAMES)
    padded = len(times) - len(frames)
    if padded and settings.short_clips == "shorten":
        kept = shortened_length(len(frames))
        return Clip(
            frames=frames[:kept],
            decoded=decoded,
            fps=fps,
            rotation=rotation or 0,
            shortened=len(times) - kept,
        )
    if padded and settings.short_clips != "repeat_last":
        said = f"; its header says {header_frames} (truncated?)" if header_frames else ""
        raise _refuse(
            where,
            shown,
            f"gives {len(frames)} of the {len(times)} frames a clip needs{said}; lower "
            "data.video.num_frames or frame_stride, set data.video.short_clips = "
            "'shorten' or 'repeat_last', or remove the row",
        )
    frames += [frames[-1]] * padded
    return Clip(frames=frames, decoded=decoded, fps=fps, rotation=rotation or 0, padded=padded)


def shortened_length(available: int) -> int:
    """The largest 4k+1 frame count within `available` frames (a video VAE's clip lengths)."""
    return available - (available - 1) % 4


def read_clip(
    row: Any, base_path: str | Path | DataSource, settings: FrameSettings | None = None
) -> Clip:
    """The clip of a metadata row (`row.image` names the video, `row.where` the row)."""
    if settings is None:
        from splitstage.config.job import VideoConfig

        settings = VideoConfig()
    source = source_for(base_path)
    shown = (
        source.display(relative_key(row.image))
        if not source.local
        else str(Path(source.local_root) / row.image)
    )
    with open_video(row.image, source, row.where) as file:
        return decode_clip(file, row.where, shown, settings)


def clip_to_tensor(
    frames: list[Image.Image], size: int | tuple[int, int] | SizeRule = 64
) -> torch.Tensor:
    """Frames -> [frames, 3, H, W] in [-1, 1], each cropped and resized as images are."""
    first = frames[0]
    if callable(size):
        height, width = size(first.height, first.width)
    else:
        height, width = (size, size) if isinstance(size, int) else size
    import torch  # here only: listing and hashing video rows import no torch

    return torch.stack([image_to_tensor(center_crop_resize(f, height, width)) for f in frames])


def load_clip(
    row: Any,
    base_path: str | Path | DataSource,
    settings: FrameSettings | None = None,
    size: int | tuple[int, int] | SizeRule = 64,
) -> torch.Tensor:
    """A video row as [frames, 3, H, W] in [-1, 1]: what a video family's sample loading calls."""
    return clip_to_tensor(read_clip(row, base_path, settings).frames, size)


def load_video_sample(
    row: Any,
    base_path: str | Path | DataSource,
    settings: FrameSettings | None = None,
    size: int | tuple[int, int] | SizeRule = 64,
) -> dict[str, Any]:
    """One video sample as `load_sample` gives an image one: the row's extra fields, then video
    [frames, 3, H, W] in [-1, 1], prompt, height, width, num_frames and source_size [h, w]."""
    clip = read_clip(row, base_path, settings)
    video = clip_to_tensor(clip.frames, size)
    first = clip.frames[0]
    return {
        **row.extras,
        "video": video,
        "prompt": row.prompt,
        "height": int(video.shape[2]),
        "width": int(video.shape[3]),
        "num_frames": int(video.shape[0]),
        "source_size": [first.height, first.width],
    }
