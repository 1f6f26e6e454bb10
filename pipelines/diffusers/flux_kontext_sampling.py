"""FLUX.1 Kontext's sampler: FluxKontextPipeline's denoising loop with reference latents.

The packed reference tokens follow the noisy tokens at every step, with their own image ids
(first coordinate 1), and each prediction is cut back to the noisy tokens before the scheduler
step; the shift is computed from the noisy tokens alone, as the pipeline computes it.
"""

from __future__ import annotations

import numpy as np
import torch

from splitstage.pipelines.diffusers.packing import image_ids, pack
from splitstage.pipelines.diffusers.sampling import latent_shape, vae_scale
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext


def reference_ids(latents: torch.Tensor) -> torch.Tensor:
    """Position ids of the packed reference tokens: the target's layout with the first
    coordinate 1 instead of 0 (FluxKontextPipeline.prepare_latents)."""
    ids = image_ids(latents)
    ids[..., 0] = 1
    return ids


def kontext_sample(family, ctx: StepContext, cond, generator, *, steps, guidance, size):
    """Latents [B, C, h, w] of images `size` (height, width) for each row of `cond` (prompt
    embeddings and `reference_latents` [B, C, h', w']), from the generator's noise."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["latent_channels"])
    height, width = latent_shape(family, size)
    noise = torch.randn(count, channels, height, width, generator=generator).to(ctx.device)
    config = family.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = calculate_shift(
        (height // 2) * (width // 2),
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    sigmas = np.linspace(1.0, 1 / steps, steps)
    shift = {"mu": mu} if config.get("use_dynamic_shifting") else {}
    scheduler.set_timesteps(sigmas=sigmas, **shift)
    reference = cond["reference_latents"].to(ctx.device, torch.float32)
    ref_tokens = pack(reference).to(dtype)
    ids = torch.cat([image_ids(noise), reference_ids(reference)]).to(dtype)
    text = cond["prompt_embeds"].to(ctx.device, dtype)
    embedded = None
    if family.folder.config("transformer").get("guidance_embeds"):
        embedded = torch.full((count,), float(guidance), device=ctx.device)
    x = pack(noise)
    for t in scheduler.timesteps:
        v = model(
            hidden_states=torch.cat([x.to(dtype), ref_tokens], dim=1),
            timestep=(t.expand(count) / 1000).to(ctx.device, dtype),
            guidance=embedded,
            pooled_projections=cond["pooled_prompt_embeds"].to(ctx.device, dtype),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=ctx.device, dtype=dtype),
            img_ids=ids,
            return_dict=False,
        )[0][:, : x.shape[1]].float()
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return FluxPipeline._unpack_latents(x, size[0], size[1], vae_scale(family))
