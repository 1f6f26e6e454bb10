"""Each stage's models as the ranks build them, on fake tensors (no weight is read), and the
synthetic sample of the job's largest image or clip that stage 1 turns into a cached batch."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from splitstage.data.dataset import Row
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage2.models import adapt_trained
from splitstage.tasks.stage2.quantization import (
    import_torchao,
    install_quantized,
    quantized_weights,
)

PLAN_IMAGE = "memory_plan.png"
# A prompt longer than any tokenizer's limit: text tensors come out at their largest length.
LONG_PROMPT = " ".join(["a detailed photograph of a red fox in a snowy forest at dawn"] * 64)


def largest_size(plan: JobPlan) -> tuple[int, int] | None:
    """(height, width) of the job's largest image: its largest bucket, or its square."""
    family = plan.family
    if family.buckets is not None:
        return max(family.buckets.sizes, key=lambda size: (size[0] * size[1], size))
    resolution = family.image_resolution()
    return (resolution[0], resolution[0]) if resolution else None


def synthetic_sample(plan: JobPlan) -> dict[str, Any]:
    """One sample as the family loads it from a row: an image of the largest size (a clip of
    `[data.video] num_frames` frames for a video family), as many reference images of that size
    as a row may carry, and a prompt longer than any limit."""
    height, width = largest_size(plan) or (64, 64)
    references = tuple(f"reference{i}.png" for i in range(plan.family.most_references()))
    with tempfile.TemporaryDirectory(prefix="splitstage-memory-") as folder:
        for name in (PLAN_IMAGE, *references):  # references as large as the target: the most
            Image.new("RGB", (width, height), (127, 96, 64)).save(Path(folder) / name)
        row = Row(1, PLAN_IMAGE, LONG_PROMPT, source="the memory plan", references=references)
        row = replace(row, prompt=plan.family.longest_prompt(row, folder))
        sample = plan.family.load_sample(row, folder)
    return as_clip(sample, plan.config.data.video.num_frames)


def as_clip(sample: dict[str, Any], frames: int) -> dict[str, Any]:
    """A one-frame clip (an image row of a video family) made `frames` frames long."""
    if sample.get("num_frames") != 1 or frames == 1:
        return sample
    for name, value in sample.items():
        if isinstance(value, torch.Tensor) and value.dim() == 4 and len(value) == 1:
            sample[name] = value.expand(frames, *value.shape[1:]).contiguous()
        elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], Image.Image):
            sample[name] = value * frames
    sample["num_frames"] = frames
    return sample


def frozen_model(plan: JobPlan, name: str) -> nn.Module:
    """A frozen model on meta, in the dtype its loaded build holds (becomes fake in `fake`)."""
    model = plan.family.build_model(name, torch.device("cpu"), meta=True)
    dtype = plan.family.loaded_dtype(name)
    held = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtype is not None and held != {dtype}:  # torch's own cast: diffusers' `to` warns
        nn.Module.to(model, dtype)
    return model.eval().requires_grad_(False)


def trained_model(plan: JobPlan, name: str, device: torch.device) -> nn.Module:
    """A trained model as stage 2 adapts it for `device` (LoRA, dtypes, checkpointing), on meta."""
    model = plan.family.build_model(name, torch.device("cpu"), meta=True)
    return adapt_trained(model, name, plan.family, device)


def quantize_base(plan: JobPlan, models: dict[str, nn.Module]) -> None:
    """The LoRA base held as `train.base_quantization` holds it: the installs stage 2 makes as
    the weights load, made here on the built (fake) weights."""
    kind = plan.config.train.base_quantization
    name = plan.config.trainable.lora_base_model
    if kind == "none" or name not in models:
        return
    import_torchao()
    for module in quantized_weights(models[name]).values():
        install_quantized(module, module.weight.data, kind)


def fake(model: nn.Module) -> nn.Module:
    """The model's tensors made fake on the CPU (call inside a FakeTensorMode)."""
    return model.to_empty(device=torch.device("cpu"))


def stage_models(plan: JobPlan, stage: str, device: torch.device) -> dict[str, nn.Module]:
    """The models a stage builds, on meta: stage 1 all frozen; stage 2 those of the offload
    plan (every model when unsplit), the trained one adapted."""
    config = plan.config
    if stage == "stage1":
        return {name: frozen_model(plan, name) for name in plan.split.models["stage1"]}
    unsplit = config.train.mode == "unsplit"
    names = list(plan.family.model_names) if unsplit else plan.split.models["stage2"]
    trained = set(config.trainable.models())
    return {
        name: trained_model(plan, name, device) if name in trained else frozen_model(plan, name)
        for name in names
    }
