"""Stable Diffusion 1.x / 2.x: CLIP prompt embeddings, a UNet, DDPM (epsilon or v-prediction)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch

from splitstage.pipelines.diffusers.base import DiffusersFamily
from splitstage.pipelines.diffusers.component_shapes import link
from splitstage.pipelines.diffusers.recipes import ddpm_draw, ddpm_scheduler
from splitstage.pipelines.diffusers.sampling import unet_sample
from splitstage.pipelines.diffusers.text import (
    clip_last,
    split_empty,
    token_ids,
    with_empty,
)
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import StepContext

UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' train_text_to_image_lora


class UNetFamily(DiffusersFamily):
    """A UNet trained with DDPM noise (SD and SDXL share the step)."""

    denoiser = "unet"
    default_lora_targets = UNET_LORA_TARGETS

    @cached_property
    def noise_scheduler(self):
        """DDPM from the folder's scheduler config."""
        return ddpm_scheduler(self.scheduler_config)

    def unet_kwargs(self, ctx: StepContext, inputs: dict[str, Any], dtype) -> dict[str, Any]:
        """Extra UNet inputs (SDXL's added conditions)."""
        return {}

    def sampling_kwargs(
        self, ctx: StepContext, text, count: int, dtype, size: tuple[int, int]
    ) -> dict[str, Any]:
        """Extra UNet inputs when sampling images of `size` (height, width) pixels (SDXL:
        pooled text and the size time ids)."""
        return {}

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """The folder's scheduler over the UNet, classifier-free guided."""
        size = self.sample_size(size)
        return unet_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Noise, timesteps, x_t; epsilon or velocity target; optional min-SNR weights."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = ddpm_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        args = (
            draw["latents"].to(dtype),
            draw["timestep"],
            inputs["prompt_embeds"].to(ctx.device, dtype),
        )
        kwargs = self.unet_kwargs(ctx, inputs, dtype)
        return TrainingStep(args, draw["target"], draw["weight"], kwargs)


class SDFamily(UNetFamily):
    """Stable Diffusion 1.x and 2.x."""

    name = "sd"
    default_guidance = 7.5
    model_names = ("text_encoder", "vae", "unet")
    pipeline_classes = ("StableDiffusionPipeline",)
    text_params = ("prompt_embeds",)
    text_models = ("text_encoder",)
    denoiser_params = ("prompt_embeds",)
    shape_links = (
        link(
            [("text_encoder", "hidden_size")],
            ("unet", "cross_attention_dim"),
            "the text encoder's hidden states",
        ),
        link([("vae", "latent_channels")], ("unet", "in_channels"), "the VAE's latents"),
    )

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """Embeddings [B, L, D] of each prompt and of the empty prompt."""
        encoder = ctx.model("text_encoder", "PromptEncoder")
        length = self.config.pipeline.max_prompt_length
        ids = token_ids(self.tokenizer("text_encoder"), with_empty(prompt), length, ctx.device)
        hidden, _ = clip_last(encoder, ids)
        return split_empty({"prompt_embeds": hidden}, len(prompt))
