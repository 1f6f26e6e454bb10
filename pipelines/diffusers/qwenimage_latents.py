"""Qwen-Image's latents: its video VAE on one-frame clips, per-channel normalisation, 2x2 packing.

AutoencoderKLQwenImage takes [B, 3, F, H, W]; its latents are normalised per channel as Wan's
are (wan_vae_norm.py), exactly as QwenImagePipeline and diffusers'
train_dreambooth_lora_qwen_image do. The transformer reads 2x2 patches as tokens
(QwenImagePipeline._pack_latents) and each sample's (frames, rows, columns) of patches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitstage.pipelines.diffusers.wan_vae_norm import denormalise
from splitstage.pipelines.runtime import StepContext


def encode_frames(ctx: StepContext, image: torch.Tensor) -> dict[str, Any]:
    """The VAE's latent distribution of each image as a one-frame clip: mean and log-variance
    [B, C, H/8, W/8] (or the mean only), in the VAE's dtype, frame axis removed."""
    vae = ctx.model("vae", "VAEEncoder")
    dtype = next(vae.parameters()).dtype
    dist = vae.encode(image.to(ctx.device, dtype).unsqueeze(2)).latent_dist
    if ctx.settings["vae_latents"] == "mean":
        return {"latent_mean": dist.mean[:, :, 0]}
    return {"latent_mean": dist.mean[:, :, 0], "latent_logvar": dist.logvar[:, :, 0]}


def decode_frames(vae: nn.Module, vae_config: dict[str, Any], latents: torch.Tensor):
    """Normalised latents [B, C, H, W] -> images in [-1, 1] [B, 3, 8H, 8W] (one frame each)."""
    dtype = next(vae.parameters()).dtype
    z = denormalise(vae_config, latents).to(dtype).unsqueeze(2)
    return vae.decode(z, return_dict=False)[0][:, :, 0].float().clamp(-1, 1)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C], as QwenImagePipeline packs (a pure permutation)."""
    from diffusers import QwenImagePipeline

    b, c, h, w = latents.shape
    return QwenImagePipeline._pack_latents(latents, b, c, h, w)


def unpack(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, H/2 * W/2, 4C] -> [B, C, H, W] latents of height x width (latent rows, columns)."""
    b, _, channels = packed.shape
    x = packed.view(b, height // 2, width // 2, channels // 4, 2, 2)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels // 4, height, width)


def image_shapes(latents: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """QwenImagePipeline's img_shapes: per sample, one (frames, rows, columns) of patches."""
    b, _, h, w = latents.shape
    return [[(1, h // 2, w // 2)]] * b
