"""FLUX.2: Mistral 3 prompt embeddings (three hidden layers stacked), AutoencoderKLFlux2 latents
in 2x2 patches normalised by its batch-norm statistics, packed tokens with 4-D ids, guidance
embedding, flow matching.

Stage 1 caches the prompt embeddings (padded to max_prompt_length, as the pipeline passes them)
and the VAE's latent distribution; every step draws a latent, patchifies and normalises it,
drops captions, draws noise and a timestep, as diffusers' train_dreambooth_lora_flux2.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.base import DTYPES
from splitstage.pipelines.diffusers.component_shapes import Width, link
from splitstage.pipelines.diffusers.components import build_empty
from splitstage.pipelines.diffusers.flux2_latents import (
    bn_stats,
    decode,
    latent_ids,
    make_bn_sampler,
    pack,
)
from splitstage.pipelines.diffusers.flux2_lora import kohya_flux2_state, unplaced_modules
from splitstage.pipelines.diffusers.flux2_sampling import flux2_sample
from splitstage.pipelines.diffusers.flux2_text import (
    OUT_LAYERS,
    check_encoder,
    encode_prompts,
    load_text_encoder,
    text_ids,
)
from splitstage.pipelines.diffusers.lora_export import (
    DIFFUSERS_WEIGHT_NAME,
    diffusers_lora_metadata,
    diffusers_lora_state,
    kohya_lora_metadata,
)
from splitstage.pipelines.diffusers.mmdit import (
    JOINT_BLOCK_TP,
    MMDIT_LORA_TARGETS,
    FlowTransformerFamily,
)
from splitstage.pipelines.diffusers.recipes import flow_draw
from splitstage.pipelines.diffusers.text import split_empty, with_empty
from splitstage.pipelines.family import ExportRequest, TrainingStep
from splitstage.pipelines.runtime import StepContext

# Both streams' attention of the double blocks, and the single blocks' fused QKV + MLP input
# (diffusers' Flux2 LoRA tests adapt to_qkv_mlp_proj: the single blocks have no to_q / to_k).
FLUX2_LORA_TARGETS = (*MMDIT_LORA_TARGETS, "attn.to_qkv_mlp_proj")
# A fused projection whose output packs blocks ([gate | linear] of a SwiGLU; [Q | K | V | gate |
# linear] of a single block) cannot be split into contiguous column shards that each hold whole
# pieces of every block, and diffusers' own PackedColwiseParallel shards block by block into
# DTensors whose Shard(0) placement misdescribes their rows (full_tensor(), DCP resharding and the
# LoRA export would read them permuted). So a fused layer is sharded plainly and its output
# gathered (every rank then splits the whole packed output, as unsharded), and the layer that
# reads it back takes a replicated input it slices for its row shard: the weights and their
# matmuls are sharded, the activations between the two stay whole. Attention of the double
# blocks is Megatron-style (heads sharded), as FLUX.1's; the modulations stay replicated.
GATHERED = ColwiseParallel(output_layouts=Replicate())
FROM_WHOLE = RowwiseParallel(input_layouts=Replicate())
FLUX2_TP = {name: style for name, style in JOINT_BLOCK_TP.items() if ".ff" not in name} | {
    "transformer_blocks.*.ff.linear_in": GATHERED,
    "transformer_blocks.*.ff.linear_out": FROM_WHOLE,
    "transformer_blocks.*.ff_context.linear_in": GATHERED,
    "transformer_blocks.*.ff_context.linear_out": FROM_WHOLE,
    "single_transformer_blocks.*.attn.to_qkv_mlp_proj": GATHERED,
    "single_transformer_blocks.*.attn.to_out": FROM_WHOLE,
}


class Flux2Family(FlowTransformerFamily):
    """FLUX.2 dev (Flux2Pipeline folders)."""

    name = "flux2"
    default_guidance = 4.0  # Flux2Pipeline's guidance_scale (told to the guidance embedding)
    model_names = ("text_encoder", "vae", "transformer")
    pipeline_classes = ("Flux2Pipeline",)
    text_params = ("prompt_embeds",)
    shape_links = (
        link(
            [Width("text_encoder", "text_config.hidden_size|hidden_size", len(OUT_LAYERS))],
            ("transformer", "joint_attention_dim"),
            "Mistral 3's hidden states, three layers stacked",
        ),
        link(
            [Width("vae", "latent_channels", 4)],
            ("transformer", "in_channels"),
            "the VAE's latents in 2x2 patches",
        ),
    )
    text_models = ("text_encoder",)
    denoiser_params = ("prompt_embeds",)
    default_lora_targets = FLUX2_LORA_TARGETS
    tp_plans = {"transformer": FLUX2_TP}

    # -- units -----------------------------------------------------------------------------------
    @cached_property
    def bn_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's batch-norm (mean, std), read from its weights file once."""
        eps = float(self.vae_config.get("batch_norm_eps", 1e-4))
        return bn_stats(self.folder.component("vae").weights, eps)

    def latent_sampler(self):
        """Patchify, then batch-norm normalise; the tokenizer's chat template and the text
        encoder's depth are checked here (every plan asks for the units, before launch)."""
        text = self.folder.config("text_encoder")
        layers = int(text.get("text_config", text).get("num_hidden_layers", 0))
        check_encoder(self.tokenizer("text_encoder"), layers)
        return make_bn_sampler(self.bn_stats)

    def encode_prompts(self, ctx: StepContext, prompt: Sequence[str]) -> dict[str, Any]:
        """Embeddings [B, L, 3 D] of the prompts and of '' (caption dropout)."""
        embeds = encode_prompts(
            ctx.model("text_encoder", "PromptEncoder"),
            self.tokenizer("text_encoder"),
            with_empty(prompt),
            self.config.pipeline.max_prompt_length,
            ctx.device,
        )
        return split_empty({"prompt_embeds": embeds}, len(prompt))

    # -- models ----------------------------------------------------------------------------------
    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        """As the other families; the text encoder loads under transformers' renamed keys."""
        if name != "text_encoder":
            return super().build_model(name, device, meta=meta)
        component = self.folder.component(name)
        if meta:
            return build_empty(component)
        return load_text_encoder(component, device, DTYPES[self.config.pipeline.precision])

    def weights_file(self, name: str) -> tuple[str, str] | None:
        """Slices of the transformer / VAE files; the text encoder is built loaded (its file
        keys are not its module names)."""
        return None if name == "text_encoder" else super().weights_file(name)

    # -- the training step -----------------------------------------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Flow matching on the packed patched latents; timesteps / 1000; the guidance the
        model is told when it has a guidance embedding; target noise - x0, packed."""
        x0 = inputs["input_latents"].to(ctx.device, torch.float32)
        draw = flow_draw(ctx, x0, self.noise_scheduler)
        inputs.update(noise=draw["noise"], timestep=draw["timestep"], latents=draw["latents"])
        dtype = self.denoiser_dtype(ctx)
        prompt = inputs["prompt_embeds"].to(ctx.device, dtype)
        guidance = None
        if self.folder.config("transformer").get("guidance_embeds", True):
            count = x0.shape[0]
            guidance = torch.full((count,), self.config.pipeline.guidance_scale, device=ctx.device)
        kwargs = {
            "hidden_states": pack(draw["latents"]).to(dtype),
            "timestep": draw["timestep"] / 1000,
            "guidance": guidance,
            "encoder_hidden_states": prompt,
            "txt_ids": text_ids(prompt),
            "img_ids": latent_ids(x0),
        }
        return TrainingStep((), pack(draw["target"]), draw["weight"], kwargs)

    # -- hooks -----------------------------------------------------------------------------------
    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """Flux2Pipeline's loop: empirical-mu shifted FlowMatchEuler, embedded guidance."""
        size = self.sample_size(size)
        return flux2_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )

    def decode(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Normalised patched latents -> images in [-1, 1]."""
        return decode(decoder, self.bn_stats, latents)

    def check_export(self, model_name: str, request: ExportRequest, keys: Sequence[str]) -> None:
        """As the other families; a LoRA also of modules the kohya FLUX.2 layout cannot name
        (diffusers' reader would drop them) is refused before launch."""
        super().check_export(model_name, request, keys)
        modules = [key.removesuffix(".lora_A.weight") for key in keys]
        if request.lora and (unnamed := unplaced_modules(modules, request.targets)):
            raise ConfigError(
                f"trainable.lora_target_modules: the {self.name} kohya / ComfyUI LoRA file has "
                f"no name for {', '.join(unnamed[:3])} (BFL's layout names the blocks' "
                "attention, MLPs and fused projections, img_in, txt_in, time_in and the final "
                "linear); leave them out of the targets"
            )

    def export_files(
        self, model_name: str, state: dict[str, torch.Tensor], request: ExportRequest
    ) -> dict[str, tuple[str, bytes]]:
        """LoRA: diffusers' pytorch_lora_weights.safetensors and the kohya / ComfyUI file in
        BFL's names (q, k, v fused: flux2_lora), which Flux2Pipeline.load_lora_weights reads
        too; full: as the others."""
        if not request.lora:
            return super().export_files(model_name, state, request)
        from safetensors.torch import save

        lora = {k: t.detach().contiguous() for k, t in state.items() if "lora_" in k}
        meta = {"format": "pt"}
        meta |= diffusers_lora_metadata(model_name, request.rank, request.alpha, request.targets)
        tensors = diffusers_lora_state(lora, model_name)
        kohya_meta = kohya_lora_metadata(
            "flux",
            base_model=self.folder.root.name,
            rank=request.rank,
            alpha=request.alpha,
            resolution=self.config.pipeline.resolution,
            steps=request.steps,
            base_model_version="flux2",
            output_name=self.config.job.name,
            extra={"ss_network_module": "networks.lora_flux_2"},  # musubi-tuner's FLUX.2
        )
        kohya = kohya_flux2_state(lora, request.rank, request.alpha)
        return {
            model_name: (DIFFUSERS_WEIGHT_NAME, save(tensors, meta)),
            f"{model_name}_kohya": (
                f"{self.config.job.name}_kohya.safetensors",
                save(kohya, {"format": "pt", **kohya_meta}),
            ),
        }
