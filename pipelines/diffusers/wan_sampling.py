"""Wan's validation sampler: WanPipeline's loop (the folder's scheduler, UniPC on shifted flow
sigmas for Wan 2.1; classifier-free guidance) from the caller's seeded generator; given
`condition_latents` (and `image_embeds`), WanImageToVideoPipeline's: the condition after the
noisy latents on the channel dim and the image embeddings, for the prompt and the negative."""

from __future__ import annotations

import torch

from splitstage.pipelines.diffusers.wan_latents import latent_frames
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext


def folder_scheduler(config: dict):
    """The scheduler class and config of the pipeline folder (what WanPipeline samples with)."""
    import diffusers

    return getattr(diffusers, config["_class_name"]).from_config(config)


def wan_sample(
    family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size, frames
) -> torch.Tensor:
    """Latents [B, C, F', H/8, W/8] (normalised as trained) for each row of `cond` (prompt
    embeddings; for image-to-video `condition_latents` and optionally `image_embeds`), guided
    by `uncond`'s prompts when guidance > 1; `size` = (height, width) px, `frames` video frames
    (4k+1)."""
    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    scheduler = folder_scheduler(family.scheduler_config)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["z_dim"])
    shape = (count, channels, latent_frames(frames), size[0] // 8, size[1] // 8)
    x = torch.randn(shape, generator=generator).to(ctx.device)
    scheduler.set_timesteps(steps, device=ctx.device)
    scheduler.set_begin_index(0)

    condition = cond.get("condition_latents")  # image-to-video: after the noisy latents
    image = cond.get("image_embeds")  # Wan 2.1 I2V: the first frame's, for cond and uncond
    extra = {} if image is None else {"encoder_hidden_states_image": image.to(ctx.device, dtype)}

    def velocity(latents: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        hidden = latents.to(dtype)
        if condition is not None:
            hidden = torch.cat([hidden, condition.to(ctx.device, dtype)], dim=1)
        return model(
            hidden_states=hidden,
            timestep=t.expand(count),
            encoder_hidden_states=text["prompt_embeds"].to(ctx.device, dtype),
            return_dict=False,
            **extra,
        )[0].float()

    for t in scheduler.timesteps:
        v = velocity(x, t, cond)
        if guidance > 1:
            unguided = velocity(x, t, uncond)
            v = unguided + guidance * (v - unguided)
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return x
