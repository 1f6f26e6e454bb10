"""FLUX.1 Kontext: FLUX's models and flow matching, conditioned on each row's reference image.

As `FluxKontextPipeline` (diffusers 0.42) does: the reference is VAE-encoded to its mean, shifted
and scaled, packed 2x2, and its tokens follow the noisy latents' along the sequence, with image
ids whose first coordinate is 1; the prediction is cut back to the target's tokens. Stage 1
caches the reference latents beside the target's latent distribution and the prompt embeddings;
stage 2 never opens the reference image. A reference is cropped to its target's size (its
bucket), as diffusers' train_dreambooth_lora_flux_kontext.py resizes both images alike.
Validation prompts sample with `validation.reference_images` (the seam's default
`reference_conditioning` runs `ReferenceEncoder` on them in stage 1, cropped to the sample size)
through the pipeline's loop; without them, FLUX's sampler (FluxKontextPipeline with image=None).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitstage.data.dataset import Row
from splitstage.data.references import ReferenceImages, load_references
from splitstage.pipelines.diffusers.flux import FluxFamily
from splitstage.pipelines.diffusers.flux_kontext_sampling import kontext_sample, reference_ids
from splitstage.pipelines.diffusers.packing import image_ids, pack
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Unit


def encode_references(ctx: StepContext, reference_image: torch.Tensor) -> dict[str, Any]:
    """The reference images' latents as FluxKontextPipeline._encode_vae_image makes them: the
    VAE's mean ('argmax'), then (z - shift_factor) * scaling_factor."""
    vae = ctx.model("vae", "ReferenceEncoder")
    dtype = next(vae.parameters()).dtype
    mean = vae.encode(reference_image.to(ctx.device, dtype)).latent_dist.mode()
    config = vae.config
    shift = float(getattr(config, "shift_factor", 0.0) or 0.0)
    return {"reference_latents": (mean - shift) * float(config.scaling_factor)}


class FluxKontextFamily(FluxFamily):
    """FLUX.1 Kontext [dev] (FluxKontextPipeline folders): image editing from a reference."""

    name = "flux_kontext"
    lora_layout = "flux"  # Kontext's transformer has FLUX.1's module names: the same LoRA files
    pipeline_classes = ("FluxKontextPipeline",)
    denoiser_params = ("prompt_embeds", "pooled_prompt_embeds", "reference_latents")
    tasks = ("sft",)
    reference_images = ReferenceImages(required=True, most=1)

    def units(self) -> list[RunnableUnit]:
        """FLUX's units, and `ReferenceEncoder` (V2) after the VAE encoder."""
        units = super().units()
        encoder = RunnableUnit(
            Unit(
                "ReferenceEncoder",
                ("reference_image",),
                output_params=("reference_latents",),
                onload_model_names=("vae",),
            ),
            encode_references,
        )
        at = next(i for i, unit in enumerate(units) if unit.spec.name == "VAEEncoder") + 1
        return [*units[:at], encoder, *units[at:]]

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The image and prompt, and the row's reference image at the image's size."""
        sample = super().load_sample(row, base_path)
        target = (sample["height"], sample["width"])
        (reference,) = load_references(row, base_path, self.reference_images, target)
        return sample | {"reference_image": reference}

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """FLUX's flow matching on the packed noisy latents with the packed reference tokens
        after them (their ids' first coordinate 1); the target is the noisy tokens' only."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        reference = inputs["reference_latents"].to(ctx.device, torch.float32)
        prompt = inputs["prompt_embeds"].to(ctx.device, dtype)
        count = x0.shape[0]
        guidance = None
        if self.folder.config("transformer").get("guidance_embeds"):
            guidance = torch.full((count,), self.config.pipeline.guidance_scale, device=ctx.device)
        tokens = torch.cat([pack(draw["latents"]), pack(reference)], dim=1)
        kwargs = {
            "hidden_states": tokens.to(dtype),
            "timestep": (draw["timestep"] / 1000).to(dtype),
            "guidance": guidance,
            "pooled_projections": inputs["pooled_prompt_embeds"].to(ctx.device, dtype),
            "encoder_hidden_states": prompt,
            "txt_ids": torch.zeros(prompt.shape[1], 3, device=ctx.device, dtype=dtype),
            "img_ids": torch.cat([image_ids(x0), reference_ids(reference)]).to(dtype),
        }
        return TrainingStep((), pack(draw["target"]), draw["weight"], kwargs)

    def denoise(self, ctx: StepContext, step: TrainingStep) -> torch.Tensor:
        """The transformer's prediction for the noisy tokens (the reference's are cut off)."""
        return super().denoise(ctx, step)[:, : step.target.shape[1]]

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """With `reference_latents` in `cond`: FluxKontextPipeline's loop; without: FLUX's
        (what the pipeline does with image=None)."""
        if "reference_latents" not in cond:
            return super().sample(
                ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
            )
        size = self.sample_size(size)
        return kontext_sample(self, ctx, cond, generator, steps=steps, guidance=guidance, size=size)
