"""Z-Image's validation sampler, as ZImagePipeline samples: FlowMatchEuler on sigmas 1 .. 1/steps
(shift from the scheduler config), the transformer's output negated, guidance as the pipeline's
pos + g (pos - neg). Every random draw comes from the caller's seeded generator."""

from __future__ import annotations

import torch

from splitstage.pipelines.diffusers.zimage_text import unpadded
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext


def velocity(model, latents: torch.Tensor, sigma_t: torch.Tensor, text: list[torch.Tensor]):
    """The pipeline's noise prediction for latents [B, C, H, W] at normalised time
    sigma_t = (1000 - t) / 1000: the transformer's per-sample outputs, negated, float32."""
    dtype = input_dtype(model)
    frames = list(latents.to(dtype).unsqueeze(2).unbind(0))
    out = model(frames, sigma_t.float(), [t.to(dtype) for t in text], return_dict=False)[0]
    return -torch.stack([o.float() for o in out]).squeeze(2)


def zimage_sample(
    family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size
) -> torch.Tensor:
    """Latents [B, 16, H/8, W/8] (scaled and shifted as trained) for each row of `cond`; guided
    by `uncond` when guidance > 0 (the pipeline's guidance_scale); `size` = (height, width)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    model = ctx.model(family.denoiser, "sample")
    config = family.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.folder.config("transformer")["in_channels"])
    height, width = size[0] // 8, size[1] // 8
    x = torch.randn(count, channels, height, width, generator=generator).to(ctx.device)
    mu = calculate_shift(
        (height // 2) * (width // 2),
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    sigmas = torch.linspace(1.0, 1 / steps, steps).tolist()
    scheduler.set_timesteps(steps, ctx.device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    positive = unpadded(cond["prompt_embeds"], cond["prompt_embeds_mask"])
    negative = unpadded(uncond["prompt_embeds"], uncond["prompt_embeds_mask"]) if guidance else []
    for t in scheduler.timesteps:
        sigma_t = (1000 - t.expand(count)) / 1000
        v = velocity(model, x, sigma_t, positive)
        if guidance > 0:
            v = v + guidance * (v - velocity(model, x, sigma_t, negative))
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return x
