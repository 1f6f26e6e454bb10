"""The demo text-to-image pipeline as units: the splitter decides what is cached, what is trained.

Units (in order): ShapeCheck, PromptEmbedder (text encoder), ImageEncoder (VAE), CaptionDropout
(per-step). The denoiser (`model_fn`) is a small DiT trained with a flow-matching loss. Training the
DiT caches prompt embeddings and latents; training the text encoder moves PromptEmbedder into V1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from splitstage.pipelines.config import ConfigError, ModelConfig, SplitstageConfig
from splitstage.pipelines.data import DataError
from splitstage.pipelines.models import (
    DiT,
    VAEEncoder,
    add_noise,
    encode_prompts,
    flow_matching_loss,
    load_text_encoder,
    load_tiny_text_encoder,
    load_weights,
    sample_noise,
    sample_timesteps,
    weights_config,
)
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Pipeline, Unit

MODEL_NAMES = ("text_encoder", "vae", "dit")
DATA_FIELDS = ("image", "prompt", "height", "width")
STEP_PARAMS = ("latents", "timestep", "noise")
PROMPT_PARAMS = ("prompt_emb", "prompt_mask", "empty_prompt_emb", "empty_prompt_mask")
# Tensor-parallel plans (FQN pattern -> style): column-shard the projections into heads / hidden
# units, row-shard the layers that bring them back, so each block needs one all-reduce per half.
TP_PLANS = {
    "dit": {
        "blocks.*.attn.to_q": "colwise",
        "blocks.*.attn.to_k": "colwise",
        "blocks.*.attn.to_v": "colwise",
        "blocks.*.attn.to_out": "rowwise",
        "blocks.*.mlp.fc1": "colwise",
        "blocks.*.mlp.fc2": "rowwise",
    }
}


def shape_check(ctx: StepContext, height: list[int], width: list[int]) -> dict[str, Any]:
    """Refuse sizes the VAE (x8) and the DiT patches (x2) cannot take."""
    for h, w in zip(height, width):
        if h % 16 or w % 16:
            raise DataError(
                f"image size {h}x{w} is not a multiple of 16; set pipeline.image_size to one"
            )
    return {"height": height, "width": width}


def embed_prompts(ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
    """Token embeddings of each prompt and of the empty prompt (for caption dropout)."""
    encoder = ctx.model("text_encoder", "PromptEmbedder")
    length = ctx.settings["max_prompt_length"]
    emb, mask = encode_prompts(encoder, encoder.tokenizer, list(prompt), length)
    empty, empty_mask = encode_prompts(encoder, encoder.tokenizer, [""], length)
    count = len(prompt)
    return {
        "prompt_emb": emb,
        "prompt_mask": mask,
        "empty_prompt_emb": empty.expand(count, -1, -1),
        "empty_prompt_mask": empty_mask.expand(count, -1),
    }


def encode_images(
    ctx: StepContext, image: torch.Tensor, height: list[int], width: list[int]
) -> dict[str, Any]:
    """VAE latents of the images (deterministic: the mean, so caching them is exact)."""
    vae = ctx.model("vae", "ImageEncoder")
    dtype = next(vae.parameters()).dtype
    return {"input_latents": vae(image.to(ctx.device, dtype))}


def drop_captions(
    ctx: StepContext,
    prompt_emb: torch.Tensor,
    prompt_mask: torch.Tensor,
    empty_prompt_emb: torch.Tensor,
    empty_prompt_mask: torch.Tensor,
) -> dict[str, Any]:
    """Per step, swap each prompt for the empty prompt with probability caption_dropout."""
    chance = ctx.settings["caption_dropout"]
    count = prompt_emb.shape[0]
    draw = torch.rand(count, generator=ctx.generator, device=ctx.generator.device)
    drop = (draw < chance).to(prompt_emb.device)
    emb = torch.where(drop[:, None, None], empty_prompt_emb.to(prompt_emb), prompt_emb)
    mask = torch.where(drop[:, None], empty_prompt_mask.to(prompt_mask), prompt_mask)
    return {"prompt_emb": emb, "prompt_mask": mask}


def units() -> list[RunnableUnit]:
    """The demo pipeline's units with their DiffSynth-style declarations."""
    return [
        RunnableUnit(
            Unit("ShapeCheck", ("height", "width"), output_params=("height", "width")),
            shape_check,
        ),
        RunnableUnit(
            Unit(
                "PromptEmbedder",
                input_params_posi={"prompt": "prompt"},
                output_params=(
                    "prompt_emb",
                    "prompt_mask",
                    "empty_prompt_emb",
                    "empty_prompt_mask",
                ),
                onload_model_names=("text_encoder",),
            ),
            embed_prompts,
        ),
        RunnableUnit(
            Unit(
                "ImageEncoder",
                ("image", "height", "width"),
                output_params=("input_latents",),
                onload_model_names=("vae",),
            ),
            encode_images,
        ),
        RunnableUnit(
            Unit(
                "CaptionDropout",
                ("prompt_emb", "prompt_mask", "empty_prompt_emb", "empty_prompt_mask"),
                output_params=("prompt_emb", "prompt_mask"),
                per_step=True,
            ),
            drop_captions,
        ),
    ]


