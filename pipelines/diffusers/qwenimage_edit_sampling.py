"""Qwen-Image-Edit's sampler: QwenImageEdit(Plus)Pipeline's denoising loop given reference latents.

The packed reference tokens follow the noisy tokens at every step, with their own img_shapes
entries, and each prediction is cut back to the noisy tokens before the scheduler step; the
shift is computed from the noisy tokens alone and true CFG rescales as the pipelines do. Rows
whose references differ in shape (`reference_shapes`, validation prompts' own images) are
denoised in groups of one shape, each from its rows of the one noise draw.
"""

from __future__ import annotations

import numpy as np
import torch

from splitstage.pipelines.diffusers.qwenimage_latents import pack, unpack
from splitstage.pipelines.diffusers.qwenimage_sampling import image_shift, true_cfg
from splitstage.pipelines.family import input_dtype
from splitstage.pipelines.runtime import StepContext


def edit_sample(family, ctx: StepContext, cond, uncond, generator, *, steps, guidance, size):
    """Latents [B, C, H/8, W/8] of images `size` (height, width) for each row of `cond` (prompt
    embeddings, mask and the family's reference slots, [B, C, h, w] each or empty, optionally
    `reference_shapes` [B, slots, 2]: each row's true (h, w) in its zero-padded slots), guided
    by `uncond` when guidance > 1 (the pipelines' true_cfg_scale)."""
    count = cond["prompt_embeds"].shape[0]
    channels = int(family.vae_config["z_dim"])
    height, width = size[0] // family.vae_scale, size[1] // family.vae_scale
    noise = torch.randn(count, channels, height, width, generator=generator)
    slots = [cond[slot] for slot in family.reference_slots]
    shapes = cond.get("reference_shapes")
    groups: dict[tuple, list[int]] = {}
    for row in range(count):
        key = tuple(map(tuple, shapes[row].tolist())) if shapes is not None else ()
        groups.setdefault(key, []).append(row)
    out = torch.empty(count, channels, height, width, device=ctx.device)
    for key, rows in groups.items():
        index = torch.tensor(rows)
        refs = [slot[index] for slot in slots]
        if key:  # cut each slot back to this group's shape (padding and absent slots off)
            refs = [ref[..., :h, :w] for ref, (h, w) in zip(refs, key, strict=True)]
        text = shortest({name: cond[name][index] for name in family.text_params})
        guided = (
            shortest({name: uncond[name][index] for name in family.text_params})
            if guidance > 1
            else None
        )
        out[index] = denoise(family, ctx, noise[index], refs, text, guided, steps, guidance)
    return out


def shortest(text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A group's prompt embeddings and mask cut to its longest prompt (the tokens past it are
    padding for other groups' prompts: masked, but computed every step)."""
    longest = int(text["prompt_embeds_mask"].sum(dim=1).max())
    return {name: value[:, :longest] for name, value in text.items()}


def denoise(family, ctx: StepContext, noise, refs, cond, uncond, steps, guidance) -> torch.Tensor:
    """One group's loop (its references share a shape): latents [b, C, h, w] from `noise`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = ctx.model(family.denoiser, "sample")
    dtype = input_dtype(model)
    count, _, height, width = noise.shape
    noise = noise.to(ctx.device)
    refs = [ref.to(ctx.device, torch.float32) for ref in refs]
    refs = [ref for ref in refs if ref.shape[-1]]
    ref_tokens = [pack(ref).to(dtype) for ref in refs]
    shapes = [
        (1, height // 2, width // 2),
        *((1, r.shape[-2] // 2, r.shape[-1] // 2) for r in refs),
    ]
    config = family.scheduler_config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    x = pack(noise)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    scheduler.set_timesteps(sigmas=sigmas, mu=image_shift(config, x.shape[1]), device=ctx.device)
    scheduler.set_begin_index(0)

    def velocity(latents: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        return model(
            hidden_states=torch.cat([latents.to(dtype), *ref_tokens], dim=1),
            timestep=(t.expand(count).to(latents.dtype) / 1000).to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(ctx.device, dtype),
            encoder_hidden_states_mask=text["prompt_embeds_mask"].to(ctx.device),
            img_shapes=[shapes] * count,
            return_dict=False,
        )[0][:, : latents.shape[1]].float()

    for t in scheduler.timesteps:
        v = velocity(x, t, cond)
        if uncond is not None:
            v = true_cfg(v, velocity(x, t, uncond), guidance)
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return unpack(x, height, width)
