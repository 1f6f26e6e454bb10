"""Stable Diffusion 3 / 3.5: CLIP-L + CLIP-G (+ T5) prompts, an MMDiT, flow matching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from splitstage.pipelines.diffusers.component_shapes import link
from splitstage.pipelines.diffusers.mmdit import FlowTransformerFamily
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.diffusers.sampling import sd3_sample
from splitstage.pipelines.diffusers.text import (
    CLIP_LENGTH,
    clip_penultimate,
    split_empty,
    t5_hidden,
    token_ids,
    with_empty,
)
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import StepContext

CLIPS = ("text_encoder", "text_encoder_2")


class SD3Family(FlowTransformerFamily):
    """Stable Diffusion 3 and 3.5."""

    name = "sd3"
    default_guidance = 7.0
    model_names = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer")
    pipeline_classes = ("StableDiffusion3Pipeline",)
    text_params = ("prompt_embeds", "pooled_prompt_embeds")
    text_models = (*CLIPS, "text_encoder_3")
    denoiser_params = ("prompt_embeds", "pooled_prompt_embeds")
    shape_links = (
        link(
            [("text_encoder_3", "d_model")],
            ("transformer", "joint_attention_dim"),
            "T5's hidden states (the CLIPs' are padded to them)",
        ),
        link(
            [("text_encoder", "hidden_size"), ("text_encoder_2", "hidden_size")],
            ("transformer", "joint_attention_dim"),
            "both CLIPs' hidden states, concatenated and padded to T5's width",
            at_most=True,
        ),
        link(
            [("text_encoder", "projection_dim"), ("text_encoder_2", "projection_dim")],
            ("transformer", "pooled_projection_dim"),
            "both CLIPs' pooled embeddings, concatenated",
        ),
        link([("vae", "latent_channels")], ("transformer", "in_channels"), "the VAE's latents"),
    )

    def prompt_encoders(self) -> tuple[str, ...]:
        """CLIP-L, CLIP-G, and T5 only when pipeline.use_t5."""
        return self.text_models if self.config.pipeline.use_t5 else CLIPS

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """What StableDiffusion3Pipeline.encode_prompt computes, for the prompts and ''."""
        texts = with_empty(prompt)
        states, pooled = [], []
        for name in CLIPS:
            ids = token_ids(self.tokenizer(name), texts, CLIP_LENGTH, ctx.device)
            hidden, pool = clip_penultimate(ctx.model(name, "PromptEncoder"), ids)
            states.append(hidden)
            pooled.append(pool)
        clip = torch.cat(states, dim=-1)
        width = self.folder.config("transformer")["joint_attention_dim"]
        length = self.config.pipeline.max_prompt_length
        if self.config.pipeline.use_t5:
            ids = token_ids(self.tokenizer("text_encoder_3"), texts, length, ctx.device)
            t5 = t5_hidden(ctx.model("text_encoder_3", "PromptEncoder"), ids).to(clip.dtype)
        else:
            t5 = torch.zeros(len(texts), length, width, device=clip.device, dtype=clip.dtype)
        embeds = torch.cat([F.pad(clip, (0, t5.shape[-1] - clip.shape[-1])), t5], dim=-2)
        values = {"prompt_embeds": embeds, "pooled_prompt_embeds": torch.cat(pooled, dim=-1)}
        return split_empty(values, len(prompt))

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """x_t = (1 - sigma) x0 + sigma noise; target noise - x0 (diffusers' SD3 recipe)."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        kwargs = {
            "hidden_states": draw["latents"].to(dtype),
            "timestep": draw["timestep"].to(dtype),
            "encoder_hidden_states": inputs["prompt_embeds"].to(ctx.device, dtype),
            "pooled_projections": inputs["pooled_prompt_embeds"].to(ctx.device, dtype),
        }
        return TrainingStep((), draw["target"], draw["weight"], kwargs)

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """Flow-matching Euler with the scheduler's shift, classifier-free guided."""
        size = self.sample_size(size)
        return sd3_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )
