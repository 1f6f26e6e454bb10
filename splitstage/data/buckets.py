"""Aspect-ratio buckets: the bucket sizes of a job and which bucket a source image goes to.

As kohya's and SimpleTuner's buckets do: a list of (height, width) sizes of about the same area
(`area`, default the family's square resolution squared), both sides multiples of `step` within
`min_side`..`max_side` and no more elongated than `max_aspect`; an image goes to the bucket whose
aspect ratio is nearest its own (in log space), is scaled to cover it and center-cropped. The
settings that change stage-1 outputs are part of the cache key; `tail` is a stage-2 setting.
Torch-free.
"""

from __future__ import annotations

import math
from functools import cached_property

from splitstage.config.bucket_settings import BucketConfig


class BucketError(ValueError):
    """Bucket settings that give no usable bucket for the family."""


class Buckets:
    """The bucket sizes for one job and the assignment of source sizes to them."""

    def __init__(self, config: BucketConfig, resolution: int, multiple: int):
        if config.step % multiple:
            raise BucketError(
                f"data.buckets.step: {config.step} is not a multiple of {multiple}, which this "
                f"family's image sides must be; use {-(-config.step // multiple) * multiple}"
            )
        self.config = config
        self.area = config.area or resolution * resolution
        self.min_side = config.min_side or config.step
        self.max_side = config.max_side or _round_down(4 * math.isqrt(self.area), config.step)
        if not self.sizes:
            raise BucketError(
                f"data.buckets: no bucket of about {self.area} pixels has both sides in "
                f"{self.min_side}..{self.max_side} (multiples of {config.step}) and aspect <= "
                f"{config.max_aspect}; widen min_side/max_side or lower step"
            )

    @cached_property
    def sizes(self) -> list[tuple[int, int]]:
        """Every bucket (height, width), sorted by aspect ratio (height / width) then area."""
        step, found = self.config.step, set()
        for width in range(self.min_side, self.max_side + 1, step):
            height = min(self.max_side, _round_down(self.area // width, step))
            for h, w in ((height, width), (width, height)):
                if min(h, w) >= self.min_side and max(h, w) / min(h, w) <= self.config.max_aspect:
                    found.add((h, w))
        return sorted(found, key=lambda hw: (hw[0] / hw[1], -hw[0] * hw[1]))

    def size_for(self, source_height: int, source_width: int) -> tuple[int, int]:
        """The bucket (height, width) of a source image: nearest aspect ratio, then larger area."""
        if source_height < 1 or source_width < 1:
            raise ValueError(f"image size {source_height}x{source_width} has no aspect ratio")
        target = math.log(source_height / source_width)
        return min(
            self.sizes, key=lambda hw: (abs(math.log(hw[0] / hw[1]) - target), -hw[0] * hw[1])
        )


def _round_down(value: int, step: int) -> int:
    return value // step * step


def label(height: int, width: int) -> str:
    """'768x512' (height x width), how buckets are named in logs and stats."""
    return f"{height}x{width}"
