"""Wan's latents: its causal 3D VAE on [frames, 3, H, W] clips, normalised per channel.

AutoencoderKLWan takes [B, 3, F, H, W] (F = 4k+1) and gives (F - 1) / 4 + 1 latent frames at 1/8
of the side. It has no scaling_factor: latents are (z - latents_mean) / latents_std per channel,
as WanPipeline undoes them before decoding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitstage.pipelines.runtime import StepContext

CHANNELS = (1, -1, 1, 1, 1)  # a [C] statistic over [B, C, F, H, W]


def channel_stats(vae_config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents_mean, latents_std) of the VAE config as [C] float32 tensors."""
    mean = torch.tensor(vae_config["latents_mean"], dtype=torch.float32)
    std = torch.tensor(vae_config["latents_std"], dtype=torch.float32)
    return mean, std


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


def make_normalising_sampler(vae_config: dict[str, Any]):
    """A per-step unit function: draw a latent from the cached distribution, then
    (z - latents_mean) / latents_std per channel."""
    mean, std = channel_stats(vae_config)

    def sample_latents(
        ctx: StepContext, latent_mean: torch.Tensor, latent_logvar: torch.Tensor | None = None
    ) -> dict[str, Any]:
        z = latent_mean.float()
        if latent_logvar is not None:
            spread = torch.exp(0.5 * latent_logvar.float().clamp(-30.0, 20.0))
            z = z + spread * ctx.draws.randn(z.shape, device=z.device)
        return {"input_latents": (z - mean.view(CHANNELS).to(z)) / std.view(CHANNELS).to(z)}

    return sample_latents


def decode_clips(vae: nn.Module, vae_config: dict[str, Any], latents: torch.Tensor):
    """Normalised latents [B, C, F', h, w] -> clips in [-1, 1] [B, F, 3, 8h, 8w]."""
    mean, std = channel_stats(vae_config)
    dtype = next(vae.parameters()).dtype
    device = latents.device
    z = latents.float() * std.view(CHANNELS).to(device) + mean.view(CHANNELS).to(device)
    video = vae.decode(z.to(dtype), return_dict=False)[0]
    return video.float().clamp(-1, 1).permute(0, 2, 1, 3, 4)
