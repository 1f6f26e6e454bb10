"""Validation samplers of the diffusers families, as their diffusers pipelines sample.

SD / SDXL: the folder's own scheduler (model_index.json), classifier-free guidance. SD3: its
flow-matching Euler scheduler with the config's shift, guided. FLUX: flow-matching Euler with
the resolution-dependent shift, guidance given to the model's guidance embedding (distilled).
Every random draw comes from the caller's seeded generator, so a seed gives the same images.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from splitstage.pipelines.diffusers.packing import image_ids, pack
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling_common import guided


def folder_scheduler(index: dict[str, Any], config: dict[str, Any]):
    """The scheduler class model_index.json names, from the folder's scheduler config."""
    import diffusers

    name = (index.get("scheduler") or [None, None])[1] or "EulerDiscreteScheduler"
    return getattr(diffusers, name).from_config(config)


def _step(scheduler, prediction, t, x, generator):
    """scheduler.step, passing the generator to schedulers that draw noise (DDPM, ancestral)."""
    kwargs = {"return_dict": False}
    if "generator" in inspect.signature(scheduler.step).parameters:
        kwargs["generator"] = generator
    return scheduler.step(prediction, t, x, **kwargs)[0]


def vae_scale(family) -> int:
    """Pixels per latent along a side, as diffusers' pipelines compute vae_scale_factor."""
    return 2 ** (len(family.vae_config.get("block_out_channels", [0] * 4)) - 1)


def latent_shape(family, size: tuple[int, int]) -> tuple[int, int]:
    """The VAE latent (height, width) of images of `size` (height, width) pixels."""
    return size[0] // vae_scale(family), size[1] // vae_scale(family)


def unet_sample(family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size):
    """SD / SDXL: scheduler loop over UNet predictions, classifier-free guided; `size` is the
    images' (height, width) in pixels."""
    unet = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(unet)
    scheduler = folder_scheduler(family.folder.index, family.scheduler_config)
    scheduler.set_timesteps(steps)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["latent_channels"])
    height, width = latent_shape(family, size)
    x = torch.randn(count, channels, height, width, generator=generator)
    x = (x * scheduler.init_noise_sigma).to(ctx.device)

    def prediction(latents: torch.Tensor, t: torch.Tensor, conditional: bool) -> torch.Tensor:
        text = cond if conditional else uncond
        kwargs = family.sampling_kwargs(ctx, text, count, dtype, size)
        inp = scheduler.scale_model_input(latents, t).to(dtype)
        emb = text["prompt_embeds"].to(ctx.device, dtype)
        return unet(inp, t, emb, **kwargs, return_dict=False)[0].float()

    predict = guided(prediction, guidance)
    for t in scheduler.timesteps:
        x = _step(scheduler, predict(x, t), t, x, generator)
    return x


def sd3_sample(family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size):
    """SD3: FlowMatchEuler with the config's shift (or, with `use_dynamic_shifting`, one for the
    image's token count, as SD3's pipeline), classifier-free guided."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    config = family.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["latent_channels"])
    height, width = latent_shape(family, size)
    shift = {}
    if config.get("use_dynamic_shifting"):
        patch = int(family.folder.config("transformer").get("patch_size", 2))
        shift["mu"] = calculate_shift(
            (height // patch) * (width // patch),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )
    scheduler.set_timesteps(steps, **shift)
    x = torch.randn(count, channels, height, width, generator=generator).to(ctx.device)

    def velocity(latents: torch.Tensor, t: torch.Tensor, conditional: bool) -> torch.Tensor:
        text = cond if conditional else uncond
        return model(
            hidden_states=latents.to(dtype),
            timestep=t.expand(count).to(ctx.device, dtype),
            encoder_hidden_states=text["prompt_embeds"].to(ctx.device, dtype),
            pooled_projections=text["pooled_prompt_embeds"].to(ctx.device, dtype),
            return_dict=False,
        )[0].float()

    predict = guided(velocity, guidance)
    for t in scheduler.timesteps:
        x = _step(scheduler, predict(x, t), t, x, generator)
    return x


def flux_sample(family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size):
    """FLUX: packed latents, FlowMatchEuler shifted for the image size, embedded guidance."""
    from diffusers import FluxPipeline

    model = ctx.model(family.denoiser, "sample")
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["latent_channels"])
    height, width = latent_shape(family, size)
    noise = torch.randn(count, channels, height, width, generator=generator).to(ctx.device)
    x = flux_loop(
        family, model, ctx, noise, cond, steps=steps, guidance=guidance, generator=generator
    )
    return FluxPipeline._unpack_latents(x, size[0], size[1], vae_scale(family))


def flux_loop(
    family, model, ctx: StepContext, noise, cond, *, steps, guidance, generator=None
) -> torch.Tensor:
    """FluxPipeline's denoising loop from `noise` [B, C, h, w]: the packed final latents (the
    caller decides on gradients: validation samples under no_grad, direct distillation not)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    dtype = input_dtype(model)
    config = family.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    count, _, height, width = noise.shape
    mu = calculate_shift(
        (height // 2) * (width // 2),  # packed tokens: 2x2 latent patches
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    sigmas = np.linspace(1.0, 1 / steps, steps)
    if config.get("use_dynamic_shifting"):
        scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas)
    x = pack(noise)
    ids = image_ids(noise).to(dtype)
    text = cond["prompt_embeds"].to(ctx.device, dtype)
    embedded = None
    if family.folder.config("transformer").get("guidance_embeds"):
        embedded = torch.full((count,), float(guidance), device=ctx.device)
    for t in scheduler.timesteps:
        v = model(
            hidden_states=x.to(dtype),
            timestep=(t.expand(count) / 1000).to(ctx.device, dtype),
            guidance=embedded,
            pooled_projections=cond["pooled_prompt_embeds"].to(ctx.device, dtype),
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=ctx.device, dtype=dtype),
            img_ids=ids,
            return_dict=False,
        )[0].float()
        x = _step(scheduler, v, t, x, generator)
    return x


def vae_decode(family, vae, latents: torch.Tensor) -> torch.Tensor:
    """Undo the VAE config's scaling and shift, then decode to images in [-1, 1]."""
    scaling = float(family.vae_config.get("scaling_factor") or 1.0)
    shift = float(family.vae_config.get("shift_factor") or 0.0)
    dtype = next(vae.parameters()).dtype
    z = (latents.float() / scaling + shift).to(dtype)
    return vae.decode(z, return_dict=False)[0].float().clamp(-1, 1)
