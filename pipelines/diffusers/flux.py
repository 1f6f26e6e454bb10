"""FLUX.1: CLIP pooled + T5 prompts, packed 2x2 latents with image ids, guidance, flow matching.

It also trains `train.task = "direct_distill"` (see flux_distill.py): the rows' seeded noise is
cached in stage 1, stage 2 runs the few-step sampling loop with gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.data.dataset import Row
from splitstage.pipelines.diffusers.component_shapes import Width, link
from splitstage.pipelines.diffusers.flux_distill import (
    LOSS_PARAMS,
    STEP_PARAMS,
    distill_loss,
    noise_unit,
)
from splitstage.pipelines.diffusers.mmdit import FlowTransformerFamily
from splitstage.pipelines.diffusers.packing import image_ids, pack
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.diffusers.sampling import flux_sample
from splitstage.pipelines.diffusers.text import (
    CLIP_LENGTH,
    clip_last,
    split_empty,
    t5_hidden,
    token_ids,
    with_empty,
)
from splitstage.pipelines.distill_rows import distill_values
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Pipeline


class FluxFamily(FlowTransformerFamily):
    """FLUX.1 dev / schnell (and other FluxPipeline folders)."""

    name = "flux"
    default_guidance = 3.5  # what the guidance embedding is told (FLUX.1-dev is distilled)
    model_names = ("text_encoder", "text_encoder_2", "vae", "transformer")
    pipeline_classes = ("FluxPipeline",)
    text_params = ("prompt_embeds", "pooled_prompt_embeds")
    text_models = ("text_encoder", "text_encoder_2")
    shape_links = (
        link(
            [("text_encoder_2", "d_model")],
            ("transformer", "joint_attention_dim"),
            "T5's hidden states",
        ),
        link(
            [("text_encoder", "hidden_size")],
            ("transformer", "pooled_projection_dim"),
            "CLIP's pooled output",
        ),
        link(
            [Width("vae", "latent_channels", 4)],
            ("transformer", "in_channels"),
            "the VAE's latents packed in 2x2 patches",
        ),
    )
    denoiser_params = ("prompt_embeds", "pooled_prompt_embeds")
    tasks = ("sft", "direct_distill")

    @property
    def distilling(self) -> bool:
        """Whether the job trains direct distillation rather than the flow-matching loss."""
        return self.config.train.task == "direct_distill"

    def stage1_settings(self) -> dict[str, Any]:
        """The pipeline's stage-1 settings, and the task when the cache holds seeded noise."""
        task = {"task": "direct_distill"} if self.distilling else {}
        return super().stage1_settings() | task

    def units(self) -> list[RunnableUnit]:
        """The shared units; direct distillation adds the row-seeded noise (V2) after them."""
        return [*super().units(), noise_unit()] if self.distilling else super().units()

    def pipeline_spec(self) -> Pipeline:
        """Direct distillation's loss reads the cached noise and the row's steps / cfg_scale."""
        spec = super().pipeline_spec()
        if not self.distilling:
            return spec
        return replace(spec, loss_params=LOSS_PARAMS, step_params=STEP_PARAMS)

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The image and prompt; direct distillation also the row's teacher settings."""
        sample = super().load_sample(row, base_path)
        return sample | distill_values(row) if self.distilling else sample

    def training_loss(self, ctx: StepContext, inputs: dict[str, Any]) -> torch.Tensor:
        """Flow matching, or direct distillation's few-step loop with gradients."""
        if self.distilling:
            return distill_loss(self, ctx, inputs)
        return super().training_loss(ctx, inputs)

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """T5 states [B, L, D] and CLIP pooled [B, P] of the prompts and of ''."""
        texts = with_empty(prompt)
        ids = token_ids(self.tokenizer("text_encoder"), texts, CLIP_LENGTH, ctx.device)
        _, pooled = clip_last(ctx.model("text_encoder", "PromptEncoder"), ids)
        length = self.config.pipeline.max_prompt_length
        ids = token_ids(self.tokenizer("text_encoder_2"), texts, length, ctx.device)
        states = t5_hidden(ctx.model("text_encoder_2", "PromptEncoder"), ids)
        return split_empty({"prompt_embeds": states, "pooled_prompt_embeds": pooled}, len(prompt))

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Flow matching on packed latents; timesteps / 1000; guidance when the model has it."""
        if self.distilling:
            raise ConfigError(
                "train.task='direct_distill': the flux family trains it through its whole "
                "sampling loop; use train.parallelism 'ddp', 'fsdp' or 'tp'"
            )
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        prompt = inputs["prompt_embeds"].to(ctx.device, dtype)
        count = x0.shape[0]
        guidance = None
        if self.folder.config("transformer").get("guidance_embeds"):
            guidance = torch.full((count,), self.config.pipeline.guidance_scale, device=ctx.device)
        kwargs = {
            "hidden_states": pack(draw["latents"]).to(dtype),
            "timestep": (draw["timestep"] / 1000).to(dtype),
            "guidance": guidance,
            "pooled_projections": inputs["pooled_prompt_embeds"].to(ctx.device, dtype),
            "encoder_hidden_states": prompt,
            "txt_ids": torch.zeros(prompt.shape[1], 3, device=ctx.device, dtype=dtype),
            "img_ids": image_ids(x0).to(dtype),
        }
        return TrainingStep((), pack(draw["target"]), draw["weight"], kwargs)

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """Flow-matching Euler, shifted for the image size; guidance goes to the model."""
        size = self.sample_size(size)
        return flux_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )
