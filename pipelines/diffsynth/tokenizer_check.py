"""The tokenizer a diffsynth job names, checked against its text encoder before anything runs: a
tokenizer of another model (Wan's T5 for Qwen-Image) would encode every prompt into ids the
encoder reads as other words, silently."""

from __future__ import annotations

from functools import cache

from torch import nn

from splitstage.config.job import ConfigError
from splitstage.pipelines.qwen_template import pipeline_template

# Qwen-Image's prompt template: the system prefix the prompt unit drops (DiffSynth's
# QwenImageUnit_PromptEmbedder, as diffusers' QwenImagePipeline: the same text and count).
PREFIX_CHECKED = ("QwenImagePipeline",)


@cache
def load_tokenizer(path: str):
    """The folder's tokenizer through transformers' AutoTokenizer (offline, files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(
            f"pipeline.tokenizer_path: {path} is not a readable tokenizer ({first}); give the "
            "tokenizer folder saved with the text encoder"
        ) from None


def vocabulary_rows(encoder: nn.Module) -> int:
    """The encoder's token embedding rows: its largest embedding table (T5's relative-position
    buckets and rotary tables are smaller)."""
    return max(
        (m.num_embeddings for m in encoder.modules() if isinstance(m, nn.Embedding)), default=0
    )


def check_tokenizer(pipeline_class: str, path: str, encoder: nn.Module | None) -> None:
    """The tokenizer's ids fit the encoder's table and, where the pipeline drops a template's
    system prefix, it encodes that prefix into the tokens dropped; one line otherwise."""
    tokenizer = load_tokenizer(path)
    rows = vocabulary_rows(encoder) if encoder is not None else 0
    if rows and len(tokenizer) > rows:
        raise ConfigError(
            f"pipeline.tokenizer_path: its tokenizer has {len(tokenizer)} tokens, but the "
            f"{pipeline_class} text encoder's table has {rows} rows: it is another model's "
            "tokenizer; give the tokenizer folder saved with this text encoder"
        )
    if pipeline_class in PREFIX_CHECKED:
        template, drop = pipeline_template()
        count = len(tokenizer(template.split("{}")[0]).input_ids)
        if count != drop:
            raise ConfigError(
                f"pipeline.tokenizer_path: its tokenizer encodes {pipeline_class}'s prompt "
                f"template prefix into {count} tokens, but the prompt unit drops {drop}: it is "
                "not Qwen-Image's tokenizer (Qwen2.5-VL's); give that folder"
            )
