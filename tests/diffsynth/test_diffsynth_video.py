"""DiffSynth's Wan (WanVideoPipeline) trained split from real video files the test writes with
PyAV: plan -> preprocess -> train -> export, and split = unsplit; the first update's loss
equals DiffSynth's own training step on the same clip (its first `num_frames` frames, decoded
here with plain PyAV and scaled by DiffSynth's ImageCropAndResize, as its video loader gives
them), seed and timestep."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffsynth.core.data.operators import ImageCropAndResize
from diffsynth.diffusion.loss import FlowMatchSFTLoss
from PIL import Image

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.dataset import Row
from splitstage.data.images import DataError
from splitstage.data.index import index_data_set
from splitstage.data.source import open_data_source
from splitstage.pipelines.draws import Draws
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.diffsynth_jobs import ENV, SEED, fresh, job_document, output, registered
from tests.helpers.tiny_diffsynth import write_tiny_models
from tests.helpers.video_files import write_video

WAN = "WanVideoPipeline"
FRAMES = 5  # 4k+1: two latent frames in Wan's causal VAE
SIZE = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Tiny Wan models and a data set of two short mp4 clips named in a CSV `video` column."""
    root = tmp_path_factory.mktemp("wan-video")
    info = write_tiny_models(WAN, root / WAN)
    (root / WAN / "info.json").write_text(json.dumps(info))
    data = root / "data"
    write_video(data / "clips" / "run.mp4", 12)
    write_video(data / "clips" / "walk.mp4", 9, rate=8, gop=3)
    Image.new("RGB", (40, 36), (200, 30, 30)).save(data / "still.png")
    write_video(data / "short.mp4", 3)
    rows = "video,prompt\nclips/run.mp4,a square runs\nclips/walk.mp4,a square walks\n"
    (data / "metadata.csv").write_text(rows)
    mixed = root / "mixed"  # an image row, a clip and a broken clip in one CSV
    mixed.mkdir()
    for name in ("still.png", "clips/run.mp4"):
        (mixed / name).parent.mkdir(exist_ok=True)
        (mixed / name).write_bytes((data / name).read_bytes())
    (mixed / "clips" / "cut.mp4").write_bytes((data / "clips" / "walk.mp4").read_bytes()[:300])
    rows = "image,video,prompt\nstill.png,,red\n,clips/run.mp4,runs\n,clips/cut.mp4,cut\n"
    (mixed / "metadata.csv").write_text(rows)
    return root


def info_of(root: Path) -> dict:
    return json.loads((root / WAN / "info.json").read_text())


def video_document(root: Path, **video) -> dict:
    """The Wan LoRA job on the clips: [data.video] num_frames = FRAMES unless `video` says."""
    document = job_document(root, WAN)
    document["data"]["video"] = {"num_frames": FRAMES, **video}
    return document


def diffsynth_frames(path: Path, count: int) -> list[Image.Image]:
    """What DiffSynth's LoadVideo gives by default: frames 0..count-1 of the file (decoded here
    with plain PyAV), each through its ImageCropAndResize at SIZE x SIZE."""
    resize = ImageCropAndResize(SIZE, SIZE, None, 16, 16)
    frames = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            frames.append(resize(frame.to_image()))
            if len(frames) == count:
                break
    return frames


def diffsynth_step(config, info: dict, frames: list[Image.Image], prompt: str, key: str) -> float:
    """DiffSynth's own training step on a clip as its Wan train.py builds the inputs
    (input_video, height and width of the frames, num_frames = len), its units through its
    runner, then FlowMatchSFTLoss with the global RNG seeded as splitstage seeds this sample."""
    family = make_plan(config).family
    shared = {**family.constants(), "input_video": frames, "num_frames": len(frames)}
    shared |= {"height": frames[0].size[1], "width": frames[0].size[0]}
    inputs = (shared, {"prompt": prompt}, {"negative_prompt": ""})
    pipe = fresh(WAN, info)
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
        torch.manual_seed(int(Draws.per_sample(SEED, [key], epoch=0).randint(2**62, 1)))
        return float(FlowMatchSFTLoss(pipe, **inputs[0], **inputs[1]))


def test_wan_trains_split_on_video_files_as_diffsynth_does(root):
    """The family's input_video is DiffSynth's clip pixel for pixel; stage 1 caches the clip's
    latents; the first update's loss is DiffSynth's own step (1e-6); unsplit training (every
    unit every step, decoding the videos) gives the same losses; the LoRA loads in DiffSynth."""
    config = config_from_dict(video_document(root))
    family = make_plan(config).family
    data = index_data_set(config)
    expected = {}
    with registered([info_of(root)]):
        for key, row in zip(data.keys, data.rows, strict=True):
            frames = diffsynth_frames(root / "data" / row.image, FRAMES)
            sample = family.load_sample(row, config.data.base_path)
            assert sample["num_frames"] == FRAMES and len(sample["input_video"]) == FRAMES
            for ours, theirs in zip(sample["input_video"], frames, strict=True):
                assert np.array_equal(np.asarray(ours), np.asarray(theirs)), row.image
            expected[key] = diffsynth_step(config, info_of(root), frames, row.prompt, key)
        report = preprocess(config, progress=False)
        assert report.computed == 2
        lines: list[str] = []
        result = train(config, run_root=root / "runs", env=ENV, on_line=lines.append)
        metrics = read_metrics(Path(result.run_dir))
        first = metrics[0]["loss"]
        gap = min(abs(first - e) for e in expected.values())
        assert gap <= 1e-6 * max(1.0, abs(first)), (first, expected)
        unsplit = video_document(root)
        unsplit["train"]["mode"] = "unsplit"  # every unit every step, from the video files
        unsplit["output"]["url"] = str(root / "out-unsplit")
        again = train(
            config_from_dict(unsplit), run_root=root / "runs", env=ENV, on_line=lines.append
        )
        reference = [m["loss"] for m in read_metrics(Path(again.run_dir))]
        assert [m["loss"] for m in metrics] == pytest.approx(reference, rel=1e-6, abs=1e-7)
        info = info_of(root)
        before = output(fresh(WAN, info), WAN)
        pipe = fresh(WAN, info)
        pipe.load_lora(pipe.dit, str(result.outputs["dit"]))
        assert not torch.equal(before, output(pipe, WAN))


