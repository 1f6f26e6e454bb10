"""What a diffusers family exports: LoRA in diffusers and kohya layouts, or a component folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save

from splitstage.pipelines.diffusers.components import build_empty, init_buffers
from splitstage.pipelines.diffusers.folder import Component
from splitstage.pipelines.diffusers.lora_export import (
    DIFFUSERS_WEIGHT_NAME,
    KOHYA_PREFIX,
    diffusers_lora_metadata,
    diffusers_lora_state,
    kohya_lora_metadata,
    kohya_lora_state,
)
from splitstage.pipelines.diffusers.original_layout_export import original_layout_files
from splitstage.pipelines.family import ExportRequest

Files = dict[str, tuple[str, bytes]]
# The components a LoRA exports from, per family, denoiser first: those both layouts hold.
LORA_COMPONENTS = {family: tuple(prefixes) for family, prefixes in KOHYA_PREFIX.items()}
# The components each family's diffusers pipeline reads with `load_lora_weights` (its
# `_lora_loadable_modules` in diffusers 0.42; tests compare). A LoRA of another exported
# component (the T5 of flux and sd3) is skipped there without an error, and their kohya files
# raise: such a LoRA is written as a PEFT adapter folder instead (`PeftModel.from_pretrained(
# pipe.<component>, "<output>/<component>")`, or transformers' `load_adapter`), besides the kohya
# file ComfyUI maps (`lora_te2_` / `lora_te3_`: its T5 keys).
PIPELINE_LORA_MODULES = {
    "sd": ("unet", "text_encoder"),
    "sdxl": ("unet", "text_encoder", "text_encoder_2"),
    "sd3": ("transformer", "text_encoder", "text_encoder_2"),
    "flux": ("transformer", "text_encoder"),
    "qwenimage": ("transformer",),
    "zimage": ("transformer",),
    "flux2": ("transformer",),
}
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module paths


def peft_adapter_files(component: str, lora: dict[str, torch.Tensor], request) -> Files:
    """`<component>/adapter_model.safetensors` and `adapter_config.json`, as peft's
    save_pretrained writes them (module paths as in the model, alpha / rank in the config)."""
    from peft import LoraConfig

    config = LoraConfig(r=request.rank, lora_alpha=request.alpha, target_modules=request.targets)
    tensors = {PEFT_PREFIX + key: tensor for key, tensor in lora.items()}
    with tempfile.TemporaryDirectory() as scratch:
        config.save_pretrained(scratch)
        settings = (Path(scratch) / "adapter_config.json").read_bytes()
    return {
        component: (f"{component}/{PEFT_WEIGHTS_NAME}", save(tensors, {"format": "pt"})),
        f"{component}_config": (f"{component}/adapter_config.json", settings),
    }


def lora_files(
    family: str,
    component: str,
    state: dict[str, torch.Tensor],
    request: ExportRequest,
    *,
    base_model: str,
    resolution: int,
    output_name: str,
    v2: bool = False,
) -> Files:
    """`pytorch_lora_weights.safetensors` (pipe.load_lora_weights(folder)) and the same LoRA in
    kohya's layout with its ss_* metadata (ComfyUI, A1111), named after the job; a component
    the pipeline's loader skips gets a PEFT adapter folder in place of diffusers' file."""
    lora = {k: t.detach().contiguous() for k, t in state.items() if "lora_" in k}
    if component in PIPELINE_LORA_MODULES.get(family, ()):
        meta = {"format": "pt"}
        meta.update(
            diffusers_lora_metadata(component, request.rank, request.alpha, request.targets)
        )
        first = {
            component: (DIFFUSERS_WEIGHT_NAME, save(diffusers_lora_state(lora, component), meta))
        }
    else:
        first = peft_adapter_files(component, lora, request)
    kohya_meta = kohya_lora_metadata(
        family,
        base_model=base_model,
        rank=request.rank,
        alpha=request.alpha,
        resolution=resolution,
        steps=request.steps,
        v2=v2,
        output_name=output_name,
    )
    kohya = kohya_lora_state(lora, component, family, request.rank, request.alpha)
    return {
        **first,
        f"{component}_kohya": (
            f"{output_name}_kohya.safetensors",
            save(kohya, {"format": "pt", **kohya_meta}),
        ),
    }


def component_folder_files(component: Component, state: dict[str, torch.Tensor]) -> Files:
    """The trained component as `save_pretrained` writes it (config + safetensors, sharded when
    big), under `<output>/<component>/`, so `from_pretrained(out, subfolder=component)` loads;
    a denoiser with an original layout also as `<component>_original.safetensors` beside it."""
    model = build_empty(component)
    name = component.name
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    init_buffers(model)
    left = [name for name, t in model.state_dict().items() if t.is_meta]
    if left or unexpected:
        raise ValueError(
            f"the trained {name} state does not fill the model (missing {left[:3]}, "
            f"unexpected {unexpected[:3]}); nothing was exported"
        )
    files: Files = {}
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch, safe_serialization=True)
        for path in sorted(Path(scratch).iterdir()):
            label = name if path.name == "config.json" else f"{name}/{path.name}"
            files[label] = (f"{name}/{path.name}", path.read_bytes())
    return files | original_layout_files(name, model)
