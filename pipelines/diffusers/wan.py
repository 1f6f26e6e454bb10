"""Wan 2.1 text-to-video and one expert of Wan 2.2 A14B (WanPipeline folders): UMT5 prompt
embeddings, a causal 3D VAE normalised per channel, WanTransformer3DModel, flow matching on sigmas
shifted by the scheduler's shift.

Stage 1 caches the prompt embeddings (zero-padded to max_prompt_length, as the pipeline pads them)
and each clip's VAE latent distribution ((frames - 1) / 4 + 1 latent frames); every step draws a
latent, normalises it with latents_mean / latents_std, drops captions, draws noise and a timestep.
Wan 2.2 A14B's folders (transformer_2, boundary_ratio) train the expert `pipeline.expert` names
on its part of the timesteps; TI2V (expand_timesteps) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.data.clips import load_clip_sample
from splitstage.data.dataset import Row
from splitstage.data.source import DataSource
from splitstage.data.videos import video_key_settings
from splitstage.pipelines.diffusers.component_shapes import link
from splitstage.pipelines.diffusers.mmdit import FlowTransformerFamily
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.diffusers.text import split_empty, with_empty
from splitstage.pipelines.diffusers.wan_latents import (
    decode_clips,
    encode_clips,
)
from splitstage.pipelines.diffusers.wan_lora import wan_lora_files
from splitstage.pipelines.diffusers.wan_sampling import wan_sample
from splitstage.pipelines.diffusers.wan_text import encode_prompts
from splitstage.pipelines.diffusers.wan_vae_norm import make_normalising_sampler, require_stats
from splitstage.pipelines.family import ExportRequest, TrainingStep
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling_common import filmstrip

# DiffSynth-Studio's Wan LoRA targets (q, k, v, o, ffn.0, ffn.2) by diffusers' module names: both
# attentions (self and text) and the feed-forward of every block.
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
# diffusers has no _tp_plan for Wan; its attentions normalise q and k over all heads at once
# (RMSNorm across heads), so a head-sharded q/k would be normalised wrongly. Only the
# feed-forward is sharded (Megatron-style); attention stays replicated.
WAN_TP = {"blocks.*.ffn.net.0.proj": "colwise", "blocks.*.ffn.net.2": "rowwise"}


def expert_table(timesteps: torch.Tensor, sigmas: torch.Tensor) -> SimpleNamespace:
    """A training table of just these (timestep, sigma) rows, as flow_draw reads a scheduler:
    its draws spread uniformly (or by weighting_scheme) over one expert's rows."""
    config = SimpleNamespace(num_train_timesteps=len(timesteps))
    return SimpleNamespace(config=config, timesteps=timesteps, sigmas=sigmas)