def test_frame_settings_enter_the_cache_key_and_pipeline_num_frames_is_refused(root):
    """[data.video] is the one source of frames: its settings change the Wan cache key, and
    the old pipeline.num_frames is one line pointing there."""
    key = make_plan(config_from_dict(video_document(root))).cache_key
    assert key == make_plan(config_from_dict(video_document(root))).cache_key
    assert key != make_plan(config_from_dict(video_document(root, num_frames=9))).cache_key
    assert key != make_plan(config_from_dict(video_document(root, frame_stride=2))).cache_key
    assert key != make_plan(config_from_dict(video_document(root, start="uniform"))).cache_key
    document = video_document(root)
    document["pipeline"]["num_frames"] = 5
    with pytest.raises(ConfigError) as error:
        config_from_dict(document, "job.toml")
    assert "pipeline" in str(error.value) and "move it there" in str(error.value)
    assert "[data.video] (num_frames" in str(error.value)


def test_an_image_row_is_a_one_frame_clip_and_a_short_video_is_refused_by_row(root):
    """An image row becomes one frame (DiffSynth's video loader: [image]); a video with fewer
    frames than [data.video] asks is refused naming the row (or padded with repeat_last)."""
    config = config_from_dict(video_document(root))
    family = make_plan(config).family
    still = family.load_sample(Row(line=4, image="still.png", prompt="red"), root / "data")
    assert still["num_frames"] == 1 and len(still["input_video"]) == 1
    assert still["input_video"][0].size == (SIZE, SIZE)
    short = Row(line=5, image="short.mp4", prompt="short", source="metadata.csv")
    with pytest.raises(DataError, match=r"^metadata.csv row 5: video file .*short.mp4 gives 3 of"):
        family.load_sample(short, root / "data")
    padded = make_plan(config_from_dict(video_document(root, short_clips="repeat_last"))).family
    frames = padded.load_sample(short, root / "data")["input_video"]
    assert len(frames) == FRAMES and np.array_equal(np.asarray(frames[2]), np.asarray(frames[4]))


def test_a_mixed_data_set_trains_image_rows_as_one_frame_clips(root):
    """One CSV with `image` and `video` columns: the image row is a one-frame clip, the clip
    five frames, the broken clip is skipped by row (skip_bad_rows) in stage 1; both shapes are
    cached and trained one per step; the first update's loss is DiffSynth's step on its row."""
    document = video_document(root)
    document["data"] |= {"base_path": str(root / "mixed"), "skip_bad_rows": True}
    document["cache"]["url"] = str(root / "mixed-cache")
    document["output"]["url"] = str(root / "mixed-out")
    config = config_from_dict(document)
    data = index_data_set(config)
    resize = ImageCropAndResize(SIZE, SIZE, None, 16, 16)
    expected = {}
    with registered([info_of(root)]):
        for key, row in zip(data.keys, data.rows, strict=True):
            if row.image == "still.png":  # DiffSynth: LoadImage >> ImageCropAndResize >> ToList
                frames = [resize(Image.open(root / "mixed" / row.image).convert("RGB"))]
            elif row.image == "clips/run.mp4":
                frames = diffsynth_frames(root / "mixed" / row.image, FRAMES)
            else:
                continue
            expected[row.image] = diffsynth_step(config, info_of(root), frames, row.prompt, key)
        report = preprocess(config, progress=False)
        assert report.computed == 2 and report.skipped == 1
        ((line, reason),) = report.skipped_rows
        assert line == 4 and reason.startswith("metadata.csv row 4: video file ")
        assert "cut.mp4" in reason
        lines: list[str] = []
        result = train(config, run_root=root / "mixed-runs", env=ENV, on_line=lines.append)
        first = read_metrics(Path(result.run_dir))[0]["loss"]
        gap = min(abs(first - e) for e in expected.values())
        assert gap <= 1e-6 * max(1.0, abs(first)), (first, expected)


def test_clips_on_s3_give_the_same_samples_keys_and_cache(root, s3_bucket):
    """The same data set in a bucket (moto S3 on loopback): the same sample keys, the same
    input_video pixels (PyAV seeks in a block-cached fsspec file), and stage 1 computes it."""
    url, options = s3_bucket
    endpoint = options["client_kwargs"]["endpoint_url"]
    local = config_from_dict(video_document(root))
    document = video_document(root)
    document["data"] |= {"base_path": f"{url}/data", "storage_options": {"endpoint_url": endpoint}}
    document["cache"]["url"] = str(root / "s3-cache")
    remote = config_from_dict(document)
    source = open_data_source(remote.data)
    for name in ("metadata.csv", "clips/run.mp4", "clips/walk.mp4"):
        source.fs.put(str(root / "data" / name), source.path(name))
    here, there = index_data_set(local), index_data_set(remote)
    assert here.keys == there.keys
    family = make_plan(remote).family
    for row in there.rows:
        ours = family.load_sample(row, source)["input_video"]
        theirs = family.load_sample(row, local.data.base_path)["input_video"]
        assert [np.asarray(f).tobytes() for f in ours] == [np.asarray(f).tobytes() for f in theirs]
    report = preprocess(remote, progress=False)
    assert report.computed == 2 and report.cache_key == make_plan(local).cache_key
