"""Z-Image: Qwen3 prompt embeddings (chat template, penultimate layer, unpadded), FLUX's VAE
scaling and shift, a single-stream DiT on lists of per-sample latents, flow matching.

Stage 1 caches the prompt embeddings and mask (padded to max_prompt_length) and the VAE's latent
distribution; every step draws a latent, drops captions, draws noise and a timestep from the
scheduler's table, as diffusers' train_dreambooth_lora_z_image computes them: the transformer
takes (1000 - t) / 1000 and its output is the negated velocity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.component_shapes import link
from splitstage.pipelines.diffusers.mmdit import FlowTransformerFamily
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.diffusers.text import split_empty, with_empty
from splitstage.pipelines.diffusers.zimage_sampling import zimage_sample
from splitstage.pipelines.diffusers.zimage_text import chat_prompts, encode_prompts, unpadded
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import StepContext

# Megatron-style over the heads and the SwiGLU MLP of every block (refiners and main layers);
# the adaLN modulation stays replicated.
ZIMAGE_TP = {
    f"{blocks}.*.{name}": style
    for blocks in ("noise_refiner", "context_refiner", "layers")
    for name, style in (
        ("attention.to_q", "colwise"),
        ("attention.to_k", "colwise"),
        ("attention.to_v", "colwise"),
        ("attention.to_out.0", "rowwise"),
        ("feed_forward.w1", "colwise"),
        ("feed_forward.w3", "colwise"),
        ("feed_forward.w2", "rowwise"),
    )
}
BLOCK_LISTS = ("noise_refiner.", "context_refiner.", "layers.")
# diffusers' train_dreambooth_lora_z_image default (--lora_layers unset): the attention of every
# block (noise and context refiners and the main layers).
ZIMAGE_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")


class ZImageFamily(FlowTransformerFamily):
    """Z-Image / Z-Image-Turbo (ZImagePipeline folders)."""

    name = "zimage"
    default_guidance = 5.0  # ZImagePipeline's guidance_scale (Turbo samples with 0)
    model_names = ("text_encoder", "vae", "transformer")
    pipeline_classes = ("ZImagePipeline",)
    text_params = ("prompt_embeds", "prompt_embeds_mask")
    shape_links = (
        link(
            [("text_encoder", "hidden_size")],
            ("transformer", "cap_feat_dim"),
            "Qwen3's penultimate hidden states",
        ),
        link([("vae", "latent_channels")], ("transformer", "in_channels"), "the VAE's latents"),
    )
    text_models = ("text_encoder",)
    denoiser_params = ("prompt_embeds", "prompt_embeds_mask")
    default_lora_targets = ZIMAGE_LORA_TARGETS
    tp_plans = {"transformer": ZIMAGE_TP}

    # -- units -----------------------------------------------------------------------------------
    def latent_sampler(self):
        """(z - shift_factor) * scaling_factor; the tokenizer's chat template and the prompt
        length the transformer's positions hold are checked here (every plan asks for the
        units, before launch)."""
        chat_prompts(self.tokenizer("text_encoder"), [""])
        self.check_prompt_positions()
        return super().latent_sampler()

    def check_prompt_positions(self) -> None:
        """The transformer numbers caption tokens (padded to a multiple of 32) and then the
        image's frame from 1 on its first RoPE axis: max_prompt_length must fit axes_lens[0]."""
        length = self.config.pipeline.max_prompt_length
        positions = int(self.folder.config("transformer").get("axes_lens", [1024])[0])
        padded = -(-length // 32) * 32
        if padded + 1 >= positions:
            fits = (positions - 2) // 32 * 32
            raise ConfigError(
                f"pipeline.max_prompt_length: {length} tokens need {padded + 2} positions on "
                f"the transformer's first RoPE axis, which has {positions} (axes_lens[0]); "
                f"use at most {fits}"
            )

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """Embeddings [B, L, D] and mask [B, L] of the prompts and of '' (caption dropout)."""
        encoder = ctx.model("text_encoder", "PromptEncoder")
        embeds, mask = encode_prompts(
            encoder,
            self.tokenizer("text_encoder"),
            with_empty(prompt),
            self.config.pipeline.max_prompt_length,
            ctx.device,
        )
        return split_empty({"prompt_embeds": embeds, "prompt_embeds_mask": mask}, len(prompt))

    # -- the training step -----------------------------------------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """x_t = (1 - sigma) x0 + sigma noise, t from the scheduler's table; the transformer takes
        one [C, 1, H, W] latent and the unpadded prompt per sample and (1000 - t) / 1000;
        target noise - x0 (`denoise` negates the output, as the pipeline does)."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        embeds = inputs["prompt_embeds"].to(ctx.device, dtype)
        kwargs = {
            "x": list(draw["latents"].to(dtype).unsqueeze(2).unbind(0)),
            "t": (1000 - draw["timestep"]) / 1000,
            "cap_feats": unpadded(embeds, inputs["prompt_embeds_mask"]),
        }
        return TrainingStep((), draw["target"], draw["weight"], kwargs)

    def denoise(self, ctx: StepContext, step: TrainingStep) -> torch.Tensor:
        """The velocity [B, C, H, W]: the transformer's per-sample outputs stacked, negated."""
        model = ctx.model(self.denoiser, "model_fn")
        out = model(*step.denoiser_args, **step.denoiser_kwargs, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # -- hooks -----------------------------------------------------------------------------------
    def tp_prepare(self, model, tp_degree: int) -> None:
        """Sharded attention holds heads / tp heads per rank: its processor reads `attn.heads`."""
        for fqn, module in model.named_modules():
            if fqn.startswith(BLOCK_LISTS) and fqn.endswith(".attention"):
                module.heads = module.heads // tp_degree

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """ZImagePipeline's loop: FlowMatchEuler on its sigmas, negated output, its guidance."""
        size = self.sample_size(size)
        return zimage_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )
