"""The demo family: its units, the DiT's flow-matching step, and its models, on the seam.

Units (in order): ShapeCheck, PromptEmbedder (text encoder), ImageEncoder (VAE), CaptionDropout
(per-step). The denoiser (`model_fn`) is a small DiT trained with a flow-matching loss. Training the
DiT caches prompt embeddings and latents; training the text encoder moves PromptEmbedder into V1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitstage.config.job import ConfigError, ModelConfig
from splitstage.data.dataset import DataError, Row, load_sample
from splitstage.pipelines.demo.dit import DiT, dit_module_fqns, prune_to_stage
from splitstage.pipelines.demo.text import (
    encode_prompts,
    load_text_encoder,
    load_tiny_text_encoder,
    meta_text_encoder,
    text_encoder_path,
)
from splitstage.pipelines.demo.vae import VAEEncoder
from splitstage.pipelines.demo.weight_files import load_weights, weights_config
from splitstage.pipelines.family import Family, TrainingStep, input_dtype, require_file
from splitstage.pipelines.flow_matching import (
    add_noise,
    flow_matching_target,
    sample_noise,
    sample_timesteps,
)
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.pipelines.sampling_common import flow_euler, guided, linear_sigmas
from splitstage.splitter import Pipeline, Unit

STEP_PARAMS = ("latents", "timestep", "noise")
TEXT_ENCODER_BUILDERS = ("minilm", "tiny")
WEIGHTS_HINT = "fix the path or run `splitstage demo-weights`"


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
    draw = ctx.draws.rand(count)
    drop = (draw < chance).to(prompt_emb.device)
    emb = torch.where(drop[:, None, None], empty_prompt_emb.to(prompt_emb), prompt_emb)
    mask = torch.where(drop[:, None], empty_prompt_mask.to(prompt_mask), prompt_mask)
    return {"prompt_emb": emb, "prompt_mask": mask}


UNITS = (
    RunnableUnit(
        Unit("ShapeCheck", ("height", "width"), output_params=("height", "width")), shape_check
    ),
    RunnableUnit(
        Unit(
            "PromptEmbedder",
            input_params_posi={"prompt": "prompt"},
            output_params=("prompt_emb", "prompt_mask", "empty_prompt_emb", "empty_prompt_mask"),
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
)


class DemoFamily(Family):
    """The demo text-to-image pipeline: MiniLM prompts, conv VAE latents, a DiT denoiser."""

    name = "demo"
    model_names = ("text_encoder", "vae", "dit")
    denoiser = "dit"
    # Column-shard the projections into heads / hidden units, row-shard the layers that bring
    # them back, so each block needs one all-reduce per half.
    tp_plans = {
        "dit": {
            "blocks.*.attn.to_q": "colwise",
            "blocks.*.attn.to_k": "colwise",
            "blocks.*.attn.to_v": "colwise",
            "blocks.*.attn.to_out": "rowwise",
            "blocks.*.mlp.fc1": "colwise",
            "blocks.*.mlp.fc2": "rowwise",
        }
    }

    def units(self) -> list[RunnableUnit]:
        """The demo's four units."""
        return list(UNITS)

    def pipeline_spec(self) -> Pipeline:
        """Units, the DiT's inputs, the loss's inputs, the step params."""
        return Pipeline(
            name="demo",
            units=tuple(unit.spec for unit in UNITS),
            model_fn_params=("latents", "timestep", "prompt_emb", "prompt_mask"),
            loss_params=("input_latents",),
            in_iteration_models=("dit",),
            step_params=STEP_PARAMS,
        )

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The image cropped to its square (or aspect bucket), its prompt and size."""
        return load_sample(row, base_path, self.image_size())

    def image_resolution(self) -> tuple[int, int]:
        """`image_size`; sides are multiples of 16 (VAE x8, patch x2)."""
        return self.config.pipeline.image_size, 16

    # -- models ----------------------------------------------------------------------------------
    def model_source(self, name: str) -> ModelConfig:
        """[models.NAME], defaulting the text encoder to the real MiniLM."""
        if name == "text_encoder" and name not in self.config.models:
            return ModelConfig(builder="minilm")
        return super().model_source(name)

    def check_models(self, names: Sequence[str]) -> None:
        """An existing weights file, or a known builder for the text encoder."""
        for name in names:
            self.require_known(name)
            source = self.model_source(name)
            if source.weights is not None:
                require_file(source.weights, f"models.{name}.weights", WEIGHTS_HINT)
            elif name != "text_encoder" or source.builder not in TEXT_ENCODER_BUILDERS:
                allowed = ", ".join(TEXT_ENCODER_BUILDERS) if name == "text_encoder" else "none"
                raise ConfigError(
                    f"models.{name}.builder: unknown builder {source.builder!r} (built-in "
                    f"builders for {name}: {allowed}); or give weights = "
                    f"'path/to/{name}.safetensors'"
                )

    def fingerprint_source(self, name: str) -> str | dict[str, Any]:
        """The weights file, the bundled MiniLM file, or the tiny builder's seed."""
        source = self.model_source(name)
        if source.builder == "minilm":
            return str(text_encoder_path() / "model.safetensors")
        return super().fingerprint_source(name)

    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        """Text encoder from its builder; VAE / DiT from their weights file (or on meta)."""
        self.require_known(name)
        source = self.model_source(name)
        if name == "text_encoder":
            self.check_models([name])
            if source.builder == "minilm" and meta:  # shapes only: no weights read
                encoder, tokenizer = meta_text_encoder()
            elif source.builder == "minilm":
                encoder, tokenizer = load_text_encoder(device)
            else:
                encoder, tokenizer = load_tiny_text_encoder(device, seed=self.config.job.seed)
            encoder.tokenizer = tokenizer
            return encoder
        if source.weights is None:
            raise ConfigError(f"models.{name}: give weights = 'path/to/{name}.safetensors'")
        require_file(source.weights, f"models.{name}.weights", WEIGHTS_HINT)
        cls = VAEEncoder if name == "vae" else DiT
        if meta:
            with torch.device("meta"):
                return cls(**weights_config(source.weights))
        model = cls(**weights_config(source.weights)).to(device)
        load_weights(model, source.weights)
        return model.eval().requires_grad_(False)

    def weights_file(self, name: str) -> tuple[str, str] | None:
        """The DiT's and VAE's files; the text encoder is built loaded by its builder."""
        return None if name == "text_encoder" else super().weights_file(name)

    # -- the training step ------------------------------------------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Flow matching: fresh noise, then timesteps, every step; velocity target."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        noise = sample_noise(x0, ctx.draws)
        timestep = sample_timesteps(x0.shape[0], ctx.draws, ctx.device)
        inputs.update(noise=noise, timestep=timestep, latents=add_noise(x0, noise, timestep))
        dtype = input_dtype(ctx.model(self.denoiser, "model_fn"))
        args = (
            inputs["latents"].to(dtype),
            inputs["timestep"].to(dtype),
            inputs["prompt_emb"].to(ctx.device, dtype),
            inputs["prompt_mask"].to(ctx.device),
        )
        return TrainingStep(args, flow_matching_target(noise.float(), x0.float()))

    # -- validation sampling ----------------------------------------------------------------------
    default_guidance = 3.0

    def decoder_path(self) -> Path:
        """[models.vae_decoder] weights, else vae_decoder.safetensors beside the VAE's file."""
        if "vae_decoder" in self.config.models and self.config.models["vae_decoder"].weights:
            return Path(self.config.models["vae_decoder"].weights)
        vae = self.model_source("vae").weights
        return Path(vae).with_name("vae_decoder.safetensors")

    def check_sampling(self) -> None:
        """The autoencoder's decoder file is there."""
        require_file(str(self.decoder_path()), "models.vae_decoder.weights", WEIGHTS_HINT)

    def load_decoder(self, device: torch.device) -> nn.Module:
        """The demo autoencoder's decoder (written by `splitstage demo-weights`)."""
        from splitstage.pipelines.demo.weight_files import load_decoder

        path = self.decoder_path()
        require_file(str(path), "models.vae_decoder.weights", WEIGHTS_HINT)
        return load_decoder(path).to(device).eval().requires_grad_(False)

    def decode(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Latents (scaled as the encoder gives them) -> images in [-1, 1]."""
        return decoder.decode(latents.to(next(decoder.parameters()).dtype))

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """Flow-matching Euler from seeded noise, classifier-free guided, in latent space (the
        DiT takes any latent grid of whole patches)."""
        dit = ctx.model(self.denoiser, "sample")
        dtype = input_dtype(dit)
        height, width = self.sample_size(size)
        down = VAEEncoder.downsample
        channels = weights_config(self.model_source("vae").weights)["latent_channels"]
        count = cond["prompt_emb"].shape[0]
        noise = torch.randn(count, channels, height // down, width // down, generator=generator)

        def velocity(x: torch.Tensor, t: torch.Tensor, conditional: bool) -> torch.Tensor:
            text = cond if conditional else uncond
            return dit(
                x.to(ctx.device, dtype),
                t.to(ctx.device, dtype),
                text["prompt_emb"].to(ctx.device, dtype),
                text["prompt_mask"].to(ctx.device),
            )

        return flow_euler(guided(velocity, guidance), noise.to(ctx.device), linear_sigmas(steps))

    # -- hooks ------------------------------------------------------------------------------------
    def check_gradient_checkpointing(self, name: str) -> None:
        """The DiT recomputes its blocks; the text encoder and the VAE cannot."""
        if name != "dit":
            super().check_gradient_checkpointing(name)

    def enable_gradient_checkpointing(self, name: str, model: nn.Module) -> None:
        """Each DiT block runs under `torch.utils.checkpoint` (non-reentrant) when training."""
        self.check_gradient_checkpointing(name)
        model.gradient_checkpointing = True

    def pp_module_fqns(self, model: nn.Module) -> list[str]:
        """patch_embed, time_embed, text_proj, blocks.0..N-1, norm, proj_out."""
        return dit_module_fqns(len(model.blocks))

    def pp_prune(self, model: nn.Module, keep_fqns: Sequence[str]) -> nn.Module:
        """Delete the DiT's modules outside one stage."""
        return prune_to_stage(model, keep_fqns)

    def pp_stage_has_work(self, fqns: Sequence[str]) -> bool:
        """A stage without a DiT block has nothing for LoRA to adapt and next to no work."""
        return any(f.startswith("blocks.") for f in fqns)

    def export_metadata(self, model_name: str, lora: bool) -> dict[str, str]:
        """A full export stores the architecture, so the file loads (or warm-starts) alone."""
        source = self.model_source(model_name)
        if lora or not source.weights:
            return {}
        return {"config": json.dumps(weights_config(source.weights), sort_keys=True)}
