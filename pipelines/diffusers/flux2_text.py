"""FLUX.2's prompts as Flux2Pipeline encodes them: Mistral 3 on the chat-templated prompt (its
system message first), hidden states 10, 20 and 30 stacked along the width, and the text ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.components import Component, build_empty, init_buffers
from splitstage.pipelines.diffusers.qwenimage_text import renamed_state
from splitstage.storage.safetensors_io import mapped_state

OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline.encode_prompt's text_encoder_out_layers default


def check_encoder(tokenizer, layers: int) -> None:
    """The tokenizer has the chat template the pipeline applies, and the text encoder has the
    hidden states the pipeline reads (hidden_states[30] needs 30 layers)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "pipeline.pretrained: its tokenizer has no chat_template, which Flux2Pipeline "
            "applies to every prompt; use the tokenizer saved with FLUX.2 (Mistral 3's)"
        )
    if layers < max(OUT_LAYERS):
        raise ConfigError(
            f"pipeline.pretrained: its text encoder has {layers} layers, but Flux2Pipeline reads "
            f"hidden states {', '.join(map(str, OUT_LAYERS))}; use the text encoder saved with "
            "FLUX.2 (Mistral 3)"
        )


def encode_prompts(
    encoder: nn.Module, tokenizer, prompts: Sequence[str], length: int, device: torch.device
) -> torch.Tensor:
    """Embeddings [B, length, 3 D] of the prompts padded to `length` tokens (no mask: the
    transformer sees the padding, as in the pipeline): Flux2Pipeline's own encoder function."""
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE

    return Flux2Pipeline._get_mistral_3_small_prompt_embeds(
        text_encoder=encoder,
        tokenizer=tokenizer,
        prompt=list(prompts),
        device=device,
        max_sequence_length=length,
        system_message=SYSTEM_MESSAGE,
        hidden_states_layers=OUT_LAYERS,
    )


def text_ids(embeds: torch.Tensor) -> torch.Tensor:
    """Position ids [B, L, 4] of the prompt tokens (t, h, w = 0, l = index), as the pipeline."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_text_ids(embeds).to(embeds.device)


def load_text_encoder(component: Component, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Mistral 3 built empty, loaded from its files under the module's key names (transformers
    5 renames `language_model.model.` on load; every key checked, tied ones re-tied), frozen."""
    model = build_empty(component)
    state = renamed_state(model, mapped_state(component.weights))
    expected = set(model.state_dict()) - set(getattr(model, "all_tied_weights_keys", None) or {})
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{component.source}: {component.weights} does not fit {component.class_name} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); give the text encoder "
            "saved with the FLUX.2 pipeline"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    init_buffers(model)
    model.to(device)
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval().requires_grad_(False)
