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
from splitstage.pipelines.family import ExportRequest

Files = dict[str, tuple[str, bytes]]
# The components a LoRA exports from, per family, denoiser first: those both layouts hold.
LORA_COMPONENTS = {family: tuple(prefixes) for family, prefixes in KOHYA_PREFIX.items()}


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
    kohya's layout with its ss_* metadata (ComfyUI, A1111), named after the job."""
    lora = {k: t.detach().contiguous() for k, t in state.items() if "lora_" in k}
    meta = {"format": "pt"}
    meta.update(diffusers_lora_metadata(component, request.rank, request.alpha, request.targets))
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
        component: (DIFFUSERS_WEIGHT_NAME, save(diffusers_lora_state(lora, component), meta)),
        f"{component}_kohya": (
            f"{output_name}_kohya.safetensors",
            save(kohya, {"format": "pt", **kohya_meta}),
        ),
    }


def component_folder_files(component: Component, state: dict[str, torch.Tensor]) -> Files:
    """The trained component as `save_pretrained` writes it (config + safetensors, sharded when
    big), under `<output>/<component>/`, so `from_pretrained(out, subfolder=component)` loads."""
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
    return files
