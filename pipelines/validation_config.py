"""What a run shows while it trains: `[validation]` samples and `[tracking]` (trackers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from splitstage.pipelines.config_base import Group


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
        return self

    @property
    def enabled(self) -> bool:
        """Whether the run samples at all."""
        return bool(self.prompts)

    def negatives(self) -> list[str]:
        """The negative prompt of each prompt ("" where none is given)."""
        return list(self.negative_prompts or [""] * len(self.prompts))


class TrackingConfig(Group):
    """Experiment trackers (accelerate's integrations): loss, learning rate, throughput, grids."""

    report_to: Literal["auto", "none"] | list[Literal["tensorboard", "wandb"]] = Field(
        "auto",
        description="'auto': TensorBoard when installed, plus Weights & Biases when configured "
        "(WANDB_API_KEY or WANDB_MODE set); 'none'; or a list (each must be installed).",
    )
    project: str | None = Field(None, description="Tracker project name; default: job.name.")
