"""Video files -> clips: the frames `[data.video]` selects, decoded with PyAV by seeking (never a
whole video into memory), upright, as PIL images or a [frames, 3, H, W] tensor in [-1, 1]; a bad
file raises one DataError line naming the row, the file and the fix.

Choices (the same for every file, so a clip depends only on the file's bytes and the settings):

- frames are chosen by timestamp: target times are start + i * stride / fps of the stream
  ('first' with frame_stride), start + i / fps ('first' with fps) or num_frames spread evenly over
  the stream's duration ('uniform'); each target takes the frame shown at that time: the last
  frame whose own presentation time (pts * time_base) is not after it (to half a tick of a
  fine time base, to which a muxer rounds timestamps: `_tolerance`). Variable-frame-rate files
  are therefore sampled by time, never by an assumed constant rate.
- a file is a video by its suffix (VIDEO_SUFFIXES) or, whatever its name, by what PyAV finds in
  it (`clips.py`); a still picture that FFmpeg would read as a one-frame video (a PNG named
  .mp4) is refused as an image.
- animated images (GIF, APNG, animated WebP) in a video family are clips: Pillow decodes their
  frames, each shown for its own duration (a GIF delay of 10 ms or less plays as 100 ms, as in
  browsers), and frames are chosen by time as for videos.
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

import bisect
import contextlib
import io
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image, ImageOps

from splitstage.data.images import (
    DataError,
    center_crop_resize,
    image_to_tensor,
    normalize,
    to_rgb8,
)
from splitstage.data.media_kind import still_image_format
from splitstage.data.source import DataSource, relative_key, source_for

if TYPE_CHECKING:
    import torch

VIDEO_DECODE_VERSION = "splitstage-video-v2"  # bump when the frames a file decodes to change
VIDEO_SUFFIXES = (
    *(".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".3gp", ".3g2"),
    *(".flv", ".f4v", ".wmv", ".asf", ".ogv", ".m2ts", ".mts", ".vob"),
)
SHORTEST_DELAY = 0.01  # s: GIF delays up to this play as DEFAULT_DELAY (as browsers do)
DEFAULT_DELAY = 0.1
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
    duration = None
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
    times = _target_times(start, fps, duration, header_frames, settings)
    return times, start, fps, header_frames


def _target_times(
    start: float, fps: float, duration: float | None, frames: int | None, settings: FrameSettings
) -> list[float]:
    """The clip's target times in seconds: from `start` at a stride or `settings.fps`, or
    (`uniform`) num_frames spread over the `duration` (or the `frames` count when known)."""
    count = settings.num_frames
    if settings.start == "uniform":
        total = frames or max(1, round((duration or 0.0) * fps))
        spread = (total - 1) / (count - 1) if count > 1 and total > count else 1.0
        return [start + round(i * spread) / fps for i in range(count)]
    step = 1.0 / settings.fps if settings.fps else (settings.frame_stride or 1) / fps
    return [start + i * step for i in range(count)]


def _tolerance(stream: Any, fps: float) -> float:
    """How far after a target a frame's timestamp may lie and still count as shown at it: half
    a tick where ticks are fine (a muxer rounds to them: 1 ms in mkv), none beyond float error
    where a tick is a frame or more (AVI counts frames: nothing was rounded)."""
    tick = float(stream.time_base or 0)
    return tick / 2 if 0 < tick <= 0.25 / fps else 1e-6


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
            if picture := still_image_format(container):
                raise _refuse(
                    where,
                    shown,
                    f"is a {picture} image, not a video; give it its image suffix "
                    f"(.{picture.lower()}: an image row, one frame) or give the video file",
                )
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
    tol = _tolerance(stream, fps)
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
    found = (frames, len(times), header_frames, decoded, fps, rotation or 0)
    return _finish(*found, settings, lambda what: _refuse(where, shown, what))


def decode_animation(data: bytes, where: str, shown: str, settings: FrameSettings) -> Clip:
    """The frames `settings` selects from an animated image (GIF, APNG, WebP), by time: each
    frame is shown for its own duration, and each target takes the frame shown then."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            limit = Image.MAX_IMAGE_PIXELS
            if limit and img.width * img.height > limit:
                raise _refuse_image(
                    where,
                    shown,
                    f"is {img.width}x{img.height} pixels, over Pillow's {limit:,}-pixel limit; "
                    "downscale it or remove the row",
                )
            starts, end = _frame_starts(img)
            fps = len(starts) / end
            times = _target_times(0.0, fps, end, len(starts), settings)
            chosen = [_shown_at(starts, end, t) for t in times]
            kept = [i for i in chosen if i is not None]
            frames = _animation_frames(img, sorted(set(kept)), where, shown)
    except DataError:
        raise
    except Exception as exc:  # Pillow's plugins raise many types on malformed files
        reason = (str(exc) or type(exc).__name__).strip()
        raise _refuse_image(
            where, shown, f"is a corrupt animated image ({reason}); re-export it or remove the row"
        ) from exc
    picked = [frames[i] for i in kept]
    found = (picked, len(times), None, len(frames), fps, 0)
    return _finish(*found, settings, lambda what: _refuse_image(where, shown, what))


