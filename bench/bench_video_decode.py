"""Video decoding for stage 1: frames decoded per second, and seeking vs decoding a whole video.

Run: .venv/bin/python bench/bench_video_decode.py [--side 256] [--seconds 120] [--clips 8]

Writes an h264 video (moving squares, `--side` square, 24 fps, a keyframe every 2 s) with PyAV,
then measures, side by side in one run:
(a) `read_clip` of 33 consecutive frames (Wan's 4k+1) from the start: frames decoded per second,
    and clip frames per second through `load_clip` (crop/resize to 256 and to a tensor);
(b) 5 frames spread over the whole video (`start = "uniform"`): `read_clip`, which seeks to each
    target's keyframe, vs decoding every frame of the file: frames decoded (goal: <= 10% of the
    file's for 120 s with keyframes every 2 s: a long file never costs its whole length) and the
    time ratio (noisy on a shared machine: for orientation).
(c) the same two reads from a moto S3 server on loopback (`--no-s3` skips it): bytes fetched
    per clip against the file's size (1 MiB blocks, none fetched twice: about a block a seek plus
    the mp4 index, so a short file is read nearly whole and a long one in small part).
`--check` exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitstage.data.dataset import Row  # noqa: E402
from splitstage.data.videos import FrameChoice, load_clip, read_clip  # noqa: E402

FIGURES: dict[str, float] = {}
FPS = 24


def write(path: Path, side: int, frames: int) -> None:
    """An h264 video of moving squares with a keyframe every 2 s."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "23"}
        stream.codec_context.gop_size = 2 * FPS
        base = np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)
        for index in range(frames):
            array = base.copy()
            x = (index * 3) % (side - 32)
            array[32:64, x : x + 32] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def decode_all(path: Path) -> int:
    """Decode every frame of the file (the cost seeking avoids)."""
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(container.streams.video[0]))


def on_s3(path: Path, row: Row, *choices: FrameChoice) -> None:
    """(c): read the clips from a moto S3 server on loopback; print bytes fetched per clip."""
    import os
    import socket

    from moto.server import ThreadedMotoServer

    from splitstage.data.source import DataSource

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        options = {"key": "bench", "secret": "bench"}
        options["client_kwargs"] = {"endpoint_url": f"http://127.0.0.1:{port}"}
        source = DataSource("s3://video-bench/data", options)
        source.fs.mkdir("video-bench")
        source.fs.put(str(path), source.path(row.image))
        size = path.stat().st_size
        for name, choice in zip(("33 consecutive", "5 uniform"), choices, strict=True):
            started = time.perf_counter()
            clip = read_clip(row, source, choice)
            took = time.perf_counter() - started
            FIGURES[f"s3_fetched_fraction_{choice.start}"] = clip.fetched / size
            print(
                f"(c) S3 {name}: fetched {clip.fetched:,} of {size:,} bytes "
                f"({clip.fetched / size:.0%}) in {took * 1000:.0f} ms"
            )
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--seconds", type=int, default=120)
    parser.add_argument("--clips", type=int, default=8, help="clips read in (a)")
    parser.add_argument("--no-s3", action="store_true", help="skip (c)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.mp4"
        started = time.perf_counter()
        write(path, args.side, args.seconds * FPS)
        print(
            f"wrote {args.seconds * FPS} frames {args.side}x{args.side} in "
            f"{time.perf_counter() - started:.1f} s ({path.stat().st_size:,} bytes)"
        )
        row = Row(line=2, image=path.name, prompt="squares")
        consecutive = FrameChoice(num_frames=33)
        started, decoded = time.perf_counter(), 0
        for _ in range(args.clips):
            decoded += read_clip(row, folder, consecutive).decoded
        decode_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(args.clips):
            load_clip(row, folder, consecutive, size=256)
        load_s = time.perf_counter() - started
        FIGURES["decoded_frames_per_s"] = decoded / decode_s
        FIGURES["clip_frames_per_s_to_tensor"] = 33 * args.clips / load_s
        print(
            f"(a) 33 consecutive frames x {args.clips}: {FIGURES['decoded_frames_per_s']:.0f} "
            f"decoded frames/s; {FIGURES['clip_frames_per_s_to_tensor']:.0f} clip frames/s "
            "to 256x256 tensors"
        )
        spread = FrameChoice(num_frames=5, start="uniform")
        started = time.perf_counter()
        clip = read_clip(row, folder, spread)
        seek_s = time.perf_counter() - started
        started = time.perf_counter()
        total = decode_all(path)
        all_s = time.perf_counter() - started
        FIGURES["seek_speedup"] = all_s / seek_s
        FIGURES["seek_decoded_fraction"] = clip.decoded / total
        print(
            f"(b) 5 frames over {args.seconds} s: seek {seek_s * 1000:.1f} ms decoding "
            f"{clip.decoded} frames; decode-all {all_s * 1000:.1f} ms decoding {total} frames; "
            f"decoded fraction {FIGURES['seek_decoded_fraction']:.1%} (goal <= 10%); time "
            f"ratio {FIGURES['seek_speedup']:.1f}"
        )
        if not args.no_s3:
            on_s3(path, row, consecutive, spread)
    if args.check and FIGURES["seek_decoded_fraction"] > 0.1:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
