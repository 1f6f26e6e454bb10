"""Tiny LoRA jobs of each family for the memory plan's checks (digits at 64 px, batch 2)."""

from __future__ import annotations

from pathlib import Path

from splitstage.pipelines.demo.weight_files import build_demo_weights
from tests.helpers.tiny_diffusers import write_tiny_folder

DENOISERS = {"sd": "unet", "sdxl": "unet"}
FAMILY_OF = {"qwenimage_edit_plus": "qwenimage_edit"}  # tiny folder kind -> family
# References sized as the tiny models take them (the pipelines' own areas are 1024² and 384²).
PIPELINE_SETTINGS = {
    "qwenimage_edit": {"reference_max_pixels": 64 * 64, "condition_max_pixels": 32 * 32}
}
TOLERANCE = 0.15  # the estimate's allowed distance from the measured peak


def family_job(root: Path, family: str, **train) -> dict:
    """A LoRA job of `family`'s tiny model on `root / 'data'`, batch 2 (`train` overrides)."""
    document = {
        "job": {"name": f"memory-{family}"},
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache")},
        "preprocess": {"batch_size": 2},
        "train": {"batch_size": 2, "max_steps": 1} | train,
        "output": {"url": str(root / "out")},
    }
    if family == "demo":
        weights = build_demo_weights(root / "weights")
        document["models"] = {
            "vae": {"weights": str(weights["vae"])},
            "dit": {"weights": str(weights["dit"])},
            "text_encoder": {"builder": "tiny"},
        }
        return document | {"trainable": {"lora_base_model": "dit", "lora_rank": 4}}
    if not (root / family / "model_index.json").is_file():
        write_tiny_folder(family, root / family)
    name = FAMILY_OF.get(family, family)
    document["pipeline"] = {"name": name, "pretrained": str(root / family), "resolution": 64}
    document["pipeline"] |= PIPELINE_SETTINGS.get(name, {})
    if family in ("wan", "wan_i2v"):
        document["data"]["video"] = {"num_frames": 5}
    return document | {"trainable": {"lora_base_model": DENOISERS.get(family, "transformer")}}


def close(estimated: int, measured: int) -> bool:
    """Within the tolerance of the measured figure."""
    return abs(estimated - measured) <= TOLERANCE * measured
