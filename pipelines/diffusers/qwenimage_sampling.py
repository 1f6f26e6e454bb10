"""Qwen-Image's validation sampler, as QwenImagePipeline samples: packed noise, FlowMatchEuler on
sigmas 1 .. 1/steps shifted for the image's token count, true classifier-free guidance with the
pipeline's norm rescale. Every random draw comes from the caller's seeded generator."""

from __future__ import annotations

import numpy as np
import torch

from splitstage.pipelines.diffusers.qwenimage_latents import pack, unpack
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext


def image_shift(config: dict, tokens: int) -> float:
    """The scheduler config's mu for `tokens` packed image tokens (QwenImagePipeline's
    calculate_shift with the config's bounds)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    return calculate_shift(
        tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale (cond - uncond), rescaled per token to the conditional prediction's norm."""
    combined = uncond + scale * (cond - uncond)
    ratio = torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
    return combined * ratio


def qwenimage_sample(
    family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size
) -> torch.Tensor:
    """Latents [B, C, H/8, W/8] (normalised as trained) for each row of `cond`; guided by
    `uncond` when guidance > 1 (the pipeline's true_cfg_scale); `size` = (height, width) px."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    config = family.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["z_dim"])
    height, width = size[0] // family.vae_scale, size[1] // family.vae_scale
    noise = torch.randn(count, channels, height, width, generator=generator).to(ctx.device)
    x = pack(noise)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    scheduler.set_timesteps(sigmas=sigmas, mu=image_shift(config, x.shape[1]), device=ctx.device)
    scheduler.set_begin_index(0)
    shapes = [[(1, height // 2, width // 2)]] * count

    def velocity(latents: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        return model(
            hidden_states=latents.to(dtype),
            timestep=(t.expand(count).to(latents.dtype) / 1000).to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(ctx.device, dtype),
            encoder_hidden_states_mask=text["prompt_embeds_mask"].to(ctx.device),
            img_shapes=shapes,
            return_dict=False,
        )[0].float()

    for t in scheduler.timesteps:
        v = velocity(x, t, cond)
        if guidance > 1:
            v = true_cfg(v, velocity(x, t, uncond), guidance)
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return unpack(x, height, width)
