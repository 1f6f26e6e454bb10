"""FLUX.2's validation sampler, as Flux2Pipeline samples: packed noise, FlowMatchEuler on sigmas
1 .. 1/steps shifted by the pipeline's empirical mu, the guidance told to the model (guidance
distilled: one call per step). Every random draw comes from the caller's seeded generator."""

from __future__ import annotations

import numpy as np
import torch

from splitstage.pipelines.diffusers.flux2_latents import latent_ids, pack
from splitstage.pipelines.diffusers.flux2_text import text_ids
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext


def flux2_sample(
    family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size
) -> torch.Tensor:
    """Latents [B, 4C, H/16, W/16] (patched and normalised as trained) for each row of `cond`;
    `size` = (height, width) pixels; `uncond` unused (guidance is embedded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(family.scheduler_config)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.folder.config("transformer")["in_channels"])
    height, width = size[0] // 16, size[1] // 16
    noise = torch.randn(count, channels, height, width, generator=generator).to(ctx.device)
    ids = latent_ids(noise)
    x = pack(noise)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = compute_empirical_mu(image_seq_len=x.shape[1], num_steps=steps)
    scheduler.set_timesteps(steps, ctx.device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    text = cond["prompt_embeds"].to(ctx.device, dtype)
    embedded = torch.full((count,), float(guidance), device=ctx.device)
    for t in scheduler.timesteps:
        v = model(
            hidden_states=x.to(dtype),
            timestep=t.expand(count).to(x.dtype) / 1000,
            guidance=embedded,
            encoder_hidden_states=text,
            txt_ids=text_ids(text),
            img_ids=ids,
            return_dict=False,
        )[0][:, : x.shape[1]]
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return Flux2Pipeline._unpack_latents_with_ids(x, ids)
