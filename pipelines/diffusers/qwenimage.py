"""Qwen-Image: Qwen2.5-VL prompt embeddings with their mask, a video VAE normalised per channel,
an MMDiT on 2x2-packed latents, flow matching on the scheduler's dynamically shifted table.

Stage 1 caches each sample's prompt embeddings and mask at its own token count (at most
max_prompt_length; `sequence_params`: batches pad them to their longest, as the pipeline pads a
batch) and the VAE's latent distribution; every step draws a latent, normalises it with
latents_mean / latents_std, drops captions, draws noise and a timestep, as QwenImagePipeline and
diffusers' Qwen-Image LoRA script compute them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.data.buckets import BucketError, Buckets
from splitstage.pipelines.diffusers.base import DTYPES
from splitstage.pipelines.diffusers.component_export import lora_files
from splitstage.pipelines.diffusers.component_shapes import Width, link
from splitstage.pipelines.diffusers.components import build_empty
from splitstage.pipelines.diffusers.mmdit import FlowTransformerFamily
from splitstage.pipelines.diffusers.qwenimage_latents import (
    decode_frames,
    encode_frames,
    image_shapes,
    pack,
)
from splitstage.pipelines.diffusers.qwenimage_sampling import image_shift, qwenimage_sample
from splitstage.pipelines.diffusers.qwenimage_text import (
    check_template_prefix,
    encode_prompts,
    load_text_encoder,
)
from splitstage.pipelines.diffusers.recipes import flow_draw, flow_scheduler
from splitstage.pipelines.diffusers.text import split_empty, with_empty
from splitstage.pipelines.diffusers.wan_vae_norm import make_normalising_sampler, require_stats
from splitstage.pipelines.family import ExportRequest, TrainingStep
from splitstage.pipelines.lora_targets import QWEN_IMAGE_LORA_TARGETS
from splitstage.pipelines.runtime import StepContext

# How stage 1 lays out the prompt embeddings it caches (part of the cache key): each sample's at
# its own token count (earlier caches padded every sample to max_prompt_length).
PROMPT_LAYOUT = "own-length"
# The last block's text stream is discarded (only the image tokens go to norm_out / proj_out):
# modules there get no gradient, so a LoRA on them cannot learn, and DDP refuses unused ones.
DEAD_IN_LAST_BLOCK = ("attn.to_add_out", "txt_mlp.")
# diffusers' own QwenImageTransformer2DModel._tp_plan: heads column-sharded, MLPs Megatron-style;
# the modulation layers stay replicated.
QWEN_TP = {
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": "rowwise",
    "transformer_blocks.*.img_mlp.net.0.proj": "colwise",
    "transformer_blocks.*.img_mlp.net.2": "rowwise",
    "transformer_blocks.*.txt_mlp.net.0.proj": "colwise",
    "transformer_blocks.*.txt_mlp.net.2": "rowwise",
}


class QwenImageFamily(FlowTransformerFamily):
    """Qwen-Image (QwenImagePipeline folders)."""

    name = "qwenimage"
    default_guidance = 4.0  # QwenImagePipeline's true_cfg_scale
    model_names = ("text_encoder", "vae", "transformer")
    pipeline_classes = ("QwenImagePipeline",)
    text_params = ("prompt_embeds", "prompt_embeds_mask")
    shape_links = (
        link(
            [("text_encoder", "text_config.hidden_size|hidden_size")],
            ("transformer", "joint_attention_dim"),
            "Qwen2.5-VL's hidden states",
        ),
        link(
            [Width("vae", "z_dim", 4)],
            ("transformer", "in_channels"),
            "the VAE's latents packed in 2x2 patches",
        ),
        link(
            [("vae", "z_dim")], ("transformer", "out_channels"), "predictions of the VAE's latents"
        ),
    )
    text_models = ("text_encoder",)
    denoiser_params = ("prompt_embeds", "prompt_embeds_mask")
    sequence_params = {
        "prompt_embeds": "prompt_embeds_mask",
        "empty_prompt_embeds": "empty_prompt_embeds_mask",
    }
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS  # the diffsynth family's too
    tp_plans = {"transformer": QWEN_TP}

    def stage1_settings(self) -> dict[str, Any]:
        """The pipeline's stage-1 settings and the cached prompts' layout (`PROMPT_LAYOUT`)."""
        return super().stage1_settings() | {"prompt_layout": PROMPT_LAYOUT}

    # -- units -----------------------------------------------------------------------------------
    def pixel_encoder(self):
        """Images as one-frame clips through AutoencoderKLQwenImage."""
        return encode_frames

    def latent_sampler(self):
        """Latents normalised per channel; the VAE config has the statistics and the tokenizer
        the pipeline's template (checked here: every plan asks for the units)."""
        require_stats(
            self.vae_config,
            f"{self.folder.root}/vae/config.json",
            "AutoencoderKLQwenImage config saved with Qwen-Image",
        )
        self.check_template()
        return make_normalising_sampler(self.vae_config)

    def check_template(self) -> None:
        """The tokenizer encodes the template's system prefix into the tokens the pipeline
        drops (checked once, when the units are first asked for: by every plan, before launch)."""
        if not self.__dict__.get("_template_checked"):
            check_template_prefix(self.tokenizer("text_encoder"))
            self._template_checked = True

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """Embeddings [B, L, D] and mask [B, L] of the prompts and of '' (caption dropout), L
        the longest of them (at most max_prompt_length)."""
        texts = with_empty(prompt)
        encoder = ctx.model("text_encoder", "PromptEncoder")
        length = self.config.pipeline.max_prompt_length
        embeds, mask = encode_prompts(
            encoder, self.tokenizer("text_encoder"), texts, length, ctx.device
        )
        return split_empty({"prompt_embeds": embeds, "prompt_embeds_mask": mask}, len(prompt))

    # -- sizes -----------------------------------------------------------------------------------
    def image_resolution(self) -> tuple[int, int]:
        """The square side (resolution, or from max_pixels) and the multiple of 16 packing needs."""
        return self.config.pipeline.square_side(), self.config.pipeline.pixel_multiple

    @cached_property
    def buckets(self) -> Buckets | None:
        """`[data.buckets]` sized by max_pixels (the area) unless data.buckets.area is set."""
        config = self.config.data.buckets
        max_pixels = self.config.pipeline.max_pixels
        if not config.enabled or max_pixels is None or config.area is not None:
            return super().buckets
        try:
            return Buckets(config.model_copy(update={"area": max_pixels}), *self.image_resolution())
        except BucketError as error:
            raise ConfigError(str(error)) from None

    @property
    def vae_scale(self) -> int:
        """Pixels per latent along a side (QwenImagePipeline's vae_scale_factor)."""
        return 2 ** len(self.vae_config.get("temperal_downsample", [False, True, True]))

    # -- models ----------------------------------------------------------------------------------
    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        """As the other families; the text encoder loads under transformers' renamed keys."""
        if name == "text_encoder" and not meta:
            component = self.folder.component(name)
            return load_text_encoder(component, device, DTYPES[self.config.pipeline.precision])
        if name == "text_encoder":
            return build_empty(self.folder.component(name))
        return super().build_model(name, device, meta=meta)

    def weights_file(self, name: str) -> tuple[str, str] | None:
        """Slices of the transformer / VAE files; the text encoder is built loaded (its file
        keys are not its module names)."""
        return None if name == "text_encoder" else super().weights_file(name)

    @cached_property
    def transformer_modules(self) -> list[str]:
        """The transformer's module names (built on meta: nothing is read)."""
        model = build_empty(self.folder.component("transformer"))
        return [name for name, _ in model.named_modules()]

    def lora_targets(self, name: str) -> list[str]:
        """The config's targets, else the source text's list, as full module names of the
        transformer, less those of its last block whose outputs reach no loss (its text
        stream); a target that names no module is kept, so it is refused by name."""
        targets = super().lora_targets(name)
        if name != "transformer":
            return targets
        modules = self.transformer_modules
        last = f"transformer_blocks.{int(self.folder.config('transformer')['num_layers']) - 1}."
        dead = tuple(last + suffix for suffix in DEAD_IN_LAST_BLOCK)
        expanded: list[str] = []
        for target in targets:
            found = [m for m in modules if m == target or m.endswith(f".{target}")]
            live = [m for m in found if not m.startswith(dead)]
            expanded.extend(live if live else [target])
        return list(dict.fromkeys(expanded))

    # -- the training step -----------------------------------------------------------------------
    def training_schedule(self, tokens: int):
        """The scheduler's 1000-step table, shifted for `tokens` image tokens (dynamic_shift),
        else its unshifted one; one per token count, built once."""
        if not self.config.pipeline.dynamic_shift:
            return self.noise_scheduler
        tables = self.__dict__.setdefault("_shift_tables", {})
        if tokens not in tables:
            table = flow_scheduler(self.scheduler_config)
            mu = image_shift(self.scheduler_config, tokens)
            table.set_timesteps(table.config.num_train_timesteps, mu=mu)
            tables[tokens] = table
        return tables[tokens]

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """x_t = (1 - sigma) x0 + sigma noise on packed latents, sigma = t / 1000 from the shifted
        table; target noise - x0; the prompt mask and img_shapes as the pipeline passes them."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        tokens = (x0.shape[-2] // 2) * (x0.shape[-1] // 2)
        draw = flow_draw(ctx, x0, self.training_schedule(tokens))
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        kwargs = {
            "hidden_states": pack(draw["latents"]).to(dtype),
            "timestep": (draw["timestep"] / 1000).to(dtype),
            "encoder_hidden_states": inputs["prompt_embeds"].to(ctx.device, dtype),
            "encoder_hidden_states_mask": inputs["prompt_embeds_mask"].to(ctx.device),
            "img_shapes": image_shapes(x0),
        }
        return TrainingStep((), pack(draw["target"]), draw["weight"], kwargs)

    # -- hooks -----------------------------------------------------------------------------------
    def tp_prepare(self, model: nn.Module, tp_degree: int) -> None:
        """Nothing: Qwen-Image's attention processor takes the head size from the unsharded
        config and lets the sharded width give the heads per rank."""

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """QwenImagePipeline's loop: shifted FlowMatchEuler, true CFG with its norm rescale."""
        size = self.sample_size(size)
        return qwenimage_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )

    def export_files(
        self, model_name: str, state: dict[str, torch.Tensor], request: ExportRequest
    ) -> dict[str, tuple[str, bytes]]:
        """As the other families; the kohya metadata's resolution is the trained square side
        (from max_pixels when that sizes the images)."""
        if not request.lora:
            return super().export_files(model_name, state, request)
        return lora_files(
            self.lora_layout or self.name,
            model_name,
            state,
            request,
            base_model=self.folder.root.name,
            resolution=self.image_resolution()[0],
            output_name=self.config.job.name,
        )

    def decode(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> one-frame clips decoded -> images in [-1, 1]."""
        return decode_frames(decoder, self.vae_config, latents)
