"""`[pipeline]` groups of the diffusers families: sd, sdxl, sd3, flux, flux_kontext, qwenimage,
qwenimage_edit, wan, wan_i2v, zimage
(no torch)."""

from __future__ import annotations

import json
import math
from typing import ClassVar, Literal

from pydantic import model_validator

from splitstage.config.pipeline_group import PipelineConfig, setting

FAMILY_MODULE = "splitstage.pipelines.diffusers"
FlowWeighting = Literal["none", "logit_normal", "uniform", "mode", "sigma_sqrt", "cosmap"]
TRAINED_PREDICTIONS = ("epsilon", "v_prediction")  # the DDPM targets UNet training supports


class DiffusersPipelineConfig(PipelineConfig):
    """Settings every diffusers family shares: the folder, the image size, prompts, latents."""

    # Latents are 1/8 of the pixels; the transformer families patch 2x2 on top of that.
    pixel_multiple: ClassVar[int] = 8
    models_in_config: ClassVar[bool] = False  # components come from `pretrained`

    pretrained: str = setting(
        ...,
        stage1=False,  # the weights' content enters the cache key, not where they are
        min_length=1,
        description="A local diffusers folder (model_index.json + component subfolders).",
    )
    resolution: int = setting(
        512, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )
    caption_dropout: float = setting(
        0.0,
        stage1=False,
        ge=0.0,
        le=1.0,
        description="Per-step chance to train on the empty prompt's embeddings instead.",
    )
    precision: Literal["bf16", "fp16", "fp32"] = setting(
        "bf16",
        stage1=True,
        description="dtype the frozen components (text encoders, VAE) compute and the cache "
        "stores their outputs in, on every device (part of the cache key, so CPU and GPU "
        "workers fill one cache alike); the trained model follows train.mixed_precision.",
    )
    vae_latents: Literal["sample", "mean"] = setting(
        "sample",
        stage1=True,
        description="'sample': cache the VAE's latent distribution and draw a latent every step "
        "(as unsplit training does); 'mean': cache its mean only (half the latent storage).",
    )

    @model_validator(mode="after")
    def _resolution_multiple(self) -> DiffusersPipelineConfig:
        if self.resolution % self.pixel_multiple:
            raise ValueError(
                f"resolution: {self.resolution} is not a multiple of {self.pixel_multiple} "
                f"(the {self.name} VAE and denoiser need it); use "
                f"{self.resolution // self.pixel_multiple * self.pixel_multiple}"
            )
        return self


class UNetRecipe(DiffusersPipelineConfig):
    """DDPM training of a UNet (diffusers' train_text_to_image recipe)."""

    max_prompt_length: int = setting(
        77, stage1=True, ge=1, le=77, description="CLIP prompt tokens (77 at most)."
    )
    prediction_type: Literal["scheduler", "epsilon", "v_prediction"] = setting(
        "scheduler",
        stage1=False,
        description="Training target; 'scheduler': the scheduler config's prediction_type.",
    )
    min_snr_gamma: float | None = setting(
        None, stage1=False, gt=0, description="Min-SNR loss weighting gamma (5.0 is usual)."
    )
    noise_offset: float = setting(
        0.0, stage1=False, ge=0.0, le=1.0, description="Per-channel noise offset (e.g. 0.05)."
    )

    @model_validator(mode="after")
    def _scheduler_prediction(self) -> UNetRecipe:
        """prediction_type='scheduler' takes the folder's; refuse one training cannot use now,
        not in the training processes. An unreadable folder is left to the folder's checks."""
        if self.prediction_type != "scheduler":
            return self
        from splitstage.config.base_group import ConfigError
        from splitstage.pipelines.diffusers.folder import resolve_pretrained

        try:
            path = resolve_pretrained(self.pretrained) / "scheduler" / "scheduler_config.json"
            chosen = json.loads(path.read_text()).get("prediction_type", "epsilon")
        except (ConfigError, OSError, ValueError, AttributeError):
            return self
        if chosen not in TRAINED_PREDICTIONS:
            raise ValueError(
                f"prediction_type: 'scheduler' takes {path}'s prediction_type {chosen!r}, which "
                "training does not support; set pipeline.prediction_type = 'epsilon' or "
                "'v_prediction' (the one the model was trained with)"
            )
        return self


class FlowRecipe(DiffusersPipelineConfig):
    """Flow-matching training of a transformer (diffusers' SD3 / FLUX DreamBooth recipes)."""

    pixel_multiple: ClassVar[int] = 16

    max_prompt_length: int = setting(
        256, stage1=True, ge=1, le=512, description="T5 prompt tokens (CLIP always takes 77)."
    )
    weighting_scheme: FlowWeighting = setting(
        "logit_normal",
        stage1=False,
        description="Timestep density and loss weighting (diffusers' training_utils names).",
    )
    logit_mean: float = setting(0.0, stage1=False, description="logit_normal density mean.")
    logit_std: float = setting(1.0, stage1=False, gt=0, description="logit_normal density std.")
    mode_scale: float = setting(1.29, stage1=False, description="'mode' density scale.")


class SDPipelineConfig(UNetRecipe):
    """Stable Diffusion 1.x / 2.x: CLIP text encoder, UNet, DDPM (epsilon or v-prediction)."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.sd:SDFamily"
    name: Literal["sd"] = "sd"


class SDXLPipelineConfig(UNetRecipe):
    """Stable Diffusion XL: two CLIP encoders, the pooled embedding and size/crop time ids."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.sdxl:SDXLFamily"
    name: Literal["sdxl"] = "sdxl"
    resolution: int = setting(
        1024, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )


class SD3PipelineConfig(FlowRecipe):
    """Stable Diffusion 3 / 3.5: CLIP-L, CLIP-G and (optionally) T5; MMDiT; flow matching."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.sd3:SD3Family"
    name: Literal["sd3"] = "sd3"
    resolution: int = setting(
        1024, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )
    use_t5: bool = setting(
        True,
        stage1=True,
        description="Encode prompts with T5 too; false: zeros in its place (as SD3 allows).",
    )


class FluxPipelineConfig(FlowRecipe):
    """FLUX.1: CLIP pooled + T5 prompts, packed 2x2 latents, guidance embedding, flow matching."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.flux:FluxFamily"
    name: Literal["flux"] = "flux"
    resolution: int = setting(
        1024, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )
    max_prompt_length: int = setting(
        512, stage1=True, ge=1, le=512, description="T5 prompt tokens (CLIP always takes 77)."
    )
    weighting_scheme: FlowWeighting = setting(
        "none",
        stage1=False,
        description="Timestep density and loss weighting (diffusers' training_utils names).",
    )
    guidance_scale: float = setting(
        3.5, stage1=False, ge=0.0, description="Guidance the model is told (guidance-distilled)."
    )