class WanFamily(FlowTransformerFamily):
    """Wan 2.1 text-to-video, or one Wan 2.2 A14B expert (WanPipeline folders)."""

    name = "wan"
    default_guidance = 5.0  # WanPipeline's guidance_scale
    pipeline_classes = ("WanPipeline",)
    text_params = ("prompt_embeds",)
    text_models = ("text_encoder",)
    denoiser_params = ("prompt_embeds",)
    default_lora_targets = WAN_LORA_TARGETS
    tp_plans = {"transformer": WAN_TP, "transformer_2": WAN_TP}
    shape_links = tuple(
        one
        for expert in ("transformer", "transformer_2")
        for one in (
            link([("text_encoder", "d_model")], (expert, "text_dim"), "UMT5's hidden states"),
            link([("vae", "z_dim")], (expert, "in_channels"), "the VAE's latents"),
            link([("vae", "z_dim")], (expert, "out_channels"), "predictions of the VAE's latents"),
        )
    )

    # -- units -----------------------------------------------------------------------------------
    pixel_param = "video"

    def pixel_encoder(self):
        """Clips [B, F, 3, H, W] through AutoencoderKLWan."""
        return encode_clips

    def latent_sampler(self):
        """Latents normalised per channel; the folder is a Wan version this family trains and
        its VAE config has the statistics."""
        self.check_version()
        require_stats(
            self.vae_config,
            f"{self.folder.root}/vae/config.json",
            "AutoencoderKLWan config saved with Wan 2.1",
        )
        return make_normalising_sampler(self.vae_config)

    @property
    def two_experts(self) -> bool:
        """Whether the folder is Wan 2.2 A14B's (a low-noise transformer_2, a boundary_ratio)."""
        return self.folder.has("transformer_2") or self.boundary_ratio is not None

    @property
    def boundary_ratio(self) -> float | None:
        """model_index.json's boundary_ratio: where the high-noise expert hands over."""
        ratio = self.folder.index.get("boundary_ratio")
        return None if ratio is None else float(ratio)

    @property
    def denoiser(self) -> str:
        """The transformer trained: `transformer_2` for Wan 2.2's low-noise expert."""
        return "transformer_2" if self.config.pipeline.expert == "low_noise" else "transformer"

    @property
    def model_names(self) -> tuple[str, ...]:
        """The models a run calls: the encoders and the one transformer trained."""
        return ("text_encoder", "vae", self.denoiser)

    def check_version(self) -> None:
        """Wan 2.1 T2V, or one chosen expert of Wan 2.2 A14B: a second expert or per-token
        timesteps would train wrongly without a word, so they are refused by the field to set."""
        index, expert = self.folder.index, self.config.pipeline.expert
        where = f"{self.folder.root}/model_index.json"
        if index.get("expand_timesteps"):
            raise ConfigError(
                f"pipeline.pretrained: {where} sets expand_timesteps (Wan 2.2 TI2V's per-token "
                "timesteps), which splitstage does not train; give a Wan 2.1 T2V or Wan 2.2 "
                "A14B T2V folder"
            )
        if not self.two_experts:
            if expert is not None:
                raise ConfigError(
                    f"pipeline.expert = {expert!r}: {where} has one transformer (Wan 2.1); "
                    "remove pipeline.expert"
                )
            return
        if not (self.folder.has("transformer_2") and self.boundary_ratio is not None):
            raise ConfigError(
                f"pipeline.pretrained: {where} names only one of transformer_2 / boundary_ratio; "
                "give the Wan 2.2 A14B folder as saved (both)"
            )
        if expert is None:
            raise ConfigError(
                f"pipeline.expert: {where} is Wan 2.2 with two experts (boundary_ratio "
                f"{self.boundary_ratio:g}); set pipeline.expert = 'high_noise' (transformer) or "
                "'low_noise' (transformer_2), and trainable.lora_base_model to that component"
            )
        trained = self.config.trainable.models()
        if trained != [self.denoiser]:
            raise ConfigError(
                f"trainable.lora_base_model: pipeline.expert = {expert!r} trains "
                f"{self.denoiser!r}; set trainable.lora_base_model = {self.denoiser!r}"
            )

    def stage1_settings(self) -> dict[str, Any]:
        """The `[pipeline]` stage-1 settings and the `[data.video]` frame settings (which frames
        stage 1 decodes changes the cached latents)."""
        return {**super().stage1_settings(), **video_key_settings(self.config.data.video)}

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """Embeddings [B, L, D] of the prompts and of '' (caption dropout)."""
        encoder = ctx.model("text_encoder", "PromptEncoder")
        length = self.config.pipeline.max_prompt_length
        tokenizer = self.tokenizer("text_encoder")
        embeds = encode_prompts(encoder, tokenizer, with_empty(prompt), length, ctx.device)
        return split_empty({"prompt_embeds": embeds}, len(prompt))

    # -- data ------------------------------------------------------------------------------------
    def load_sample(self, row: Row, base_path: str | Path | DataSource) -> dict[str, Any]:
        """A video row's `[data.video]` clip (an image row: a one-frame clip) as `video`
        [frames, 3, H, W] in [-1, 1], cropped to the resolution or its bucket, and its prompt."""
        return load_clip_sample(
            row, base_path, settings=self.config.data.video, size=self.image_size()
        )

    @property
    def vae_scale(self) -> int:
        """Pixels per latent along a side (WanPipeline's vae_scale_factor_spatial)."""
        return int(self.vae_config.get("scale_factor_spatial", 8))

    # -- the training step -----------------------------------------------------------------------
    @property
    def flow_shift(self) -> float:
        """pipeline.flow_shift, else the scheduler config's flow_shift (UniPC) or shift."""
        chosen = self.config.pipeline.flow_shift
        if chosen is not None:
            return float(chosen)
        config = self.scheduler_config
        return float(config.get("flow_shift") or config.get("shift") or 1.0)

    @cached_property
    def noise_scheduler(self):
        """FlowMatchEulerDiscreteScheduler's 1000-step table shifted by flow_shift (the sigmas
        WanPipeline's scheduler samples along); for a Wan 2.2 expert, the part of it that
        expert denoises (high noise: t >= boundary_ratio * 1000, low noise: below)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = int(self.scheduler_config.get("num_train_timesteps", 1000))
        table = FlowMatchEulerDiscreteScheduler(num_train_timesteps=steps, shift=self.flow_shift)
        if self.config.pipeline.expert is None:
            return table
        boundary = self.boundary_ratio * steps
        high = table.timesteps >= boundary
        keep = high if self.config.pipeline.expert == "high_noise" else ~high
        return expert_table(table.timesteps[keep], table.sigmas[: len(keep)][keep])

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """x_t = (1 - sigma) x0 + sigma noise on [B, C, F', h, w] latents, t = 1000 sigma from
        the shifted table; target noise - x0; the timestep stays float32 (the time embedding
        is kept in fp32 by diffusers)."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        kwargs = {
            "hidden_states": draw["latents"].to(dtype),
            "timestep": draw["timestep"],
            "encoder_hidden_states": inputs["prompt_embeds"].to(ctx.device, dtype),
        }
        return TrainingStep((), draw["target"], draw["weight"], kwargs)

    # -- hooks -----------------------------------------------------------------------------------
    def tp_prepare(self, model: nn.Module, tp_degree: int) -> None:
        """Nothing: only the feed-forward is sharded, the attention heads stay whole."""

    def check_sampling(self) -> None:
        """The VAE is there; a Wan 2.2 expert cannot sample alone (the other expert denoises
        the other part of every clip, and stage 2 loads only the trained one)."""
        super().check_sampling()
        if self.config.pipeline.expert is not None:
            raise ConfigError(
                f"validation.prompts: a Wan 2.2 expert ({self.config.pipeline.expert}) cannot "
                "sample clips without the other expert, which stage 2 does not load; remove "
                "the [validation] prompts"
            )

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """WanPipeline's loop: the folder's scheduler, classifier-free guidance, clips of
        `[data.video] num_frames` frames."""
        size = self.sample_size(size)
        frames = self.config.data.video.num_frames
        return wan_sample(
            self,
            ctx,
            cond,
            uncond,
            generator,
            steps=steps,
            guidance=guidance,
            size=size,
            frames=frames,
        )

    def decode_clips(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> clips [B, F, 3, H, W] in [-1, 1] (validation writes each as an
        animated WebP)."""
        return decode_clips(decoder, self.vae_config, latents)

    def decode(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> each clip as a filmstrip image (4 frames from first to last,
        side by side) in [-1, 1], for the validation grid."""
        return filmstrip(self.decode_clips(decoder, latents))

    def export_files(
        self, model_name: str, state: dict[str, torch.Tensor], request: ExportRequest
    ) -> dict[str, tuple[str, bytes]]:
        """A LoRA as diffusers' pytorch_lora_weights.safetensors (WanPipeline.load_lora_weights,
        with load_into_transformer_2=True for Wan 2.2's low-noise expert) and, when every
        adapted module has an original Wan name (the default targets do), a ComfyUI file in
        those names; full weights as the base class writes them."""
        if not request.lora:
            return super().export_files(model_name, state, request)
        return wan_lora_files(model_name, state, request, self.config.job.name)
