"""`[data.buckets]`: the aspect-ratio bucket settings (torch-free); `data.buckets` sizes them."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from splitstage.config.base_group import Group

TAILS = ("drop", "repeat")


def pillow_limit() -> int | None:
    """Pillow's decompression-bomb limit in pixels as this process has it (None: switched off):
    it also refuses to crop an image to a bucket larger than that."""
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS


class BucketConfig(Group):
    """`[data.buckets]`: keep aspect ratios by training each image at its nearest bucket size."""

    enabled: bool = Field(False, description="Off: every image is center-cropped to a square.")
    area: int | None = Field(
        None, ge=64, description="Target pixels per image; default: the family's resolution^2."
    )
    step: int = Field(64, ge=8, le=1024, description="Bucket sides are multiples of this.")
    min_side: int | None = Field(None, ge=8, description="Smallest side; default: step.")
    max_side: int | None = Field(None, ge=8, description="Largest side; default: 4 x sqrt(area).")
    max_aspect: float = Field(4.0, ge=1.0, le=16.0, description="Longest / shortest side bound.")
    tail: Literal["drop", "repeat"] = Field(
        "drop",
        description="Stage 2: a bucket's last partial global batch is dropped this epoch "
        "(different samples each epoch) or filled by repeating that bucket's first samples.",
    )

    @field_validator("area")
    @classmethod
    def _area(cls, area: int | None) -> int | None:
        limit = pillow_limit()
        if area is not None and limit and area > limit:
            raise ValueError(
                f"{area:,} pixels per bucket image is over Pillow's limit of {limit:,} "
                "(PIL.Image.MAX_IMAGE_PIXELS, a decompression-bomb guard), so no image could be "
                f"cropped to a bucket; use an area <= {limit:,} (e.g. {1024 * 1024} for 1024x1024)"
            )
        return area

    @model_validator(mode="after")
    def _sides(self) -> BucketConfig:
        if self.min_side is not None and self.min_side % self.step:
            raise ValueError(f"min_side {self.min_side} is not a multiple of step {self.step}")
        if self.max_side is not None and self.max_side % self.step:
            raise ValueError(f"max_side {self.max_side} is not a multiple of step {self.step}")
        if self.min_side and self.max_side and self.min_side > self.max_side:
            raise ValueError(f"min_side {self.min_side} is larger than max_side {self.max_side}")
        limit = pillow_limit()
        if limit and self.min_side and self.min_side**2 > limit:
            raise ValueError(
                f"min_side {self.min_side}: a bucket with both sides >= {self.min_side} is over "
                f"Pillow's limit of {limit:,} pixels (PIL.Image.MAX_IMAGE_PIXELS); use min_side "
                f"<= {math.isqrt(limit) // self.step * self.step}"
            )
        longest = math.isqrt(int(limit * self.max_aspect)) if limit else None
        if longest and self.max_side and self.max_side > longest:
            raise ValueError(
                f"max_side {self.max_side}: no bucket reaches it (one within Pillow's limit of "
                f"{limit:,} pixels and max_aspect {self.max_aspect:g} has sides <= {longest:,}); "
                f"use max_side <= {longest // self.step * self.step} or leave it out"
            )
        return self

    def stage1_settings(self) -> dict | None:
        """What the cache key takes (None when buckets are off, so square caches keep keys)."""
        if not self.enabled:
            return None
        return self.model_dump(exclude={"enabled", "tail"})
