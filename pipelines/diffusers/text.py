"""Prompt encoding as diffusers' pipelines do it: CLIP hidden states and pooled outputs, T5."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch
from torch import nn

from splitstage.config.job import ConfigError

CLIP_LENGTH = 77


def tokenizer_folder(root: Path, encoder: str) -> Path:
    """Where an encoder's tokenizer lives: text_encoder -> tokenizer, text_encoder_2 -> ..._2."""
    return root / encoder.replace("text_encoder", "tokenizer")


@cache
def load_tokenizer(root: Path, encoder: str):
    """The encoder's tokenizer from the pipeline folder (offline: files only; loaded once, when
    the folder is checked before launch)."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder(root, encoder)
    if not folder.is_dir():
        raise ConfigError(
            f"pipeline.pretrained: {root} has no {folder.name}/ for {encoder}; the folder must "
            "hold the tokenizer that model was trained with"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # the tokenizers library raises plain Exceptions on bad files
        text = str(error).strip()
        first = text.splitlines()[0].rstrip(" :") if text else type(error).__name__
        raise ConfigError(
            f"pipeline.pretrained: {folder} is not a readable tokenizer for {encoder} ({first}); "
            "restore the tokenizer files diffusers saved with the pipeline"
        ) from None


def token_ids(tokenizer, prompts: Sequence[str], length: int, device: torch.device) -> torch.Tensor:
    """Token ids [B, length]: padded to `length`, longer prompts truncated (as the pipelines)."""
    batch = tokenizer(
        list(prompts),
        padding="max_length",
        max_length=length,
        truncation=True,
        return_tensors="pt",
    )
    return batch.input_ids.to(device)


def clip_penultimate(encoder: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate hidden states [B,77,D], pooled output [B,P]) as SDXL and SD3 use them."""
    out = encoder(ids, output_hidden_states=True)
    return out.hidden_states[-2], out[0]


def clip_last(encoder: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states [B,77,D], pooled output [B,D]) as SD and FLUX use them."""
    out = encoder(ids, output_hidden_states=False)
    return out.last_hidden_state, out.pooler_output


def t5_hidden(encoder: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """T5 encoder's last hidden states [B, L, D]."""
    return encoder(ids, output_hidden_states=False)[0]


def with_empty(prompts: Sequence[str]) -> list[str]:
    """The prompts plus one empty prompt (its embeddings serve caption dropout)."""
    return [*prompts, ""]


def split_empty(values: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """Per-prompt outputs plus `empty_<name>` copies of the last (empty) row for each sample."""
    out = {}
    for name, value in values.items():
        out[name] = value[:count]
        out[f"empty_{name}"] = value[count:].expand(count, *value.shape[1:])
    return out
