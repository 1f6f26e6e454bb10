"""The Wan VAE's latent normalisation, shared by Wan and Qwen-Image (whose VAE is Wan's).

AutoencoderKLWan and AutoencoderKLQwenImage have no scaling_factor: latents are
(z - latents_mean) / latents_std per channel, as WanPipeline / QwenImagePipeline undo them before
decoding and diffusers' training scripts apply them after encoding. Works on [B, C, ...] latents
(Qwen-Image's [B, C, H, W] frames, Wan's [B, C, F, H, W] clips).
"""

from __future__ import annotations

from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.base import draw_latent
from splitstage.pipelines.runtime import StepContext

STATS = ("latents_mean", "latents_std", "z_dim")  # what normalising needs of the VAE config


def require_stats(vae_config: dict[str, Any], config_file: str, saved_with: str) -> None:
    """Refuse a VAE config without the per-channel statistics, naming the file."""
    for key in STATS:
        if key not in vae_config:
            raise ConfigError(
                f"pipeline.pretrained: {config_file} has no {key}; give the {saved_with}"
            )


def channel_stats(
    vae_config: dict[str, Any], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents_mean, latents_std) of the VAE config, shaped [1, C, 1, ...] to broadcast over
    `like` and on its device, float32."""
    shape = (1, -1) + (1,) * (like.dim() - 2)
    mean = torch.tensor(vae_config["latents_mean"], dtype=torch.float32, device=like.device)
    std = torch.tensor(vae_config["latents_std"], dtype=torch.float32, device=like.device)
    return mean.view(shape), std.view(shape)


def normalise(vae_config: dict[str, Any], z: torch.Tensor) -> torch.Tensor:
    """VAE latents -> training latents: (z - latents_mean) / latents_std per channel."""
    mean, std = channel_stats(vae_config, z)
    return (z.float() - mean) / std


def denormalise(vae_config: dict[str, Any], latents: torch.Tensor) -> torch.Tensor:
    """Training latents back to the VAE's latent space (inverse of `normalise`), float32."""
    mean, std = channel_stats(vae_config, latents)
    return latents.float() * std + mean


def make_normalising_sampler(vae_config: dict[str, Any]):
    """A per-step unit function: draw a latent from the cached distribution, then normalise it
    per channel."""

    def sample_latents(
        ctx: StepContext, latent_mean: torch.Tensor, latent_logvar: torch.Tensor | None = None
    ) -> dict[str, Any]:
        return {
            "input_latents": normalise(vae_config, draw_latent(ctx, latent_mean, latent_logvar))
        }

    return sample_latents