def _refuse_image(where: str, shown: str, what: str) -> DataError:
    return DataError(f"{where}: animated image file {shown} {what}")


def _frame_starts(img: Image.Image) -> tuple[list[float], float]:
    """(each frame's start time, the animation's length) in seconds, from frame durations."""
    starts, now = [], 0.0
    for index in range(img.n_frames):
        img.seek(index)
        img.load()  # WebP gives a frame's duration once it is loaded
        delay = (img.info.get("duration") or 0) / 1000
        starts.append(now)
        now += DEFAULT_DELAY if delay <= SHORTEST_DELAY else delay
    return starts, now


def _shown_at(starts: list[float], end: float, time: float) -> int | None:
    """The frame shown at `time`: the last whose start is not after it; None past the end."""
    if time >= end - 1e-9:
        return None
    return max(bisect.bisect_right(starts, time + 1e-9) - 1, 0)


def _animation_frames(
    img: Image.Image, wanted: list[int], where: str, shown: str
) -> dict[int, Image.Image]:
    """The `wanted` frames as upright 8-bit RGB images (transparency onto white, as images)."""
    out = {}
    for index in wanted:
        img.seek(index)
        frame = ImageOps.exif_transpose(img.copy())
        out[index] = to_rgb8(normalize(frame, where, shown))
    return out


def _finish(
    frames: list[Image.Image],
    wanted: int,
    available: int | None,
    decoded: int,
    fps: float,
    rotation: int,
    settings: FrameSettings,
    refuse: Callable[[str], DataError],
) -> Clip:
    """A clip of the `frames` found for `wanted` targets: refused, shortened or padded when
    short, by `settings.short_clips` (`available`: the frames the file's header says it has)."""
    if not frames:
        raise refuse(NO_FRAMES)
    padded = wanted - len(frames)
    if padded and settings.short_clips == "shorten":
        kept = shortened_length(len(frames))
        return Clip(
            frames=frames[:kept],
            decoded=decoded,
            fps=fps,
            rotation=rotation,
            shortened=wanted - kept,
        )
    if padded and settings.short_clips != "repeat_last":
        said = f"; its header says {available} (truncated?)" if available else ""
        raise refuse(
            f"gives {len(frames)} of the {wanted} frames a clip needs{said}; lower "
            "data.video.num_frames or frame_stride, set data.video.short_clips = "
            "'shorten' or 'repeat_last', or remove the row",
        )
    frames = frames + [frames[-1]] * padded
    return Clip(frames=frames, decoded=decoded, fps=fps, rotation=rotation, padded=padded)


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
    with open_video(row.image, source, row.where) as file:
        return decode_clip(file, row.where, shown_path(row.image, source), settings)


def shown_path(rel: str, source: DataSource) -> str:
    """A row's file as messages name it: the path on disk, or the URL on a store."""
    if source.local:
        return str(Path(source.local_root) / rel)
    return source.display(relative_key(rel))


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
    return clip_sample(row, read_clip(row, base_path, settings), size)


def clip_sample(
    row: Any, clip: Clip, size: int | tuple[int, int] | SizeRule = 64
) -> dict[str, Any]:
    """A decoded clip as a sample: the row's extra fields, then video [frames, 3, H, W] in
    [-1, 1], prompt, height, width, num_frames and source_size [h, w]."""
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