def pipeline_spec() -> Pipeline:
    """What the splitter sees: units, denoiser and loss params, in-iteration models."""
    return Pipeline(
        name="demo",
        units=tuple(unit.spec for unit in units()),
        model_fn_params=("latents", "timestep", "prompt_emb", "prompt_mask"),
        loss_params=("input_latents",),
        in_iteration_models=("dit",),
        step_params=STEP_PARAMS,
    )


def settings(config: SplitstageConfig) -> dict[str, Any]:
    """Pipeline settings the units read (part of the cache key where stage 1 uses them)."""
    return {
        "max_prompt_length": config.pipeline.max_prompt_length,
        "caption_dropout": config.pipeline.caption_dropout,
        "image_size": config.pipeline.image_size,
    }


def stage1_settings(config: SplitstageConfig) -> dict[str, Any]:
    """Settings that change V2 outputs (caption dropout is per step, so it is not one)."""
    return {
        "max_prompt_length": config.pipeline.max_prompt_length,
        "image_size": config.pipeline.image_size,
    }


def model_source(config: SplitstageConfig, name: str) -> ModelConfig:
    """The [models.NAME] entry, with defaults for the demo (real MiniLM, weights under runs/)."""
    if name in config.models:
        return config.models[name]
    if name == "text_encoder":
        return ModelConfig(builder="minilm")
    raise ConfigError(
        f"model '{name}' has no [models.{name}] entry; add weights = 'path/to/{name}.safetensors'"
    )


def build_model(
    config: SplitstageConfig,
    name: str,
    device: torch.device,
    *,
    load: bool = True,
) -> torch.nn.Module:
    """Build one model; load=False builds on the meta device (stage 2 loads after sharding)."""
    source = model_source(config, name)
    if name == "text_encoder":
        if source.builder == "minilm":
            encoder, tokenizer = load_text_encoder(device)
        elif source.builder == "tiny":
            encoder, tokenizer = load_tiny_text_encoder(device, seed=config.job.seed)
        else:
            raise ConfigError(
                f"models.text_encoder.builder: unknown builder {source.builder!r}; use 'minilm' "
                "(the real all-MiniLM-L6-v2) or 'tiny' (random weights, for tests)"
            )
        encoder.tokenizer = tokenizer
        return encoder
    if source.weights is None:
        raise ConfigError(f"models.{name}: give weights = 'path/to/{name}.safetensors'")
    cls = {"vae": VAEEncoder, "dit": DiT}.get(name)
    if cls is None:
        raise ConfigError(
            f"models.{name}: the demo pipeline has no model '{name}'; its models are "
            f"{', '.join(MODEL_NAMES)}"
        )
    require_weights_file(source.weights, f"models.{name}.weights")
    if not load:
        with torch.device("meta"):
            return cls(**weights_config(source.weights))
    model = cls(**weights_config(source.weights)).to(device)
    load_weights(model, source.weights)
    return model.eval().requires_grad_(False)


def require_weights_file(path: str, field_name: str) -> None:
    """A clear error for a weights file that is not there."""
    if not Path(path).is_file():
        raise ConfigError(
            f"{field_name}: file {path} does not exist; fix the path or run "
            "`splitstage demo-weights`"
        )


TEXT_ENCODER_BUILDERS = ("minilm", "tiny")


def check_models(config: SplitstageConfig, names: Sequence[str] = MODEL_NAMES) -> None:
    """Every named model has a usable source: an existing weights file or a known builder."""
    for name in names:
        if name not in MODEL_NAMES:
            raise ConfigError(
                f"models.{name}: the demo pipeline has no model '{name}'; its models are "
                f"{', '.join(MODEL_NAMES)}"
            )
        source = model_source(config, name)
        if source.weights is not None:
            require_weights_file(source.weights, f"models.{name}.weights")
        elif name != "text_encoder" or source.builder not in TEXT_ENCODER_BUILDERS:
            allowed = ", ".join(TEXT_ENCODER_BUILDERS) if name == "text_encoder" else "none"
            raise ConfigError(
                f"models.{name}.builder: unknown builder {source.builder!r} (built-in builders "
                f"for {name}: {allowed}); or give weights = 'path/to/{name}.safetensors'"
            )


def model_fn(ctx: StepContext, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The denoiser: velocity prediction for noisy latents at timestep t given the prompt."""
    dit = ctx.model("dit", "model_fn")
    dtype = next(dit.parameters()).dtype
    return dit(
        inputs["latents"].to(dtype),
        inputs["timestep"].to(dtype),
        inputs["prompt_emb"].to(ctx.device, dtype),
        inputs["prompt_mask"].to(ctx.device),
    )


def training_loss(ctx: StepContext, inputs: dict[str, Any]) -> torch.Tensor:
    """Flow matching: fresh noise and timesteps every step (the step params), then MSE velocity."""
    x0 = inputs["input_latents"].to(ctx.device, torch.float32)
    noise = sample_noise(x0, ctx.generator)
    timestep = sample_timesteps(x0.shape[0], ctx.generator, ctx.device)
    inputs.update(noise=noise, timestep=timestep, latents=add_noise(x0, noise, timestep))
    return flow_matching_loss(model_fn(ctx, inputs), noise, x0)
