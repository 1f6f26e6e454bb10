"""Qwen-Image's prompt template and the count of its system-prefix tokens a prompt encoder drops:
one text for every family that encodes Qwen-Image prompts (diffusers' and DiffSynth's pipelines
use the same), read from the installed diffusers so it follows the library."""

from __future__ import annotations

from functools import cache


@cache
def pipeline_template() -> tuple[str, int]:
    """(prompt template, count of leading tokens to drop): QwenImagePipeline's own values, read
    from a pipeline built without components."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.__new__(QwenImagePipeline)
    QwenImagePipeline.__init__(pipe, None, None, None, None, None)
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
