"""The diffusers families' tiny folders by kind, their diffusers pipelines, and a plan for each."""

from __future__ import annotations

from splitstage.config.job import config_from_dict
from splitstage.tasks.job_plan import make_plan

FAMILY = {
    "sd": "sd",
    "sd2": "sd",
    "sdxl": "sdxl",
    "sd3": "sd3",
    "sd3-dynamic-shift": "sd3",  # the scheduler shifts by token count (use_dynamic_shifting)
    "flux": "flux",
}
PIPELINE = {
    "sd": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}


def family_plan(folder, kind: str):
    """The plan of a job on the `kind` folder (64 px, fp32, LoRA on its denoiser)."""
    family = FAMILY[kind]
    pipeline = {"name": family, "pretrained": str(folder), "resolution": 64, "precision": "fp32"}
    if family in ("sd3", "flux"):
        pipeline["max_prompt_length"] = 16
    denoiser = "unet" if family in ("sd", "sdxl") else "transformer"
    return make_plan(
        config_from_dict({"pipeline": pipeline, "trainable": {"lora_base_model": denoiser}})
    )
