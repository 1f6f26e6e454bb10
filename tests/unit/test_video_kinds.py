"""What a row's file is decides how it trains: frames by their own presentation times (a real
variable-frame-rate file), animated GIF/APNG/WebP files as clips by their frame durations,
videos known by content whatever their name, images named like videos, and video rows refused
for a family that trains on images. Real files: PyAV writes the videos, Pillow the images."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("av")

from splitstage.config.job import config_from_dict  # noqa: E402
from splitstage.data.clips import clip_frames, load_clip_sample  # noqa: E402
from splitstage.data.dataset import Row, decode_image, load_metadata, read_image_bytes  # noqa: E402
from splitstage.data.images import DataError  # noqa: E402
from splitstage.data.videos import FrameChoice, decode_clip, is_video, read_clip  # noqa: E402
from splitstage.pipelines.distill_rows import check_rows  # noqa: E402
from tests.helpers.video_files import frame_index, frame_pixels, write_video  # noqa: E402

DELAYS = [100, 50, 200, 100, 100, 30]  # ms: frames start at 0, .1, .15, .35, .45, .55


def row(name: str) -> Row:
    return Row(line=2, image=name, prompt="a clip", source="metadata.csv")


def indices(frames) -> list[int]:
    return [frame_index(np.asarray(frame)) for frame in frames]


def test_a_frame_shown_after_the_target_time_is_never_chosen(tmp_path):
    # 5 fps in the header: a constant-rate tolerance (a quarter frame, 50 ms) took the frame
    # at 0.24 s for the target 0.2 s, although the frame shown at 0.2 s is the one from 0 s
    times = [0, 0.24, 0.5, 0.74, 1.0, 1.24, 1.5, 1.74, 2.0]
    path = write_video(tmp_path / "vfr.mkv", len(times), rate=5, times=times)
    clip = decode_clip(str(path), "metadata.csv row 2", str(path), FrameChoice(num_frames=8, fps=5))
    assert indices(clip.frames) == [0, 0, 1, 2, 3, 4, 4, 5]  # targets 0, .2, .4, ..., 1.4 s
    # AVI counts frames (time base 1/10 s): a target 45 ms before frame 5 still takes frame 4
    avi = write_video(tmp_path / "cfr.avi", 20, codec="mpeg4")
    clip = decode_clip(str(avi), "row", str(avi), FrameChoice(num_frames=4, fps=2.2))
    assert indices(clip.frames) == [0, 4, 9, 13]  # targets 0, .4545, .909, 1.364 s


def _animation(path: Path, delays: list[int], **options) -> Path:
    frames = [Image.fromarray(frame_pixels(i)) for i in range(len(delays))]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=delays, **options)
    return path


@pytest.mark.parametrize("name", ["anim.gif", "anim.png", "anim.webp"])
def test_animated_images_are_clips_by_frame_duration(tmp_path, name):
    _animation(tmp_path / name, DELAYS, loop=0, **({"lossless": True} if "webp" in name else {}))
    settings = FrameChoice(num_frames=5, fps=10)  # targets 0, .1, .2, .3, .4 s
    sample = load_clip_sample(row(name), tmp_path, settings, size=(48, 64))
    assert sample["num_frames"] == 5 and tuple(sample["video"].shape) == (5, 3, 48, 64)
    assert indices(clip_frames(row(name), tmp_path, settings)) == [0, 1, 2, 2, 3]
    short = FrameChoice(num_frames=9, fps=10)  # the animation lasts 0.58 s: 6 of 9 targets
    with pytest.raises(
        DataError,
        match=rf"^metadata.csv row 2: animated image file .*{name} gives 6 of the 9 frames",
    ):
        clip_frames(row(name), tmp_path, short)


def test_gif_delays_of_10_ms_or_less_play_as_100_ms(tmp_path):
    _animation(tmp_path / "fast.gif", [0, 0, 0, 0])
    settings = FrameChoice(num_frames=4, fps=10)
    assert indices(clip_frames(row("fast.gif"), tmp_path, settings)) == [0, 1, 2, 3]
    Image.fromarray(frame_pixels(5)).save(tmp_path / "still.gif")  # one frame: still an image
    sample = load_clip_sample(row("still.gif"), tmp_path, settings, size=32)
    assert sample["num_frames"] == 1 and indices(clip_frames(row("still.gif"), tmp_path)) == [5]


@pytest.mark.parametrize(
    ("name", "codec", "container"),
    [("v.3gp", "mpeg4", "QuickTime / MOV"), ("v.flv", "flv", "'flv'"), ("v.wmv", "wmv2", "'asf'")],
)
def test_other_video_containers_are_videos(tmp_path, name, codec, container):
    write_video(tmp_path / name, 6, codec=codec)
    assert is_video(name)
    assert indices(read_clip(row(name), tmp_path, FrameChoice(num_frames=5)).frames) == [
        0,
        1,
        2,
        3,
        4,
    ]
    odd = tmp_path / f"{name}.bin"  # no video suffix: known by its content
    shutil.copy(tmp_path / name, odd)
    assert indices(clip_frames(row(odd.name), tmp_path, FrameChoice(num_frames=5))) == [
        0,
        1,
        2,
        3,
        4,
    ]
    with pytest.raises(
        DataError,
        match=rf"^metadata.csv row 2: image file .*{odd.name} is a video \(.*{container}.*\), "
        "not an image; give an image here",
    ):
        decode_image(read_image_bytes(row(odd.name), tmp_path), row(odd.name), tmp_path)


def test_an_image_named_like_a_video_is_said_to_be_an_image(tmp_path):
    Image.fromarray(frame_pixels(3)).save(tmp_path / "still.png")
    shutil.copy(tmp_path / "still.png", tmp_path / "still.mp4")
    with pytest.raises(
        DataError,
        match=r"^metadata.csv row 2: video file .*still.mp4 is a PNG image, not a video; "
        r"give it its image suffix \(.png",
    ):
        read_clip(row("still.mp4"), tmp_path, FrameChoice(num_frames=9))


def test_video_rows_are_refused_before_stage_1_for_an_image_family(tmp_path):
    write_video(tmp_path / "clips" / "a.mp4", 3)
    Image.fromarray(frame_pixels(1)).save(tmp_path / "b.png")
    (tmp_path / "metadata.csv").write_text(
        "image,video,prompt\nb.png,,an image\n,clips/a.mp4,a clip\n,clips/a.mp4,again\n"
    )
    rows = load_metadata(tmp_path)
    sd = config_from_dict({"pipeline": {"name": "sd", "pretrained": str(tmp_path)}})
    with pytest.raises(
        DataError,
        match=r"^metadata.csv row 3 \(clips/a.mp4\), metadata.csv row 4 \(clips/a.mp4\): video "
        r"files, but the 'sd' family trains on images; video rows train with 'wan' or "
        r"'wan_i2v' or 'diffsynth' with pipeline_class = 'WanVideoPipeline': set pipeline.name",
    ):
        check_rows(sd, rows)
    check_rows(config_from_dict({"pipeline": {"name": "wan", "pretrained": str(tmp_path)}}), rows)
    check_rows(sd, rows[:1])  # the image row alone


def test_rows_recorded_as_undecodable_are_tried_again_under_a_new_video_decoder():
    from splitstage.data.videos import VIDEO_DECODE_VERSION
    from splitstage.tasks.stage1 import undecodable

    assert VIDEO_DECODE_VERSION in undecodable.DECODER  # a .3gp once "not an image" is retried
