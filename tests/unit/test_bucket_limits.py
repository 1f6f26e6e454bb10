"""Bucket settings past what Pillow can crop are refused when the config is read (`validate`),
in one line naming the field and the limit, not by Pillow's DecompressionBombError in stage 1."""

from __future__ import annotations

import pytest
from PIL import Image
from pydantic import ValidationError

from splitstage.config.bucket_settings import BucketConfig
from tests.helpers.catalogue import assets, check_one_line, cli, job  # noqa: F401


def test_an_area_over_pillows_limit_is_refused_by_validate(assets, tmp_path, capsys):  # noqa: F811
    path = job(assets, tmp_path, data__buckets="enabled = true\narea = 400000000")
    code, err = cli(["validate", path], capsys)
    check_one_line(
        code,
        err,
        "data.buckets.area: 400,000,000 pixels per bucket image",
        f"Pillow's limit of {Image.MAX_IMAGE_PIXELS:,}",
        "use an area <=",
    )


def test_the_limit_is_pillows_own(monkeypatch):
    assert BucketConfig(area=Image.MAX_IMAGE_PIXELS).area == Image.MAX_IMAGE_PIXELS
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000_000)
    with pytest.raises(ValidationError, match="over Pillow's limit of 1,000,000"):
        BucketConfig(area=1_000_001)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # switched off by the user
    assert BucketConfig(area=400_000_000).area == 400_000_000


def test_sides_no_bucket_within_pillows_limit_can_have_are_refused(assets, tmp_path, capsys):  # noqa: F811
    wide = job(assets, tmp_path, data__buckets="enabled = true\nmax_side = 64000000")
    code, err = cli(["validate", wide], capsys)
    check_one_line(code, err, "max_side 64000000: no bucket reaches it", "max_side <= 18880")
    tall = job(assets, tmp_path, data__buckets="enabled = true\nmin_side = 12800")
    code, err = cli(["validate", tall], capsys)
    check_one_line(code, err, "min_side 12800", "use min_side <= 9408")
    # the bounds are exact: the largest sides named are accepted
    assert BucketConfig(max_side=18880).max_side == 18880
    assert BucketConfig(min_side=9408).min_side == 9408
