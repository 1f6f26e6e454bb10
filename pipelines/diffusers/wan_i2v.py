"""Wan image-to-video (WanImageToVideoPipeline folders): Wan 2.1 I2V with its CLIP image encoder,
or one expert of Wan 2.2 I2V A14B (no image encoder), trained as the `wan` family trains.

Each clip is conditioned on one frame: its own first frame, or the row's `edit_image` (one image,
cropped to the clip's size). Stage 1 caches, beside the prompt embeddings and the clip's latent
distribution, the CLIP penultimate hidden states of that frame (`image_embeds`, when the
transformer has an image_dim) and `condition_latents` (the first-frame mask and the normalised
latents of the frame followed by zeros: wan_i2v_condition.py); stage 2 only concatenates them
after the noisy latents. Wan 2.2 TI2V (expand_timesteps) is refused by name. Validation clips
start from each prompt's first frame in `validation.reference_images` (cropped to the clip's
size, as training crops an edit_image): stage 1 computes its conditioning as above, stage 2
samples with WanImageToVideoPipeline's loop (wan_sampling.py).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.data.dataset import Row
from splitstage.data.references import ReferenceImages, load_references
from splitstage.data.source import DataSource
from splitstage.pipelines.diffusers.component_shapes import Width, link
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.diffusers.wan import WanFamily
from splitstage.pipelines.diffusers.wan_i2v_condition import (
    condition_latents,
    load_image_processor,
    make_condition_encoder,
    make_image_embedder,
)
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Unit

TEXT_TOKENS = 512  # Wan's attention takes all but the last 512 context tokens as the image's
EXPERTS = ("transformer", "transformer_2")


class WanI2VFamily(WanFamily):
    """Wan 2.1 I2V, or one Wan 2.2 I2V A14B expert (WanImageToVideoPipeline folders)."""

    name = "wan_i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    reference_images = ReferenceImages(required=False, most=1)
    shape_links = tuple(
        one
        for expert in EXPERTS
        for one in (
            link([("text_encoder", "d_model")], (expert, "text_dim"), "UMT5's hidden states"),
            link(
                [Width("vae", "z_dim", 2), ("vae", "scale_factor_temporal")],
                (expert, "in_channels"),
                "the noisy latents, the first-frame mask and the condition latents",
            ),
            link([("vae", "z_dim")], (expert, "out_channels"), "predictions of the VAE's latents"),
            link(
                [("image_encoder", "hidden_size")],
                (expert, "image_dim"),
                "CLIP's penultimate hidden states",
            ),
        )
    )

    @cached_property
    def uses_image_encoder(self) -> bool:
        """Whether the trained transformer takes CLIP image embeddings (its image_dim is set,
        as the pipeline decides: Wan 2.1 I2V)."""
        return self.folder.config(self.denoiser).get("image_dim") is not None

    @property
    def model_names(self) -> tuple[str, ...]:
        """The encoders (the image encoder for Wan 2.1) and the one transformer trained."""
        image = ("image_encoder",) if self.uses_image_encoder else ()
        return ("text_encoder", "vae", *image, self.denoiser)

    @property
    def denoiser_params(self) -> tuple[str, ...]:  # type: ignore[override]
        """The transformer's conditioning: prompts, condition latents, CLIP embeddings."""
        image = ("image_embeds",) if self.uses_image_encoder else ()
        return ("prompt_embeds", "condition_latents", *image)

    def check_version(self) -> None:
        """Wan 2.1 I2V or one Wan 2.2 I2V A14B expert, as `wan` checks its folders; TI2V's
        per-token timesteps, a CLIP-conditioned transformer without its encoder or processor,
        or prompts not padded to 512 tokens (the attention reads the image tokens as what
        precedes the last 512) are refused by the field to change."""
        where = f"{self.folder.root}/model_index.json"
        if self.folder.index.get("expand_timesteps"):
            raise ConfigError(
                f"pipeline.pretrained: {where} sets expand_timesteps (Wan 2.2 TI2V-5B's "
                "first-frame timesteps), which splitstage does not train; give a Wan 2.1 I2V "
                "or Wan 2.2 I2V A14B folder"
            )
        super().check_version()
        if not self.uses_image_encoder:
            return
        if not self.folder.has("image_encoder"):
            raise ConfigError(
                f"pipeline.pretrained: {self.denoiser} has an image_dim (Wan 2.1 I2V) but "
                f"{where} names no image_encoder; give the folder as saved (its CLIP vision "
                "encoder) or [models.image_encoder] weights"
            )
        length = self.config.pipeline.max_prompt_length
        if length != TEXT_TOKENS:
            raise ConfigError(
                f"pipeline.max_prompt_length = {length}: Wan I2V's transformer takes the last "
                f"{TEXT_TOKENS} context tokens as the prompt's and the rest as the image's; "
                f"set max_prompt_length = {TEXT_TOKENS} (or remove it)"
            )

    @cached_property
    def image_processor(self) -> Any:
        """The folder's CLIP image processor (PIL backend, no torchvision)."""
        return load_image_processor(self.folder.root)

    def fingerprint_source(self, name: str) -> dict[str, Any]:
        """As the base's; the image encoder's includes its processor's config (it decides the
        embeddings)."""
        source = super().fingerprint_source(name)
        if name == "image_encoder":
            processor = self.folder.root / "image_processor" / "preprocessor_config.json"
            source["files"] = [*source["files"], str(processor)]
        return source

    # -- units -----------------------------------------------------------------------------------
    def units(self) -> list[RunnableUnit]:
        """Wan's units, then (V2) `ImageEncoder` (Wan 2.1) and `ConditionEncoder` after the
        VAE encoder."""
        units = super().units()  # checks the folder's version first (latent_sampler)
        extra = []
        if self.uses_image_encoder:
            spec = Unit(
                "ImageEncoder",
                ("reference_image",),
                output_params=("image_embeds",),
                onload_model_names=("image_encoder",),
            )
            extra.append(RunnableUnit(spec, make_image_embedder(self.image_processor)))
        spec = Unit(
            "ConditionEncoder",
            ("reference_image", "video"),
            output_params=("condition_latents",),
            onload_model_names=("vae",),
        )
        extra.append(RunnableUnit(spec, make_condition_encoder(self.vae_config)))
        at = next(i for i, unit in enumerate(units) if unit.spec.name == "VAEEncoder") + 1
        return [*units[:at], *extra, *units[at:]]

    # -- data ------------------------------------------------------------------------------------
    def load_sample(self, row: Row, base_path: str | Path | DataSource) -> dict[str, Any]:
        """Wan's clip sample, and `reference_image` [3, H, W]: the row's `edit_image` at the
        clip's size, else the clip's first frame."""
        sample = super().load_sample(row, base_path)
        target = (sample["height"], sample["width"])
        references = load_references(row, base_path, self.reference_images, target)
        first = references[0] if references else sample["video"][0]
        return sample | {"reference_image": first}

    # -- the training step -----------------------------------------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Wan's flow matching, the transformer fed cat([x_t, condition_latents]) on the
        channel dim (and the CLIP image embeddings); the target is the clip's latents' only."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        condition = inputs["condition_latents"].to(ctx.device, dtype)
        kwargs = {
            "hidden_states": torch.cat([draw["latents"].to(dtype), condition], dim=1),
            "timestep": draw["timestep"],
            "encoder_hidden_states": inputs["prompt_embeds"].to(ctx.device, dtype),
        }
        if self.uses_image_encoder:
            kwargs["encoder_hidden_states_image"] = inputs["image_embeds"].to(ctx.device, dtype)
        return TrainingStep((), draw["target"], draw["weight"], kwargs)

    # -- validation sampling ---------------------------------------------------------------------
    def check_sampling(self) -> None:
        """As Wan's (the VAE is there, no Wan 2.2 expert alone), and each validation prompt has
        its first frame in `validation.reference_images`."""
        super().check_sampling()
        if not self.config.validation.reference_images:
            raise ConfigError(
                "validation.reference_images: the wan_i2v family samples each clip from a first "
                "frame; give each of validation.prompts one image in validation.reference_images"
            )

    def reference_models(self) -> list[str]:
        """The VAE (condition latents) and, for Wan 2.1, the CLIP image encoder."""
        return sorted({"vae", *(("image_encoder",) if self.uses_image_encoder else ())})

    def reference_conditioning(self, ctx: StepContext, images, prompts) -> dict[str, torch.Tensor]:
        """What WanImageToVideoPipeline conditions every prompt's clip on (its negative's alike):
        each first frame's condition latents (mask + latents of the frame and zeros, for
        `[data.video] num_frames`) and, for Wan 2.1, its CLIP image embeddings."""
        first = torch.stack([one for (one,) in images])
        frames = self.config.data.video.num_frames
        out = {"condition_latents": condition_latents(ctx, self.vae_config, first, frames)}
        if self.uses_image_encoder:
            out |= make_image_embedder(self.image_processor)(ctx, first)
        return out
