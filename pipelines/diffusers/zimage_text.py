"""Z-Image's prompts as ZImagePipeline encodes them: Qwen3's chat template, the penultimate
hidden states, padding dropped (cached padded, with a mask, and unpadded for the transformer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from splitstage.config.job import ConfigError


def chat_prompts(tokenizer, prompts: Sequence[str]) -> list[str]:
    """Each prompt as one user turn with the assistant's turn opened (enable_thinking=True), as
    ZImagePipeline._encode_prompt applies the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "pipeline.pretrained: its tokenizer has no chat_template, which ZImagePipeline "
            "applies to every prompt; use the tokenizer saved with Z-Image (Qwen3's)"
        )
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        for prompt in prompts
    ]


def encode_prompts(
    encoder: nn.Module, tokenizer, prompts: Sequence[str], length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [B, length, D] zero where padded, mask [B, length]): the templated prompts
    padded to `length` tokens (longer ones truncated), hidden_states[-2], as
    ZImagePipeline.encode_prompt with max_sequence_length = length."""
    batch = tokenizer(
        chat_prompts(tokenizer, prompts),
        padding="max_length",
        max_length=length,
        truncation=True,
        return_tensors="pt",
    ).to(device)
    mask = batch.attention_mask.bool()
    hidden = encoder(
        input_ids=batch.input_ids, attention_mask=mask, output_hidden_states=True
    ).hidden_states[-2]
    return hidden * mask.unsqueeze(-1).to(hidden.dtype), mask.long()


def unpadded(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's embeddings without its padding: the list ZImagePipeline passes on. Under
    fake tensors (the memory plan) the lengths are unknown: the padded rows, an upper bound."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(mask) or is_fake(embeds):
        return list(embeds.unbind(0))
    keep = mask.to(embeds.device).bool()
    return [row[kept] for row, kept in zip(embeds, keep, strict=True)]
