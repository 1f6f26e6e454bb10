"""Wan LoRA files: diffusers' layout (WanPipeline.load_lora_weights) and the original checkpoint's
module names under `diffusion_model.` (ComfyUI's native Wan keys; diffusers converts them back).

diffusers names Wan's modules `blocks.N.attn1.to_q`, `blocks.N.ffn.net.0.proj`, ...; the original
Wan checkpoint (and so ComfyUI) names them `blocks.N.self_attn.q`, `blocks.N.ffn.0`, .... The
ComfyUI file holds `lora_down` / `lora_up` and a scalar `alpha` per module.
"""

from __future__ import annotations

import re

import torch
from safetensors.torch import save

from splitstage.pipelines.diffusers.lora_export import (
    DIFFUSERS_WEIGHT_NAME,
    diffusers_lora_metadata,
    diffusers_lora_state,
)
from splitstage.pipelines.family import ExportRequest

COMFY_PREFIX = "diffusion_model."
# diffusers module (under blocks.N.) -> the original Wan module name
ORIGINAL_BLOCK_NAMES = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def original_name(module: str) -> str | None:
    """The original Wan checkpoint's name of a diffusers module, or None if it has none here."""
    if module == "condition_embedder.time_proj":
        return "time_projection.1"
    found = BLOCK.match(module)
    if found is None or found.group(2) not in ORIGINAL_BLOCK_NAMES:
        return None
    return f"blocks.{found.group(1)}.{ORIGINAL_BLOCK_NAMES[found.group(2)]}"


def comfy_lora_state(lora: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor] | None:
    """`diffusion_model.<original>.lora_down/lora_up.weight` and `.alpha` for every module, or
    None when some adapted module has no original name (custom targets: the diffusers file
    holds them all)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in lora.items():
        module, _, kind = key.rpartition(".lora_")
        original = original_name(module)
        if original is None:
            return None
        side = "lora_down" if kind.startswith("A") else "lora_up"
        out[f"{COMFY_PREFIX}{original}.{side}.weight"] = tensor.detach().contiguous()
        out[f"{COMFY_PREFIX}{original}.alpha"] = torch.tensor(float(alpha))
    return out


def wan_lora_files(
    model_name: str, state: dict[str, torch.Tensor], request: ExportRequest, output_name: str
) -> dict[str, tuple[str, bytes]]:
    """pytorch_lora_weights.safetensors under `transformer.*` keys (either expert: WanPipeline
    loads the low-noise one with load_into_transformer_2=True, as Wan 2.2 LoRAs are written), and
    `<job>_comfyui.safetensors` in the original names when every module has one."""
    lora = {key: tensor for key, tensor in state.items() if "lora_" in key}
    meta = diffusers_lora_metadata("transformer", request.rank, request.alpha, request.targets)
    files = {
        model_name: (DIFFUSERS_WEIGHT_NAME, save(diffusers_lora_state(lora, "transformer"), meta))
    }
    comfy = comfy_lora_state(lora, request.alpha)
    if comfy is not None:
        comfy_meta = {"format": "pt", "lora_rank": str(request.rank)}
        comfy_meta["lora_alpha"] = f"{request.alpha:g}"
        files[f"{model_name}_comfyui"] = (
            f"{output_name}_comfyui.safetensors",
            save(comfy, comfy_meta),
        )
    return files
