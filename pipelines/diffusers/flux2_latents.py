"""FLUX.2's latents: AutoencoderKLFlux2's latents in 2x2 patches, normalised by the VAE's
batch-norm running statistics (held in its weights), packed into tokens with 4-D position ids,
exactly as Flux2Pipeline and diffusers' train_dreambooth_lora_flux2 compute them."""

from __future__ import annotations

from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.base import draw_latent
from splitstage.pipelines.runtime import StepContext

BN_KEYS = ("bn.running_mean", "bn.running_var")


def bn_stats(weights, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, 4C, 1, 1] float32 from the VAE's weights file: running_mean and
    sqrt(running_var + batch_norm_eps)."""
    with safe_open(str(weights), framework="pt") as handle:
        held = set(handle.keys())
        missing = [key for key in BN_KEYS if key not in held]
        if missing:
            raise ConfigError(
                f"pipeline.pretrained: {weights} has no {missing[0]}; give the "
                "AutoencoderKLFlux2 weights saved with FLUX.2 (its batch-norm statistics "
                "normalise the latents)"
            )
        mean, var = (handle.get_tensor(key).float() for key in BN_KEYS)
    return mean.view(1, -1, 1, 1), torch.sqrt(var.view(1, -1, 1, 1) + eps)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2] (Flux2Pipeline._patchify_latents)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._patchify_latents(latents)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H W, C] tokens (Flux2Pipeline._pack_latents)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._pack_latents(latents)


def latent_ids(latents: torch.Tensor) -> torch.Tensor:
    """Position ids [B, H W, 4] of the packed tokens (t, h, w, l)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_latent_ids(latents).to(latents.device)


def make_bn_sampler(stats: tuple[torch.Tensor, torch.Tensor]):
    """A per-step unit function: draw a latent from the cached distribution, patchify it, then
    normalise it with the VAE's batch-norm statistics."""

    def sample_latents(
        ctx: StepContext, latent_mean: torch.Tensor, latent_logvar: torch.Tensor | None = None
    ) -> dict[str, Any]:
        z = patchify(draw_latent(ctx, latent_mean, latent_logvar))
        mean, std = (s.to(z.device) for s in stats)
        return {"input_latents": (z - mean) / std}

    return sample_latents


def decode(vae: nn.Module, stats, latents: torch.Tensor) -> torch.Tensor:
    """Normalised patched latents [B, 4C, h, w] -> images in [-1, 1], as the pipeline decodes."""
    from diffusers import Flux2Pipeline

    mean, std = (s.to(latents.device) for s in stats)
    z = Flux2Pipeline._unpatchify_latents(latents.float() * std + mean)
    dtype = next(vae.parameters()).dtype
    return vae.decode(z.to(dtype), return_dict=False)[0].float().clamp(-1, 1)
