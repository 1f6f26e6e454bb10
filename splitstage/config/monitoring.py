"""What a run shows while it trains: `[validation]` samples and `[tracking]` (trackers)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from splitstage.config.base_group import Group

_SIZE = re.compile(r"\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*", re.ASCII)
MAX_SIDE = 4096  # pixels; larger validation samples are almost surely a typo (or out of memory)


def parse_size(text: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' pixels (as SimpleTuner and kohya write sizes) -> (height, width), as
    tensors and `[data.buckets]` order them; ValueError naming what to write instead."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT in pixels; write e.g. '768x512'")
    size = int(match[2]), int(match[1])
    if min(size) < 1 or max(size) > MAX_SIDE:
        raise ValueError(f"{text!r}: each side must be 1..{MAX_SIDE} pixels")
    return size


def size_label(height: int, width: int) -> str:
    """'WIDTHxHEIGHT', how `validation.sizes` writes a size (grid file names, tracker tags)."""
    return f"{width}x{height}"


class ValidationConfig(Group):
    """Sample images for fixed prompts every N updates (and at the end) while training."""

    prompts: list[str] = Field(
        default_factory=list, max_length=64, description="Prompts to sample; empty: no sampling."
    )
    negative_prompts: list[str] | None = Field(
        None, description="One per prompt (classifier-free guidance); default: the empty prompt."
    )
    seed: int = Field(0, ge=0, lt=2**63, description="Sampling noise seed (same images per run).")
    steps: int = Field(20, ge=1, le=1000, description="Sampling steps.")
    guidance_scale: float | None = Field(
        None, ge=0.0, le=100.0, description="Guidance; default: the family's usual value."
    )
    images_per_prompt: int = Field(1, ge=1, le=16)
    every: int = Field(0, ge=0, description="Sample every N updates (0: only at the end).")
    sizes: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Sizes to sample at, 'WIDTHxHEIGHT' pixels (e.g. ['768x512', '512x768']): "
        "every prompt at every size, one grid per size; empty: the family's square resolution.",
    )
    reference_images: list[str | list[str]] | None = Field(
        None,
        description="The reference image of each prompt, for families that edit one (e.g. "
        "flux_kontext): a path relative to data.base_path or a URL, one per prompt, or a list "
        "per prompt for families taking several; cropped to each sample size as training "
        "crops them to the target's.",
    )

    @field_validator("sizes", mode="before")
    @classmethod
    def _sizes_split(cls, sizes):
        # SimpleTuner writes one string: validation_resolution = "1024x1024,1280x768".
        return (
            [part for part in sizes.split(",") if part.strip()] if isinstance(sizes, str) else sizes
        )

    @field_validator("sizes")
    @classmethod
    def _sizes_parse(cls, sizes: list[str]) -> list[str]:
        seen: dict[tuple[int, int], str] = {}
        for text in sizes:
            size = parse_size(text)
            if size in seen:
                raise ValueError(f"{text!r} is listed twice (as {seen[size]!r}); remove one")
            seen[size] = text
        return [size_label(*size) for size in seen]  # normalized: '768X512 ' -> '768x512'

    @model_validator(mode="after")
    def _negatives_match(self) -> ValidationConfig:
        negatives = self.negative_prompts
        if negatives is not None and len(negatives) != len(self.prompts):
            raise ValueError(
                f"negative_prompts has {len(negatives)} entries for {len(self.prompts)} prompts; "
                'give one per prompt ("" for none) or leave it out'
            )
        if any(not p.strip() for p in self.prompts):
            raise ValueError("prompts: an empty prompt samples nothing useful; remove it")
        references = self.reference_images
        if references is not None and len(references) != len(self.prompts):
            raise ValueError(
                f"reference_images has {len(references)} entries for {len(self.prompts)} "
                "prompts; give one per prompt (a path, or a list of paths) or leave it out"
            )
        for index, paths in enumerate(self.references()):
            if not paths or any(not path.strip() for path in paths):
                raise ValueError(
                    f"reference_images[{index}] names no file; give a path relative to "
                    "data.base_path or a URL"
                )
        return self

    @property
    def enabled(self) -> bool:
        """Whether the run samples at all."""
        return bool(self.prompts)

    def sample_sizes(self) -> list[tuple[int, int]]:
        """The `sizes` as (height, width) pixels, in the order given."""
        return [parse_size(text) for text in self.sizes]

    def references(self) -> list[list[str]]:
        """Each prompt's reference image paths (a list per prompt; empty when none are given)."""
        given = self.reference_images or []
        return [[paths] if isinstance(paths, str) else list(paths) for paths in given]

    def negatives(self) -> list[str]:
        """The negative prompt of each prompt ("" where none is given)."""
        return list(self.negative_prompts or [""] * len(self.prompts))


TRACKERS = ("tensorboard", "wandb")  # the trackers report_to may name


class TrackingConfig(Group):
    """Experiment trackers (accelerate's integrations): loss, learning rate, throughput, grids."""

    report_to: Literal["auto", "none"] | list[Literal["tensorboard", "wandb"]] = Field(
        "auto",
        description="'auto': TensorBoard when installed, plus Weights & Biases when configured "
        "(WANDB_API_KEY or WANDB_MODE set); 'none'; or trackers, a list or one name as accelerate "
        "writes it ('tensorboard'; each must be installed).",
    )
    project: str | None = Field(None, description="Tracker project name; default: job.name.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_names(cls, value):
        # accelerate's spelling: report_to = "tensorboard" (one name), or "tensorboard,wandb".
        names = [part.strip() for part in value.split(",")] if isinstance(value, str) else value
        choices = f"write 'auto', 'none', or trackers from {', '.join(TRACKERS)}"
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{value!r} is not a tracker name or a list of them; {choices}")
        if len(names) == 1 and names[0] in ("auto", "none"):
            return names[0]
        if "all" in names:  # accelerate's 'all' starts every installed tracker, wandb unasked
            raise ValueError(f"'all' is accelerate's, not taken here; {choices}")
        unknown = [n for n in names if n not in TRACKERS]
        if unknown:
            raise ValueError(
                f"unknown tracker {', '.join(map(repr, unknown))}; {choices} "
                "(e.g. report_to = 'tensorboard')"
            )
        return names
