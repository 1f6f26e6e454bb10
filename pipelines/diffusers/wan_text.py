"""Wan's prompts: UMT5 last hidden states, as WanPipeline._get_t5_prompt_embeds computes them
(the pipeline's prompt cleaning, padded to max_sequence_length, zeros past each prompt's tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def clean_prompts(prompts: Sequence[str]) -> list[str]:
    """WanPipeline's prompt_clean (ftfy when installed, HTML unescape, whitespace squeezed)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return [prompt_clean(prompt) for prompt in prompts]


def encode_prompts(
    encoder: nn.Module, tokenizer, prompts: Sequence[str], length: int, device: torch.device
) -> torch.Tensor:
    """Embeddings [B, length, D] of each prompt: its tokens' last hidden states, zeros after them
    (the attention mask keeps each prompt's embeddings independent of the batch it is in)."""
    batch = tokenizer(
        clean_prompts(prompts),
        padding="max_length",
        max_length=length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    hidden = encoder(ids, mask).last_hidden_state
    return hidden * mask.gt(0).unsqueeze(-1).to(hidden.dtype)
