"""Video rows decode to the frames `[data.video]` selects: real files written with PyAV, read back
by seeking (decoded frames counted), upright, from disk and from S3; bad files give one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("av")

from splitstage.config.base_group import ConfigError  # noqa: E402
from splitstage.config.job import VideoConfig, config_from_dict  # noqa: E402
from splitstage.data.dataset import Row, load_metadata  # noqa: E402
from splitstage.data.images import DataError, center_crop_resize, image_to_tensor  # noqa: E402
from splitstage.data.source import DataSource  # noqa: E402
from splitstage.data.videos import (  # noqa: E402
    FrameChoice,
    decode_clip,
    is_video,
    load_clip,
    load_video_sample,
    open_video,
    read_clip,
    video_key_settings,
)
from tests.helpers.video_files import frame_index, frame_pixels, write_video  # noqa: E402


def indices(clip) -> list[int]:
    return [frame_index(np.asarray(frame)) for frame in clip.frames]


def decode(path: Path, **settings):
    return decode_clip(str(path), "metadata.csv row 2", str(path), FrameChoice(**settings))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """A folder of small videos: 20 frames, 500 frames (keyframe every 10), a rotated one."""
    folder = tmp_path_factory.mktemp("videos")
    write_video(folder / "short.mp4", 20)
    write_video(folder / "long.mp4", 500, gop=10)
    write_video(folder / "phone.mp4", 5, rotation=90)
    write_video(folder / "seven.mkv", 7, codec="mpeg4")
    return folder


def test_first_frames_at_a_stride(clips):
    clip = decode(clips / "short.mp4", num_frames=5, frame_stride=3)
    assert indices(clip) == [0, 3, 6, 9, 12]
    assert clip.fps == 10.0 and clip.padded == 0


def test_fps_resamples_by_timestamp(clips):
    assert indices(decode(clips / "short.mp4", num_frames=5, fps=5)) == [0, 2, 4, 6, 8]
    assert indices(decode(clips / "short.mp4", num_frames=5, fps=20)) == [0, 0, 1, 1, 2]


def test_variable_frame_rate_is_sampled_by_time(tmp_path):
    times = [0, 0.1, 0.15, 0.4, 0.5, 0.55, 0.9, 1.0, 1.2, 1.3]
    path = write_video(tmp_path / "vfr.mkv", len(times), times=times)
    assert indices(decode(path, num_frames=5, fps=5)) == [0, 2, 3, 5, 5]  # shown at 0, .2, ...


def test_uniform_spreads_over_the_whole_video(clips):
    assert indices(decode(clips / "short.mp4", num_frames=5, start="uniform")) == [0, 5, 10, 14, 19]


def test_a_long_video_decodes_only_what_it_needs(clips):
    clip = decode(clips / "long.mp4", num_frames=5, start="uniform")
    assert indices(clip) == [0, 125, 250, 374, 499]
    assert clip.decoded <= 5 * 10  # one keyframe interval a target, not 500 frames
    near = decode(clips / "long.mp4", num_frames=9, frame_stride=2)
    assert indices(near) == list(range(0, 18, 2)) and near.decoded <= 18


def test_hours_long_video_costs_a_few_keyframe_intervals(tmp_path):
    path = write_video(tmp_path / "hours.mkv", 3 * 3600, rate=1, gop=30)  # 3 hours at 1 fps
    clip = decode(path, num_frames=5, start="uniform")
    assert indices(clip) == [i % 512 for i in (0, 2700, 5400, 8099, 10799)]
    assert clip.decoded <= 5 * 30


def test_keyframes_too_sparse_to_seek_are_refused(tmp_path, monkeypatch):
    from splitstage.data import videos

    path = write_video(tmp_path / "one_key.mp4", 300, gop=300)  # one keyframe in 30 s
    monkeypatch.setattr(videos, "MAX_EXTRA_DECODED", 50)  # 10,000 in use: a smaller file here
    with pytest.raises(DataError, match=r"^metadata.csv row 2: .*\(keyframes too sparse to seek\)"):
        decode(path, num_frames=5, start="uniform")
    assert indices(decode(path, num_frames=5)) == [0, 1, 2, 3, 4]  # consecutive: no extra


def test_rotation_is_applied(clips):
    clip = decode(clips / "phone.mp4", num_frames=1)
    upright = np.asarray(clip.frames[0])
    assert clip.rotation == 90 and upright.shape == (64, 48, 3)
    stored = frame_pixels(0)
    assert np.abs(upright.astype(int) - np.rot90(stored, 1)).mean() < 2  # counterclockwise
    assert np.abs(upright.astype(int) - np.rot90(stored, -1)).mean() > 20


@pytest.mark.parametrize("rotation", [-90, 180])
def test_other_rotations(tmp_path, rotation):
    path = write_video(tmp_path / "turned.mp4", 3, rotation=rotation)
    upright = np.asarray(decode(path, num_frames=1).frames[0]).astype(int)
    assert np.abs(upright - np.rot90(frame_pixels(0), rotation // 90)).mean() < 2


def test_a_mirrored_video_is_refused(tmp_path):
    import av

    with av.open(str(tmp_path / "selfie.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.set_display_rotation(90, hflip=True)
        frame = av.VideoFrame.from_ndarray(frame_pixels(0), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(DataError, match=r"^metadata.csv row 2: video file .* is mirrored by its"):
        decode(tmp_path / "selfie.mp4", num_frames=1)


def test_a_file_without_a_video_stream(tmp_path):
    import av

    with av.open(str(tmp_path / "sound.mkv"), "w") as container:
        stream = container.add_stream("mp2", rate=44100)
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 1152), np.int16), format="s16", layout="mono"
        )
        frame.sample_rate = 44100
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(
        DataError, match=r"^metadata.csv row 2: video file .*sound.mkv has no video"
    ):
        decode(tmp_path / "sound.mkv", num_frames=1)


def test_short_clips_refused_by_row_or_padded(clips):
    with pytest.raises(DataError) as caught:
        decode(clips / "seven.mkv", num_frames=9)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("metadata.csv row 2: video file ")
    assert "gives 7 of the 9 frames" in message
    assert "short_clips = 'shorten' or 'repeat_last'" in message
    clip = decode(clips / "seven.mkv", num_frames=9, short_clips="repeat_last")
    assert indices(clip) == [0, 1, 2, 3, 4, 5, 6, 6, 6] and clip.padded == 2


@pytest.mark.parametrize(
    ("num_frames", "stride", "expected"),
    [(9, 1, [0, 1, 2, 3, 4]), (13, 1, [0, 1, 2, 3, 4]), (5, 1, [0, 1, 2, 3, 4]), (9, 2, [0])],
)
def test_shorten_cuts_a_short_video_to_its_largest_4k_plus_1_frames(
    clips, num_frames, stride, expected
):
    """DiffSynth's rule for short videos: the largest 4k+1 frames the file has (7 -> 5; at
    stride 2 it has 4 -> 1); a video long enough is not cut."""
    clip = decode(
        clips / "seven.mkv", num_frames=num_frames, frame_stride=stride, short_clips="shorten"
    )
    assert indices(clip) == expected and clip.padded == 0
    assert clip.shortened == num_frames - len(expected)
    assert len(decode(clips / "short.mp4", num_frames=9, short_clips="shorten").frames) == 9


def test_bad_files_give_one_line_naming_the_row(clips, tmp_path):
    import av

    data = (clips / "short.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])  # no moov atom left
    (tmp_path / "garbage.mp4").write_bytes(b"not a video at all " * 40)
    (tmp_path / "empty.mp4").write_bytes(b"")
    with av.open(str(tmp_path / "zero.mkv"), "w") as container:  # a stream, no frames
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    long_mkv = write_video(tmp_path / "l.mkv", 40, codec="mpeg4").read_bytes()
    (tmp_path / "cut.mkv").write_bytes(long_mkv[: len(long_mkv) // 2])  # about 12 frames left
    expected = {
        "cut.mp4": "is corrupt or not a video",
        "garbage.mp4": "is corrupt or not a video",
        "empty.mp4": "is corrupt or not a video",
        "zero.mkv": "has no decodable frames",
        "cut.mkv": "of the 33 frames a clip needs",
    }
    for name, words in expected.items():
        with pytest.raises(DataError) as caught:
            decode(tmp_path / name, num_frames=33)
        message = str(caught.value)
        assert "\n" not in message and words in message, (name, message)
        assert message.startswith(f"metadata.csv row 2: video file {tmp_path / name} ")


def test_load_clip_is_frames_cropped_as_images(clips):
    row = Row(line=2, image="short.mp4", prompt="squares")
    tensor = load_clip(row, clips, FrameChoice(num_frames=5), size=(32, 40))
    assert tensor.shape == (5, 3, 32, 40) and tensor.dtype == torch.float32
    assert tensor.min() >= -1 and tensor.max() <= 1
    frames = read_clip(row, clips, FrameChoice(num_frames=5)).frames
    each = torch.stack([image_to_tensor(center_crop_resize(f, 32, 40)) for f in frames])
    assert torch.equal(tensor, each)


def test_a_video_sample_is_shaped_as_an_image_sample(clips):
    row = Row(line=2, image="phone.mp4", prompt="squares", extras={"seed": 3})
    sample = load_video_sample(row, clips, FrameChoice(num_frames=5), size=(16, 24))
    assert sample["video"].shape == (5, 3, 16, 24) and sample["prompt"] == "squares"
    assert (sample["height"], sample["width"], sample["num_frames"]) == (16, 24, 5)
    assert sample["source_size"] == [64, 48] and sample["seed"] == 3  # upright: portrait


def test_image_rows_are_one_frame_clips(clips, tmp_path):
    from PIL import Image

    from splitstage.data.clips import load_clip_sample
    from splitstage.data.dataset import load_sample

    Image.fromarray(frame_pixels(3)).save(tmp_path / "still.png")
    row = Row(line=5, image="still.png", prompt="a still")
    sample = load_clip_sample(row, tmp_path, FrameChoice(num_frames=5), size=(16, 24))
    assert sample["video"].shape == (1, 3, 16, 24) and sample["num_frames"] == 1
    assert torch.equal(sample["video"][0], load_sample(row, tmp_path, (16, 24))["image"])
    video = load_clip_sample(Row(line=2, image="short.mp4", prompt="x"), clips, FrameChoice(5), 16)
    assert video["video"].shape == (5, 3, 16, 16) and video["source_size"] == [48, 64]


def test_corruption_inside_the_frames_a_clip_needs(clips, tmp_path):
    data = bytearray((clips / "short.mp4").read_bytes())
    middle = len(data) // 3
    data[middle : middle + 200] = np.random.default_rng(0).integers(0, 255, 200, np.uint8).tobytes()
    (tmp_path / "hurt.mp4").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"^metadata.csv row 2: video file .* is corrupt or not"):
        decode(tmp_path / "hurt.mp4", num_frames=17)


def test_video_rows_in_metadata(clips, tmp_path):
    for name in ("short.mp4", "seven.mkv"):
        (tmp_path / name).write_bytes((clips / name).read_bytes())
    (tmp_path / "bad.mp4").write_bytes(b"junk")
    lines = [
        {"video": "short.mp4", "prompt": "squares"},
        {"video": "bad.mp4", "prompt": "junk"},
        {"video": "seven.mkv", "prompt": "seven"},
    ]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows, skipped = load_metadata(tmp_path, skip_bad_rows=True, check_images=True)
    assert [r.image for r in rows] == ["short.mp4", "seven.mkv"] and all(
        r.extras == {} for r in rows
    )
    assert [s.line for s in skipped] == [2]
    assert skipped[0].reason.startswith("metadata.jsonl row 2: video file ")
    with pytest.raises(DataError, match=r"^metadata.jsonl row 2: video file .*bad.mp4 is corrupt"):
        load_metadata(tmp_path, check_images=True)
    assert is_video("a/B.MP4") and not is_video("a/b.png")


def test_the_data_index_keys_video_rows_by_content(clips, tmp_path):
    from splitstage.data.index import index_data_set

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.mp4").write_bytes((clips / "short.mp4").read_bytes())
    (data / "b.mkv").write_bytes((clips / "seven.mkv").read_bytes())
    lines = [{"video": "a.mp4", "prompt": "one"}, {"video": "b.mkv", "prompt": "two"}]
    (data / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = config_from_dict({"data": {"base_path": str(data)}, "cache": {"url": str(tmp_path)}})
    first = index_data_set(config)
    again = index_data_set(config)  # from the index memo: rows rebuilt from columns
    assert first.keys == again.keys and len(set(first.keys)) == 2
    assert all(is_video(row.image) for row in again.rows)
    assert read_clip(again.rows[1], data, FrameChoice(num_frames=5)).frames


def test_video_settings_validate_and_enter_the_key():
    base = {"data": {"base_path": "data", "video": {"num_frames": 33, "frame_stride": 2}}}
    assert config_from_dict(base).data.video.num_frames == 33
    refusals = {
        "num_frames = 8": {"num_frames": 8},
        "start = 'random'": {"start": "random"},
        "not both": {"fps": 8, "frame_stride": 2},
    }
    for words, settings in refusals.items():
        with pytest.raises(Exception, match=words):
            VideoConfig(**settings)
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"data": {"video": {"num_frames": 16}}}, "job.toml")
    assert str(caught.value) == (
        "job.toml: data.video.num_frames: num_frames = 16: video VAEs (Wan) encode 4k+1 frames; "
        "use 13 or 17"
    )
    key = video_key_settings(VideoConfig(num_frames=33))
    assert key != video_key_settings(VideoConfig(num_frames=33, frame_stride=2))
    assert key["video"]["decode"].startswith("splitstage-video-")


def test_video_rows_on_s3(clips, s3_bucket):
    url, options = s3_bucket
    source = DataSource(url, options)
    source.fs.put(str(clips / "long.mp4"), source.path("clips/long.mp4"))
    row = Row(line=3, image="clips/long.mp4", prompt="squares")
    clip = read_clip(row, source, FrameChoice(num_frames=5, start="uniform"))
    assert indices(clip) == [0, 125, 250, 374, 499]
    assert 0 < clip.fetched <= source.fs.size(source.path("clips/long.mp4"))  # one 1 MiB block
    settings = FrameChoice(num_frames=5, frame_stride=7)
    here = load_clip(Row(line=3, image="long.mp4", prompt="squares"), clips, settings)
    assert torch.equal(load_clip(row, source, settings), here)
    with pytest.raises(DataError, match=r"^metadata row 3: video file s3://.*/missing.mp4 not"):
        read_clip(Row(line=3, image="missing.mp4", prompt="x"), source)


def test_a_storage_failure_while_decoding_names_storage(clips, s3_bucket):
    url, options = s3_bucket
    source = DataSource(url, options)
    source.fs.put(str(clips / "short.mp4"), source.path("short.mp4"))
    with open_video("short.mp4", source, "metadata.csv row 4") as file:
        source.fs.rm(source.path("short.mp4"))  # gone between the open and the reads
        with pytest.raises(DataError) as caught:
            decode_clip(file, "metadata.csv row 4", "shown", FrameChoice(num_frames=5))
    message = str(caught.value)
    assert "\n" not in message and "short.mp4" in message and "corrupt" not in message, message
