"""A FLUX.2 transformer LoRA in kohya / ComfyUI key layout: BFL's module names with underscores
(`lora_unet_double_blocks_0_img_attn_qkv`, `lora_unet_single_blocks_0_linear1`, ...), the layout
diffusers' `_convert_kohya_flux2_lora_to_diffusers` reads (Flux2Pipeline.load_lora_weights) and
ComfyUI applies to BFL's checkpoint.

BFL fuses each stream's q, k and v into one `qkv` Linear. Three LoRAs of rank r on to_q, to_k and
to_v are exactly one of rank 3r on the fused layer: down = cat(A_q, A_k, A_v), up =
block_diag(B_q, B_k, B_v), alpha 3 x alpha (so alpha / rank stays alpha / r). diffusers' reader
sees the up matrix block-diagonal and splits it back into the three rank-r LoRAs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

# diffusers module (inside a double block) -> BFL name; the fused q/k/v of each stream
DOUBLE_BLOCK = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.linear_in": "img_mlp_0",
    "ff.linear_out": "img_mlp_2",
    "ff_context.linear_in": "txt_mlp_0",
    "ff_context.linear_out": "txt_mlp_2",
}
FUSED_QKV = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
SINGLE_BLOCK = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
# the top-level layers diffusers' converter maps back (it drops any other, with a warning)
TOP_LEVEL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "proj_out": "final_layer_linear",
}
PREFIX = "lora_unet"
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def kohya_place(module: str) -> tuple[str, int | None] | None:
    """(kohya module name, index in its fused q/k/v or None) of a transformer module path, or
    None when the layout has no name for it."""
    parts = module.split(".")
    inner = ".".join(parts[2:])
    if parts[0] == "transformer_blocks" and len(parts) > 2:
        for fused, members in FUSED_QKV.items():
            if inner in members:
                return f"{PREFIX}_double_blocks_{parts[1]}_{fused}", members.index(inner)
        if inner in DOUBLE_BLOCK:
            return f"{PREFIX}_double_blocks_{parts[1]}_{DOUBLE_BLOCK[inner]}", None
    if parts[0] == "single_transformer_blocks" and inner in SINGLE_BLOCK:
        return f"{PREFIX}_single_blocks_{parts[1]}_{SINGLE_BLOCK[inner]}", None
    if module in TOP_LEVEL:
        return f"{PREFIX}_{TOP_LEVEL[module]}", None
    return None


def unplaced_modules(modules: Iterable[str], targets: Iterable[str]) -> list[str]:
    """The modules LoRA `targets` adapt (peft's rule: the name, or a name ending in '.' + a
    target) that the kohya layout cannot name."""
    targets = list(targets)
    return [
        module
        for module in modules
        if any(module == t or module.endswith("." + t) for t in targets)
        and kohya_place(module) is None
    ]


def kohya_flux2_state(state: Mapping[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """`<module>.lora_A/B.weight` (rank `rank`) -> kohya FLUX.2 keys: lora_down, lora_up, alpha;
    each stream's q, k, v fused into one rank-3r LoRA (a missing one as zeros)."""
    modules = [key.removesuffix(A_SUFFIX) for key in state if key.endswith(A_SUFFIX)]
    if missing := unplaced_modules(modules, modules):
        raise ValueError(f"no kohya FLUX.2 name for the LoRA modules {missing[:3]}")
    fused: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
    out: dict[str, Tensor] = {}
    for key in sorted(k for k in state if k.endswith(A_SUFFIX)):
        module = key.removesuffix(A_SUFFIX)
        down, up = state[key], state[module + B_SUFFIX]
        if down.shape[0] != rank:
            raise ValueError(f"{key} has rank {down.shape[0]}, expected {rank}")
        name, index = kohya_place(module)
        if index is None:
            out |= _kohya_entry(name, down, up, alpha)
        else:
            fused.setdefault(name, {})[index] = (down, up)
    for name, members in fused.items():
        down, up = next(iter(members.values()))
        zeros = (torch.zeros_like(down), torch.zeros_like(up))
        downs, ups = zip(*(members.get(index, zeros) for index in range(3)))
        out |= _kohya_entry(name, torch.cat(downs), torch.block_diag(*ups), 3 * alpha)
    return out


def _kohya_entry(name: str, down: Tensor, up: Tensor, alpha: float) -> dict[str, Tensor]:
    """One kohya module's three tensors."""
    return {
        f"{name}.lora_down.weight": down.detach().contiguous(),
        f"{name}.lora_up.weight": up.detach().contiguous(),
        f"{name}.alpha": torch.tensor(float(alpha)),
    }
