"""FLUX.1: CLIP pooled + T5 prompts, packed 2x2 latents with image ids, guidance, flow matching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import StepContext


class FluxFamily(FlowTransformerFamily):
    """FLUX.1 dev / schnell (and other FluxPipeline folders)."""

    name = "flux"
    default_guidance = 3.5  # what the guidance embedding is told (FLUX.1-dev is distilled)
    model_names = ("text_encoder", "text_encoder_2", "vae", "transformer")
    pipeline_classes = ("FluxPipeline",)
    text_params = ("prompt_embeds", "pooled_prompt_embeds")
    text_models = ("text_encoder", "text_encoder_2")
    denoiser_params = ("prompt_embeds", "pooled_prompt_embeds")

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
