"""Qwen-Image's text encoder: Qwen2.5-VL loaded from its checkpoint names, prompts encoded as
QwenImagePipeline encodes them (its chat template, the system prefix's tokens dropped)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.components import (
    Component,
    build_empty,
    init_buffers,
)
from splitstage.pipelines.qwen_template import pipeline_template
from splitstage.storage.safetensors_io import mapped_state


def check_template_prefix(tokenizer) -> None:
    """The tokenizer encodes the template's system prefix into exactly the tokens the pipeline
    drops; another count would leave part of the system prompt in the embeddings, silently."""
    template, drop = pipeline_template()
    prefix = template.split("{}")[0]
    count = len(tokenizer(prefix).input_ids)
    if count != drop:
        raise ConfigError(
            f"pipeline.pretrained: its tokenizer encodes QwenImagePipeline's prompt template "
            f"prefix into {count} tokens, but the pipeline drops {drop}; use the tokenizer saved "
            "with Qwen-Image (Qwen2.5-VL's)"
        )


def encode_prompts(
    encoder: nn.Module, tokenizer, prompts: Sequence[str], length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [B, L, D], mask [B, L]) of each prompt: the template around it, the last
    hidden states, the first `drop` tokens removed, padded (mask 0) to L, the longest prompt's
    count (at most `length`), as QwenImagePipeline.encode_prompt with max_sequence_length =
    length. Encoded padded to `length` whatever the batch, so a sample's embeddings do not
    depend on the batch it was encoded in."""
    template, drop = pipeline_template()
    batch = tokenizer(
        [template.format(prompt) for prompt in prompts],
        max_length=length + drop,
        padding="max_length",
        truncation=True,
        return_tensors="pt",
    ).to(device)
    out = encoder(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
    )
    mask = batch.attention_mask[:, drop:]
    hidden = out.hidden_states[-1][:, drop:] * mask.unsqueeze(-1).to(out.hidden_states[-1].dtype)
    longest = int(mask.sum(dim=1).max())  # the tokenizer's mask: real (not fake) in memory plans
    return hidden[:, :longest], mask[:, :longest].long()


def renamed_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers checkpoint's keys as the module names them (transformers 5 renames
    Qwen2.5-VL's `model.layers` / `visual` on load): its own conversion mapping."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = model.state_dict()
    prefix = model.base_model_prefix
    return {
        rename_source_key(key, renamings, converters, prefix, names)[0]: tensor
        for key, tensor in state.items()
    }


def load_text_encoder(component: Component, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Qwen2.5-VL built empty, loaded from its files under the module's key names (every key
    checked: a plain load of the saved names would load nothing and say nothing), frozen."""
    model = build_empty(component)
    state = renamed_state(model, mapped_state(component.weights))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{component.source}: {component.weights} does not fit {component.class_name} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); give the text encoder "
            "saved with the Qwen-Image pipeline"
        )
    model.load_state_dict(state, strict=True, assign=True)
    init_buffers(model)
    model.to(device)
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval().requires_grad_(False)
