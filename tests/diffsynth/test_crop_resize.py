"""Stage 1's crop-and-resize is pixel for pixel DiffSynth's and diffusers' examples' (torchvision
on PIL images, bilinear, center crop), on sizes that round and crop differently."""

from __future__ import annotations

import numpy as np
import pytest
from diffsynth.core.data.operators import ImageCropAndResize
from PIL import Image
from torchvision import transforms

from splitstage.data.images import center_crop_resize

SOURCES = [(101, 75), (75, 101), (97, 64), (33, 200), (64, 64), (17, 19)]


def image(width: int, height: int) -> Image.Image:
    """A seeded noise image (edges everywhere: any filter or offset difference shows)."""
    pixels = np.random.default_rng(width * 1000 + height).integers(0, 256, (height, width, 3))
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("target", [(32, 32), (48, 32), (32, 64)])
def test_diffsynth_rule_equals_image_crop_and_resize(source, target):
    height, width = target
    theirs = ImageCropAndResize(height=height, width=width)(image(*source))
    ours = center_crop_resize(image(*source), height, width, "diffsynth")
    assert ours.size == theirs.size == (width, height)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs)), (source, target)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("resolution", [32, 48])
def test_diffusers_rule_equals_the_examples_resize_and_center_crop(source, resolution):
    examples = transforms.Compose(
        [
            transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(resolution),
        ]
    )
    theirs = examples(image(*source))
    ours = center_crop_resize(image(*source), resolution, resolution)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs)), (source, resolution)


def test_the_rules_differ_where_diffsynth_rounds_and_diffusers_truncates():
    """200 x 33 -> 32: DiffSynth scales to 194 x 32 (round), torchvision's Resize(32) to 193 x 32
    (int): one rule per family, not one for both."""
    a = np.asarray(center_crop_resize(image(200, 33), 32, 32, "diffsynth"))
    b = np.asarray(center_crop_resize(image(200, 33), 32, 32, "diffusers"))
    assert not np.array_equal(a, b)
