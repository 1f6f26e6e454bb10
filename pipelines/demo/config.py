"""The demo family's `[pipeline]` group (torch-free)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import field_validator

from splitstage.config.pipeline_group import PipelineConfig, setting


class DemoPipelineConfig(PipelineConfig):
    """The demo text-to-image pipeline: square images, MiniLM prompts, a DiT denoiser."""

    family_class: ClassVar[str] = "splitstage.pipelines.demo.family:DemoFamily"

    name: Literal["demo"] = "demo"
    image_size: int = setting(
        64, stage1=True, ge=16, le=4096, description="Images are resized to this square."
    )
    max_prompt_length: int = setting(16, stage1=True, ge=1, le=512, description="Prompt tokens.")
    caption_dropout: float = setting(
        0.1,
        stage1=False,
        ge=0.0,
        le=1.0,
        description="Per-step chance to swap in the empty-prompt embedding.",
    )

    @field_validator("image_size")
    @classmethod
    def _multiple_of_16(cls, value: int) -> int:
        if value % 16:
            raise ValueError(f"must be a multiple of 16 (VAE x8, patch x2), got {value}")
        return value
