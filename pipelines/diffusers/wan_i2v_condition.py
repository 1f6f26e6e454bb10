"""Wan image-to-video conditioning, as WanImageToVideoPipeline (diffusers 0.42) computes it: the
CLIP image embeddings of the first frame (Wan 2.1) and the condition latents (mask + latents).

The condition video is the first frame followed by zeros, VAE-encoded to its mean ('argmax') and
normalised per channel; the mask is 1 on the first frame and 0 after it, the first frame repeated
over the VAE's temporal compression so that it folds into (frames - 1) / 4 + 1 latent frames of
4 channels; `condition_latents` = cat([mask, latents]) on the channel dim, what the pipeline
concatenates after the noisy latents (prepare_latents, expand_timesteps off).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.wan_vae_norm import normalise
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling_common import to_pil

PROCESSOR_DIR = "image_processor"


def load_image_processor(root: Path) -> Any:
    """The folder's CLIP image processor through transformers' PIL class (CLIPImageProcessor's
    default backend needs torchvision); a folder without one is refused naming it."""
    from transformers import CLIPImageProcessorPil

    folder = root / PROCESSOR_DIR
    if not (folder / "preprocessor_config.json").is_file():
        raise ConfigError(
            f"pipeline.pretrained: {folder} has no preprocessor_config.json; Wan 2.1 I2V's "
            "transformer takes CLIP image embeddings: give the folder as saved (with "
            "image_processor/)"
        )
    return CLIPImageProcessorPil.from_pretrained(folder)


def clip_pixels(processor: Any, images: torch.Tensor) -> torch.Tensor:
    """The processor's pixel_values [B, 3, crop] for images [B, 3, H, W] in [-1, 1] given as
    8-bit PIL images; fake tensors (the memory plan) give zeros of that shape."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(images):
        crop = processor.crop_size
        return images.new_zeros(images.shape[0], 3, crop["height"], crop["width"])
    return processor(images=to_pil(images), return_tensors="pt").pixel_values


def make_image_embedder(processor: Any):
    """The V2 unit function: WanImageToVideoPipeline.encode_image on each conditioning frame,
    CLIP's penultimate hidden states [B, tokens, width]."""

    def embed_images(ctx: StepContext, reference_image: torch.Tensor) -> dict[str, Any]:
        encoder = ctx.model("image_encoder", "ImageEncoder")
        dtype = next(encoder.parameters()).dtype
        pixels = clip_pixels(processor, reference_image)
        hidden = encoder(pixel_values=pixels.to(ctx.device, dtype), output_hidden_states=True)
        return {"image_embeds": hidden.hidden_states[-2]}

    return embed_images


def first_frame_mask(count: int, frames: int, size: tuple[int, int], temporal: int) -> torch.Tensor:
    """[count, temporal, latent frames, h, w]: 1 where the frame is given (the first), else 0,
    folded over the VAE's temporal compression as prepare_latents folds it."""
    height, width = size
    mask = torch.zeros(count, 1, frames, height, width)
    mask[:, :, 0] = 1
    first = mask[:, :, 0:1].repeat_interleave(temporal, dim=2)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)
    return mask.view(count, -1, temporal, height, width).transpose(1, 2)


def condition_latents(
    ctx: StepContext, vae_config: dict[str, Any], first: torch.Tensor, frames: int
) -> torch.Tensor:
    """[B, temporal + C, F', h, w] in the VAE's dtype: the first-frame mask and the normalised
    latents of each first frame [B, 3, H, W] followed by `frames` - 1 zero frames (the
    pipeline's prepare_latents)."""
    temporal = int(vae_config.get("scale_factor_temporal", 4))
    vae = ctx.model("vae", "ConditionEncoder")
    dtype = next(vae.parameters()).dtype
    first = first.to(ctx.device, dtype).unsqueeze(2)  # [B, 3, 1, H, W]
    count = first.shape[0]
    rest = first.new_zeros(count, 3, frames - 1, *first.shape[-2:])
    z = vae.encode(torch.cat([first, rest], dim=2)).latent_dist.mode()
    latents = normalise(vae_config, z)
    mask = first_frame_mask(count, frames, latents.shape[-2:], temporal).to(latents.device)
    return torch.cat([mask, latents], dim=1).to(dtype)


def make_condition_encoder(vae_config: dict[str, Any]):
    """The V2 unit function: `condition_latents` [B, temporal + C, F', h, w] of each clip's
    conditioning frame, in the VAE's dtype."""

    def encode_condition(
        ctx: StepContext, reference_image: torch.Tensor, video: torch.Tensor
    ) -> dict[str, Any]:
        latents = condition_latents(ctx, vae_config, reference_image, video.shape[1])
        return {"condition_latents": latents}

    return encode_condition
