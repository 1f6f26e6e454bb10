"""Wan's validation sampler and clip files: WanPipeline's loop (the folder's scheduler, UniPC on
shifted flow sigmas for Wan 2.1; classifier-free guidance) from the caller's seeded generator, and
each decoded clip as an animated WebP."""

from __future__ import annotations

import io

import torch

from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling_common import to_pil


def folder_scheduler(config: dict):
    """The scheduler class and config of the pipeline folder (what WanPipeline samples with)."""
    import diffusers

    return getattr(diffusers, config["_class_name"]).from_config(config)


def wan_sample(
    family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size, frames
) -> torch.Tensor:
    """Latents [B, C, F', H/8, W/8] (normalised as trained) for each row of `cond`, guided by
    `uncond` when guidance > 1; `size` = (height, width) px, `frames` video frames (4k+1)."""
    from splitstage.pipelines.diffusers.wan_latents import latent_frames

    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    scheduler = folder_scheduler(family.scheduler_config)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["z_dim"])
    shape = (count, channels, latent_frames(frames), size[0] // 8, size[1] // 8)
    x = torch.randn(shape, generator=generator).to(ctx.device)
    scheduler.set_timesteps(steps, device=ctx.device)
    scheduler.set_begin_index(0)

    def velocity(latents: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        return model(
            hidden_states=latents.to(dtype),
            timestep=t.expand(count),
            encoder_hidden_states=text["prompt_embeds"].to(ctx.device, dtype),
            return_dict=False,
        )[0].float()

    for t in scheduler.timesteps:
        v = velocity(x, t, cond)
        if guidance > 1:
            unguided = velocity(x, t, uncond)
            v = unguided + guidance * (v - unguided)
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return x


def clip_webp(clip: torch.Tensor, fps: float = 16.0) -> bytes:
    """One clip [F, 3, H, W] in [-1, 1] as a looping animated WebP (lossless)."""
    frames = to_pil(clip)
    out = io.BytesIO()
    frames[0].save(
        out,
        format="WEBP",
        save_all=True,
        append_images=frames[1:],
        duration=round(1000 / fps),
        loop=0,
        lossless=True,
    )
    return out.getvalue()
