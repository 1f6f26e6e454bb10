"""A tiny second pipeline family, defined only in the tests: the proof that the seam is real.

It shares nothing with the demo: grayscale images, a fixed average-pool encoder, a hashed-label
"text" unit without a model, an MLP denoiser trained with DDPM-style epsilon prediction. It is
found the way a third-party family would be: through the `splitstage.families` entry point of the
`.dist-info` folder beside it (put this folder on PYTHONPATH). This module is torch-free.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from splitstage.config.pipeline_group import PipelineConfig, setting


class TinyPipelineConfig(PipelineConfig):
    """Tiny grayscale images, label conditioning, epsilon prediction."""

    family_class: ClassVar[str] = "splitstage_tiny_family.family:TinyFamily"

    name: Literal["tiny"] = "tiny"
    image_size: int = setting(16, stage1=True, ge=8, le=64, description="Square side, pixels.")
    labels: int = setting(32, stage1=True, ge=2, le=4096, description="Hashed prompt labels.")
    noise_steps: int = setting(50, stage1=False, ge=2, le=1000, description="DDPM steps.")
