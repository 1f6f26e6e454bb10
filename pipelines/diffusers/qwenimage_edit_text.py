"""Qwen-Image-Edit's prompt encoding: Qwen2.5-VL sees each row's reference images through the
folder's processor, with QwenImageEdit(Plus)Pipeline's own template, picture labels and drop index.

transformers 5 builds Qwen2VLProcessor with a video processor that needs torchvision; the
processor here is built from the folder's processor/ files (Qwen2-VL's PIL image processor and
the tokenizer) without one, so torchvision is never imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitstage.config.job import ConfigError

PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"  # Plus labels each image


def pipeline_class(plus: bool):
    """QwenImageEditPlusPipeline (several references) or QwenImageEditPipeline (one)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline if plus else QwenImageEditPipeline


def edit_template(plus: bool) -> tuple[str, int]:
    """(prompt template, leading tokens to drop): the pipeline's own values, read from one built
    without components so they follow the installed diffusers."""
    cls = pipeline_class(plus)
    pipe = cls.__new__(cls)
    cls.__init__(pipe, None, None, None, None, None, None)
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


def check_edit_template(tokenizer, plus: bool) -> None:
    """The tokenizer encodes the template's system prefix into exactly the tokens the pipeline
    drops; another count would leave part of the system prompt in the embeddings, silently."""
    template, drop = edit_template(plus)
    prefix = template.split("{}")[0].split("<|vision_start|>")[0]
    count = len(tokenizer(prefix).input_ids)
    if count != drop:
        name = pipeline_class(plus).__name__
        raise ConfigError(
            f"pipeline.pretrained: its processor's tokenizer encodes {name}'s prompt template "
            f"prefix into {count} tokens, but the pipeline drops {drop}; use the processor "
            "saved with Qwen-Image-Edit (Qwen2.5-VL's)"
        )


@cache
def _processor_class():
    """Qwen2VLProcessor with an image processor and a tokenizer only (no video processor)."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor (which needs torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    return ImageOnlyProcessor


def load_processor(folder: Path) -> Any:
    """The folder's processor/ (Qwen2VLProcessor files) as a processor that takes images and
    text, never importing torchvision."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if not (folder / "preprocessor_config.json").is_file():
        raise ConfigError(
            f"pipeline.pretrained: {folder} has no preprocessor_config.json; give the "
            "Qwen-Image-Edit folder with its processor/ (Qwen2VLProcessor) as saved on the Hub"
        )
    image = Qwen2VLImageProcessorPil.from_pretrained(folder)
    return _processor_class()(
        image_processor=image, tokenizer=AutoTokenizer.from_pretrained(folder)
    )


def processed(processor: Any, prompt: str, images: Sequence[Any], plus: bool) -> Any:
    """The processor's inputs for one prompt with its images, as _get_qwen_prompt_embeds builds
    them: the template around the picture labels (Plus) and the prompt."""
    template, _ = edit_template(plus)
    labels = "".join(PICTURE.format(i + 1) for i in range(len(images))) if plus else ""
    text = [template.format(labels + prompt)]
    return processor(text=text, images=list(images) or None, padding=True, return_tensors="pt")


def token_count(processor: Any, prompt: str, images: Sequence[Any], plus: bool) -> int:
    """Tokens the pipeline keeps for one prompt with its images (vision tokens and text)."""
    return processed(processor, prompt, images, plus)["input_ids"].shape[1] - edit_template(plus)[1]


def encode_prompt(
    encoder: nn.Module,
    processor: Any,
    prompt: str,
    images: Sequence[Any],
    plus: bool,
    device: torch.device,
) -> torch.Tensor:
    """The hidden states [L, D] QwenImageEdit(Plus)Pipeline._get_qwen_prompt_embeds gives one
    prompt with its images (PIL, at the pipeline's condition size): the last hidden states of
    the processed text and images, the template's first `drop` tokens removed."""
    inputs = processed(processor, prompt, images, plus).to(device)
    out = encoder(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        pixel_values=inputs.get("pixel_values"),
        image_grid_thw=inputs.get("image_grid_thw"),
        output_hidden_states=True,
    )
    kept = out.hidden_states[-1][0][inputs["attention_mask"][0].bool()]
    return kept[edit_template(plus)[1] :]


def too_long(where: str, count: int, length: int) -> ConfigError:
    """The one-line refusal of a prompt + references longer than max_prompt_length."""
    return ConfigError(
        f"pipeline.max_prompt_length: {where} encodes into {count} tokens (its prompt and its "
        f"reference images' vision tokens), more than {length}; raise "
        f"pipeline.max_prompt_length to at least {count} (or make the references smaller: "
        "pipeline.condition_max_pixels, or reference_max_pixels for QwenImageEditPipeline)"
    )


def pad_prompts(
    hiddens: Sequence[torch.Tensor], limit: int, wheres: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [B, L, D], mask [B, L]): each [l, D] of `hiddens` padded with zeros (mask 0)
    to L, the longest, as _get_qwen_prompt_embeds pads a batch; one longer than `limit` (at
    `wheres`' place) is refused (cutting it would drop what the pipeline keeps)."""
    for hidden, where in zip(hiddens, wheres, strict=True):
        if hidden.shape[0] > limit:
            raise too_long(where, hidden.shape[0], limit)
    longest = max(hidden.shape[0] for hidden in hiddens)
    embeds = hiddens[0].new_zeros(len(hiddens), longest, hiddens[0].shape[1])
    mask = torch.zeros(len(hiddens), longest, dtype=torch.long, device=hiddens[0].device)
    for row, hidden in enumerate(hiddens):
        embeds[row, : hidden.shape[0]] = hidden
        mask[row, : hidden.shape[0]] = 1
    return embeds, mask