class FluxKontextPipelineConfig(FluxPipelineConfig):
    """FLUX.1 Kontext: FLUX's settings; each row's reference image ('edit_image') is VAE-encoded
    in stage 1 at its target's size and conditions the transformer beside the noisy latents."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.flux_kontext:FluxKontextFamily"
    name: Literal["flux_kontext"] = "flux_kontext"  # type: ignore[assignment]


class QwenImagePipelineConfig(FlowRecipe):
    """Qwen-Image: Qwen2.5-VL prompts + mask, video VAE, packed MMDiT, shifted flow matching.

    The VAE's latents are normalised per channel (latents_mean / latents_std); timesteps come
    from the scheduler's table shifted for the image's token count."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.qwenimage:QwenImageFamily"
    name: Literal["qwenimage"] = "qwenimage"
    resolution: int = setting(
        1024, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )
    max_pixels: int | None = setting(
        None,
        stage1=True,
        ge=64 * 64,
        description="Pixels per image (the source text's max_pixels), instead of resolution: "
        "the aspect buckets' area when [data.buckets] is on (unless data.buckets.area is set), "
        "else the square of side isqrt(max_pixels) rounded down to a multiple of 16.",
    )
    max_prompt_length: int = setting(
        512,
        stage1=True,
        ge=1,
        le=1024,
        description="Prompt tokens after the template's system prefix (QwenImagePipeline's "
        "max_sequence_length); embeddings are cached padded to it, with their mask.",
    )
    weighting_scheme: FlowWeighting = setting(
        "none",
        stage1=False,
        description="Timestep density and loss weighting (diffusers' training_utils names).",
    )
    dynamic_shift: bool = setting(
        True,
        stage1=False,
        description="Draw timesteps from the scheduler's table shifted for each image's token "
        "count (calculate_shift, as QwenImagePipeline samples); false: its unshifted table, "
        "as diffusers' train_dreambooth_lora_qwen_image.",
    )

    @model_validator(mode="after")
    def _one_size(self) -> QwenImagePipelineConfig:
        if self.max_pixels is not None and "resolution" in self.model_fields_set:
            raise ValueError(
                "max_pixels and resolution both give the image size; remove pipeline.resolution "
                "(max_pixels is the area) or pipeline.max_pixels"
            )
        return self

    def square_side(self) -> int:
        """The square side images train at without buckets: resolution, or from max_pixels."""
        if self.max_pixels is None:
            return self.resolution
        return max(math.isqrt(self.max_pixels) // self.pixel_multiple * self.pixel_multiple, 64)


class QwenImageEditPipelineConfig(QwenImagePipelineConfig):
    """Qwen-Image-Edit (QwenImageEditPipeline, one reference) and Qwen-Image-Edit-2509
    (QwenImageEditPlusPipeline, one or more): the folder's model_index decides which. Each row's
    reference images ('edit_image') are seen by Qwen2.5-VL with the prompt and VAE-encoded at
    their own size in stage 1; their latents follow the noisy latents in the transformer."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.qwenimage_edit:QwenImageEditFamily"
    name: Literal["qwenimage_edit"] = "qwenimage_edit"  # type: ignore[assignment]
    max_prompt_length: int = setting(
        2048,
        stage1=True,
        ge=1,
        le=16384,
        description="Tokens after the template's system prefix: the reference images' vision "
        "tokens and the prompt (the pipeline keeps them all); embeddings are cached padded to "
        "it, with their mask; a longer row is refused.",
    )
    reference_max_pixels: int = setting(
        1024 * 1024,
        stage1=True,
        ge=32 * 32,
        description="Area each reference image is resized to for the VAE, keeping its aspect "
        "ratio, sides multiples of 32 (the pipelines' VAE_IMAGE_SIZE / calculate_dimensions); "
        "QwenImageEditPipeline's Qwen2.5-VL sees this size too.",
    )
    condition_max_pixels: int = setting(
        384 * 384,
        stage1=True,
        ge=32 * 32,
        description="Area each reference image is resized to for Qwen2.5-VL in "
        "QwenImageEditPlusPipeline (its CONDITION_IMAGE_SIZE).",
    )


class WanPipelineConfig(FlowRecipe):
    """Wan 2.1 text-to-video (and one expert of Wan 2.2 A14B): UMT5 prompts, a causal 3D VAE
    normalised per channel, a video transformer, flow matching on the scheduler's shifted sigmas.

    Clips come from `[data.video]` (image rows train as one-frame clips); the frame settings are
    in the cache key with this group's stage-1 settings."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.wan:WanFamily"
    video_rows: ClassVar[str] = "'wan'"
    name: Literal["wan"] = "wan"
    resolution: int = setting(
        480,
        stage1=True,
        ge=64,
        le=8192,
        description="Frames are center-cropped to this square (or to their [data.buckets] size).",
    )
    max_prompt_length: int = setting(
        512,
        stage1=True,
        ge=1,
        le=1024,
        description="UMT5 prompt tokens (WanPipeline's max_sequence_length, 512); embeddings are "
        "cached padded with zeros to it, as the pipeline pads them.",
    )
    weighting_scheme: FlowWeighting = setting(
        "none",
        stage1=False,
        description="Timestep density and loss weighting (diffusers' training_utils names); "
        "'none': uniform over the shifted table.",
    )
    flow_shift: float | None = setting(
        None,
        stage1=False,
        gt=0,
        description="Sigma shift of the training timesteps; unset: the scheduler config's "
        "flow_shift (UniPC) or shift (FlowMatchEuler): 3.0 for 480p, 5.0 for 720p.",
    )
    expert: Literal["high_noise", "low_noise"] | None = setting(
        None,
        stage1=False,
        description="Wan 2.2 A14B folders (transformer + transformer_2, boundary_ratio): the "
        "expert to train: 'high_noise' = transformer on t >= boundary_ratio * 1000, "
        "'low_noise' = transformer_2 below it (set trainable.lora_base_model to match).",
    )


class WanI2VPipelineConfig(WanPipelineConfig):
    """Wan image-to-video (Wan 2.1 I2V with CLIP, or one Wan 2.2 I2V A14B expert): Wan's settings;
    each clip is conditioned on its first frame, or on the row's 'edit_image' (one image), whose
    CLIP embeddings and condition latents stage 1 caches."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.wan_i2v:WanI2VFamily"
    video_rows: ClassVar[str] = "'wan_i2v'"
    name: Literal["wan_i2v"] = "wan_i2v"  # type: ignore[assignment]


class ZImagePipelineConfig(FlowRecipe):
    """Z-Image: Qwen3 prompts (chat template, unpadded), FLUX's VAE scaling, a single-stream DiT
    on per-sample latents, flow matching on the scheduler's (shifted) table."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.zimage:ZImageFamily"
    name: Literal["zimage"] = "zimage"
    resolution: int = setting(
        1024, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )
    max_prompt_length: int = setting(
        512,
        stage1=True,
        ge=1,
        le=1024,
        description="Prompt tokens with the chat template around them (ZImagePipeline's "
        "max_sequence_length); embeddings are cached padded to it, with their mask.",
    )
    weighting_scheme: FlowWeighting = setting(
        "none",
        stage1=False,
        description="Timestep density and loss weighting (diffusers' training_utils names); "
        "'none' as diffusers' train_dreambooth_lora_z_image.",
    )


class Flux2PipelineConfig(FlowRecipe):
    """FLUX.2: Mistral 3 prompts (three layers stacked), a batch-norm-normalised VAE in 2x2
    patches, packed tokens with 4-D ids, guidance embedding, flow matching."""

    family_class: ClassVar[str] = f"{FAMILY_MODULE}.flux2:Flux2Family"
    name: Literal["flux2"] = "flux2"
    resolution: int = setting(
        1024, stage1=True, ge=64, le=8192, description="Images are center-cropped to this square."
    )
    max_prompt_length: int = setting(
        512,
        stage1=True,
        ge=1,
        le=2048,
        description="Prompt tokens with the chat template and system message (Flux2Pipeline's "
        "max_sequence_length); embeddings are cached padded to it, as the pipeline passes them.",
    )
    weighting_scheme: FlowWeighting = setting(
        "none",
        stage1=False,
        description="Timestep density and loss weighting (diffusers' training_utils names).",
    )
    guidance_scale: float = setting(
        3.5,
        stage1=False,
        ge=0.0,
        description="Guidance the model is told (guidance-distilled), as diffusers' "
        "train_dreambooth_lora_flux2 --guidance_scale.",
    )
