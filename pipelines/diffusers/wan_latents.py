"""Wan's latents: its causal 3D VAE on [frames, 3, H, W] clips, normalised per channel.

AutoencoderKLWan takes [B, 3, F, H, W] (F = 4k+1) and gives (F - 1) / 4 + 1 latent frames at 1/8
of the side; its latents are normalised per channel (wan_vae_norm.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitstage.pipelines.diffusers.wan_vae_norm import denormalise
from splitstage.pipelines.runtime import StepContext


def latent_frames(frames: int, temporal_scale: int = 4) -> int:
    """Latent frames of a clip: (frames - 1) / 4 + 1, as WanPipeline.prepare_latents counts."""
    return (frames - 1) // temporal_scale + 1


def encode_clips(ctx: StepContext, video: torch.Tensor) -> dict[str, Any]:
    """The VAE's latent distribution of each clip [B, F, 3, H, W]: mean and log-variance
    [B, C, F', H/8, W/8] (or the mean only), in the VAE's dtype."""
    vae = ctx.model("vae", "VAEEncoder")
    dtype = next(vae.parameters()).dtype
    clips = video.to(ctx.device, dtype).permute(0, 2, 1, 3, 4)
    dist = vae.encode(clips).latent_dist
    if ctx.settings["vae_latents"] == "mean":
        return {"latent_mean": dist.mean}
    return {"latent_mean": dist.mean, "latent_logvar": dist.logvar}


def decode_clips(vae: nn.Module, vae_config: dict[str, Any], latents: torch.Tensor):
    """Normalised latents [B, C, F', h, w] -> clips in [-1, 1] [B, F, 3, 8h, 8w]."""
    dtype = next(vae.parameters()).dtype
    video = vae.decode(denormalise(vae_config, latents).to(dtype), return_dict=False)[0]
    return video.float().clamp(-1, 1).permute(0, 2, 1, 3, 4)
