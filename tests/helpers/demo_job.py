"""The [models] and [trainable] sections of a demo job on built demo weights (LoRA on the DiT),
shared by tests that build their own configs around them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def demo_sections(weights: Mapping[str, Path]) -> dict[str, Any]:
    """The demo's models (weights from `build_demo_weights`, tiny text encoder) and LoRA target."""
    return {
        "models": {
            "vae": {"weights": str(weights["vae"])},
            "dit": {"weights": str(weights["dit"])},
            "text_encoder": {"builder": "tiny"},
        },
        "trainable": {"lora_base_model": "dit"},
    }
