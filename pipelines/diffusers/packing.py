"""FLUX's latent packing: 2x2 patches as tokens, and their position ids (diffusers' own)."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C], as FluxPipeline packs (a pure permutation)."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def image_ids(latents: torch.Tensor) -> torch.Tensor:
    """Position ids [H/2 * W/2, 3] of the packed latent tokens."""
    from diffusers import FluxPipeline

    b, _, h, w = latents.shape
    return FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
