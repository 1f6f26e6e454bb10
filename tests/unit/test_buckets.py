"""Aspect-ratio buckets: the sizes, which bucket an image goes to, load_sample, the cache key."""

from __future__ import annotations

import math

import pytest
from PIL import Image
from pydantic import ValidationError

from splitstage.config.bucket_settings import BucketConfig
from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.buckets import BucketError, Buckets
from splitstage.data.dataset import Row, load_sample
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.job_plan import make_plan
from tests.helpers.demo_job import demo_sections


def buckets(resolution=1024, multiple=8, **fields) -> Buckets:
    return Buckets(BucketConfig(enabled=True, **fields), resolution, multiple)


@pytest.mark.parametrize(
    ("resolution", "fields"),
    [(1024, {}), (512, {"step": 32}), (64, {"step": 16}), (768, {"max_aspect": 2.0})],
)
def test_every_bucket_fits_the_settings(resolution, fields):
    b = buckets(resolution, **fields)
    step = b.config.step
    assert len(b.sizes) == len(set(b.sizes)) > 1
    for h, w in b.sizes:
        assert h % step == 0 and w % step == 0
        assert b.min_side <= min(h, w) and max(h, w) <= b.max_side
        assert max(h, w) / min(h, w) <= b.config.max_aspect
        assert h * w <= resolution**2
        assert (w, h) in b.sizes  # portrait and landscape alike
    assert (resolution, resolution) in b.sizes


def test_an_image_goes_to_the_bucket_of_nearest_aspect_ratio():
    b = buckets()
    for height, width in [(1024, 1024), (768, 1365), (1365, 768), (333, 1000), (4000, 90)]:
        bh, bw = b.size_for(height, width)
        best = min(abs(math.log(h / w) - math.log(height / width)) for h, w in b.sizes)
        assert abs(math.log(bh / bw) - math.log(height / width)) == pytest.approx(best)
        assert b.size_for(width, height) == (bw, bh)
    assert b.size_for(1024, 1024) == (1024, 1024)
    assert b.size_for(768, 1344) == (768, 1344)  # an exact bucket stays itself


def test_settings_that_give_no_bucket_say_what_to_change():
    with pytest.raises(BucketError, match="widen min_side/max_side"):
        buckets(64, step=64, min_side=128)
    with pytest.raises(BucketError, match="not a multiple of 16.*use 32"):
        buckets(512, 16, step=24)
    with pytest.raises(ValidationError, match="min_side 512 is larger than max_side 256"):
        BucketConfig(min_side=512, max_side=256)
    with pytest.raises(ValidationError, match="not a multiple of step 64"):
        BucketConfig(min_side=100)


def _row(tmp_path, height, width) -> Row:
    Image.new("RGB", (width, height), (200, 30, 30)).save(tmp_path / "a.png")
    return Row(line=2, image="a.png", prompt="red")


def test_load_sample_crops_to_the_bucket_of_each_image(tmp_path):
    b = buckets(64, 16, step=16)
    wide = load_sample(_row(tmp_path, 60, 120), tmp_path, b.size_for)
    assert (wide["height"], wide["width"]) == b.size_for(60, 120) == (48, 80)
    assert tuple(wide["image"].shape) == (3, 48, 80)
    square = load_sample(_row(tmp_path, 50, 50), tmp_path, 64)
    assert tuple(square["image"].shape) == (3, 64, 64)


def _config(tmp_path, **buckets):
    weights = build_demo_weights(tmp_path / "weights")
    return config_from_dict(
        {
            **demo_sections(weights),
            "data": {"base_path": str(tmp_path), "buckets": buckets},
            "cache": {"url": str(tmp_path / "cache")},
        }
    )


def test_bucket_settings_are_part_of_the_cache_key_but_the_tail_is_not(tmp_path):
    off = make_plan(_config(tmp_path)).cache_key
    assert make_plan(_config(tmp_path, step=16)).cache_key == off  # not enabled: square cache
    on = make_plan(_config(tmp_path, enabled=True, step=16)).cache_key
    assert on != off
    assert make_plan(_config(tmp_path, enabled=True, step=32)).cache_key not in (on, off)
    repeat = make_plan(_config(tmp_path, enabled=True, step=16, tail="repeat")).cache_key
    assert repeat == on


def test_buckets_the_family_cannot_take_are_refused_at_plan_time(tmp_path):
    with pytest.raises(ConfigError, match="data.buckets.step: 24 is not a multiple of 16"):
        make_plan(_config(tmp_path, enabled=True, step=24))


def test_sdxl_conditions_on_the_original_size_and_the_crop_of_its_bucket(tmp_path):
    from splitstage.data.images import center_crop_box
    from tests.helpers.tiny_diffusers import write_tiny_folder

    write_tiny_folder("sdxl", tmp_path / "sdxl")
    config = config_from_dict(
        {
            "pipeline": {"name": "sdxl", "pretrained": str(tmp_path / "sdxl"), "resolution": 64},
            "trainable": {"lora_base_model": "unet"},
            "data": {"base_path": str(tmp_path), "buckets": {"enabled": True, "step": 16}},
            "cache": {"url": str(tmp_path / "cache")},
        }
    )
    family = make_plan(config).family
    sample = family.load_sample(_row(tmp_path, 90, 200), tmp_path)
    height, width = family.buckets.size_for(90, 200)
    assert (sample["height"], sample["width"]) == (height, width) != (64, 64)
    assert tuple(sample["image"].shape) == (3, height, width)
    _, _, left, top = center_crop_box(200, 90, height, width)
    assert sample["original_size"] == [90, 200]
    assert sample["crop_top_left"] == [top, left] and left > 0
