"""Stable Diffusion XL: two CLIP encoders (penultimate states, pooled), size/crop time ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from splitstage.data.dataset import Row, load_sample
from splitstage.data.images import center_crop_box
from splitstage.pipelines.diffusers.component_shapes import Width, link
from splitstage.pipelines.diffusers.sd import UNetFamily
from splitstage.pipelines.diffusers.text import (
    clip_penultimate,
    split_empty,
    token_ids,
    with_empty,
)
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Unit

ENCODERS = ("text_encoder", "text_encoder_2")


def time_ids(
    ctx: StepContext, original_size: list, crop_top_left: list, height: list, width: list
) -> dict[str, Any]:
    """SDXL's add_time_ids per sample: original (h, w), crop (top, left), target (h, w)."""
    rows = [
        [*orig, *crop, h, w]
        for orig, crop, h, w in zip(original_size, crop_top_left, height, width, strict=True)
    ]
    return {"add_time_ids": torch.tensor(rows, dtype=torch.float32)}


class SDXLFamily(UNetFamily):
    """Stable Diffusion XL base."""

    name = "sdxl"
    default_guidance = 5.0
    model_names = ("text_encoder", "text_encoder_2", "vae", "unet")
    pipeline_classes = ("StableDiffusionXLPipeline",)
    text_params = ("prompt_embeds", "pooled_prompt_embeds")
    text_models = ENCODERS
    denoiser_params = ("prompt_embeds", "pooled_prompt_embeds", "add_time_ids")
    shape_links = (
        link(
            [("text_encoder", "hidden_size"), ("text_encoder_2", "hidden_size")],
            ("unet", "cross_attention_dim"),
            "both text encoders' hidden states, concatenated",
        ),
        link(
            [("text_encoder_2", "projection_dim"), Width("unet", "addition_time_embed_dim", 6)],
            ("unet", "projection_class_embeddings_input_dim"),
            "the pooled text embedding beside the six size/crop time ids",
        ),
        link([("vae", "latent_channels")], ("unet", "in_channels"), "the VAE's latents"),
    )

    def units(self) -> list[RunnableUnit]:
        """The shared units plus the size conditioning (V2: computed from the data once)."""
        size_unit = RunnableUnit(
            Unit(
                "SizeConditioning",
                ("original_size", "crop_top_left", "height", "width"),
                output_params=("add_time_ids",),
            ),
            time_ids,
        )
        units = super().units()
        return [units[0], size_unit, *units[1:]]

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """[B, 77, D1+D2] hidden states and [B, P] pooled, for the prompts and the empty one."""
        length = self.config.pipeline.max_prompt_length
        states, pooled = [], None
        for name in ENCODERS:
            ids = token_ids(self.tokenizer(name), with_empty(prompt), length, ctx.device)
            hidden, pooled = clip_penultimate(ctx.model(name, "PromptEncoder"), ids)
            states.append(hidden)
        values = {"prompt_embeds": torch.cat(states, dim=-1), "pooled_prompt_embeds": pooled}
        return split_empty(values, len(prompt))

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The crop (square or bucket) plus the original size and crop corner SDXL is
        conditioned on."""
        sample = load_sample(row, base_path, self.image_size(), source_size=True)
        original = sample.pop("source_size")
        _, _, left, top = center_crop_box(
            original[1], original[0], sample["height"], sample["width"]
        )
        sample.update(original_size=list(original), crop_top_left=[top, left])
        return sample

    def prompt_conditioning(self, ctx: StepContext, prompts: Sequence[str]):
        """As StableDiffusionXLPipeline: an empty negative prompt is zeros when the folder says
        force_zeros_for_empty_prompt (SDXL base does)."""
        values = super().prompt_conditioning(ctx, prompts)
        if self.folder.index.get("force_zeros_for_empty_prompt", True):
            empty = torch.tensor([not p for p in prompts], device=values["prompt_embeds"].device)
            for name, value in values.items():
                mask = empty.reshape(-1, *([1] * (value.ndim - 1)))
                values[name] = torch.where(mask, torch.zeros_like(value), value)
        return values

    def sampling_kwargs(
        self, ctx: StepContext, text, count: int, dtype, size: tuple[int, int]
    ) -> dict[str, Any]:
        """Pooled embedding and time ids of an uncropped image of the sampled (height, width),
        as StableDiffusionXLPipeline: original size = target size, crop (0, 0)."""
        height, width = size
        ids = torch.tensor([[height, width, 0, 0, height, width]] * count, dtype=dtype)
        return {
            "added_cond_kwargs": {
                "text_embeds": text["pooled_prompt_embeds"].to(ctx.device, dtype),
                "time_ids": ids.to(ctx.device),
            }
        }

    def unet_kwargs(self, ctx: StepContext, inputs: dict[str, Any], dtype) -> dict[str, Any]:
        """added_cond_kwargs: the pooled text embedding and the six time ids."""
        return {
            "added_cond_kwargs": {
                "text_embeds": inputs["pooled_prompt_embeds"].to(ctx.device, dtype),
                "time_ids": inputs["add_time_ids"].to(ctx.device, dtype),
            }
        }
