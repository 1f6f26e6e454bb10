"""Trained LoRA tensors as the files diffusers, kohya sd-scripts and ComfyUI load.

Input everywhere is what `peft.get_peft_model_state_dict` gives for one component with the adapter
name removed: `<module>.lora_A.weight` / `<module>.lora_B.weight`, module paths relative to the
component (`unet`, `transformer`, `text_encoder`, `text_encoder_2`, `text_encoder_3`). Two layouts:

- diffusers (`save_lora_weights`): `<component>.<module>.lora_A.weight`, plus the adapter metadata
  diffusers >= 0.34 reads back into the `LoraConfig`, so lora_alpha != r loads at scale alpha / r.
- kohya / ComfyUI: `<prefix>_<module with dots as underscores>.lora_down.weight`, `.lora_up.weight`
  and a scalar `.alpha`; prefixes `lora_unet` (SD, SDXL; Qwen-Image's transformer, as musubi-tuner
  writes it), `lora_transformer` (SD3, FLUX: the OneTrainer spelling ComfyUI maps), `lora_te`
  (SD 1.x/2.x), `lora_te1`/`lora_te2`/`lora_te3`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

FAMILIES = ("sd", "sdxl", "sd3", "flux", "qwenimage", "zimage")
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE

KOHYA_PREFIX = {
    "sd": {"unet": "lora_unet", "text_encoder": "lora_te"},
    "sdxl": {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"},
    "sd3": {
        "transformer": "lora_transformer",
        "text_encoder": "lora_te1",
        "text_encoder_2": "lora_te2",
        "text_encoder_3": "lora_te3",
    },
    "flux": {
        "transformer": "lora_transformer",
        "text_encoder": "lora_te1",
        "text_encoder_2": "lora_te2",
    },
    # musubi-tuner's spelling for Qwen-Image, which diffusers' Qwen LoRA converter reads back
    "qwenimage": {"transformer": "lora_unet"},
    # musubi-tuner's networks.lora_zimage spelling, which diffusers' Z-Image converter reads
    "zimage": {"transformer": "lora_unet"},
}
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")

# kohya sd-scripts' ss_network_module and ss_base_model_version per family
KOHYA_NETWORK_MODULE = {
    "sd": "networks.lora",
    "sdxl": "networks.lora",
    "sd3": "networks.lora_sd3",
    "flux": "networks.lora_flux",
    "qwenimage": "networks.lora_qwen_image",
    "zimage": "networks.lora_zimage",
}
KOHYA_BASE_VERSION = {
    "sd": "sd_v1",
    "sdxl": "sdxl_base_v1-0",
    "sd3": "sd3",
    "flux": "flux1",
    "qwenimage": "qwen_image",
    "zimage": "z_image",
}

# CLIPTextModel is flattened in transformers 5 (no `text_model.`); files keep the classic spelling
_CLIP_FLAT_ROOTS = ("embeddings.", "encoder.layers.", "final_layer_norm.")
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def _check_lora_keys(state: Mapping[str, Tensor]) -> None:
    """Refuse anything but plain LoRA A/B matrices with the adapter name removed."""
    if not state:
        raise ValueError("empty LoRA state dict")
    for key in state:
        if not key.endswith(_LORA_SUFFIXES):
            raise ValueError(f"not a plain LoRA key (lora_A/lora_B weight expected): {key!r}")
        if ".base_layer." in key or key.split(".")[0] in COMPONENTS:
            raise ValueError(f"key must be relative to the component, no base_layer: {key!r}")
        other = key[: -len("A.weight")] + ("B" if key.endswith("A.weight") else "A") + ".weight"
        if other not in state:
            raise ValueError(f"{key} has no matching {other}")


def _canonical(state: Mapping[str, Tensor], component: str) -> dict[str, Tensor]:
    """Module-relative keys; CLIP ones as `text_model.encoder...`, as every loader spells them."""
    _check_lora_keys(state)
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {COMPONENTS}")
    clip_flat = component.startswith("text_encoder")
    out = {}
    for key, tensor in state.items():
        if clip_flat and key.startswith(_CLIP_FLAT_ROOTS):
            key = "text_model." + key
        out[key] = tensor.detach().contiguous()
    return out


def diffusers_lora_state(state: Mapping[str, Tensor], component: str) -> dict[str, Tensor]:
    """Keys as diffusers' `save_lora_weights` writes them: '<component>.<module>.lora_A.weight'."""
    return {f"{component}.{key}": t for key, t in _canonical(state, component).items()}


def diffusers_lora_metadata(
    component: str, rank: int, alpha: float, target_modules: Iterable[str]
) -> dict[str, str]:
    """Safetensors metadata diffusers >= 0.34 reads into LoraConfig: alpha != rank loads right."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {COMPONENTS}")
    # `LoraConfig(**config)` is what diffusers builds from it; these three keys load on any peft
    config = {"r": int(rank), "lora_alpha": alpha, "target_modules": sorted(set(target_modules))}
    packed = {f"{component}.{key}": value for key, value in config.items()}
    return {
        "format": "pt",
        LORA_ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True),
    }


def merge_diffusers_metadata(*metadatas: Mapping[str, str]) -> dict[str, str]:
    """One file's metadata for several components (diffusers needs one entry per component)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    packed: dict[str, object] = {}
    for metadata in metadatas:
        packed.update(json.loads(metadata[LORA_ADAPTER_METADATA_KEY]))
    return {
        "format": "pt",
        LORA_ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True),
    }


def kohya_prefix(family: str, component: str) -> str:
    """The kohya key prefix of `component` in `family` (e.g. 'lora_unet', 'lora_te2')."""
    if family not in KOHYA_PREFIX:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if component not in KOHYA_PREFIX[family]:
        raise ValueError(f"{family} has no component {component!r}: {sorted(KOHYA_PREFIX[family])}")
    return KOHYA_PREFIX[family][component]


def kohya_lora_state(
    state: Mapping[str, Tensor], component: str, family: str, rank: int, alpha: float
) -> dict[str, Tensor]:
    """kohya / ComfyUI layout: '<prefix>_<path_with_underscores>.lora_down.weight', up, alpha."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    prefix = kohya_prefix(family, component)
    canonical = _canonical(state, component)
    for key, tensor in canonical.items():
        if key.endswith(".lora_A.weight") and tensor.shape[0] != rank:
            raise ValueError(f"{key} has rank {tensor.shape[0]}, expected {rank}")
    # diffusers' converter renames A/B to down/up and flattens the module path; its alpha is
    # the rank (scale 1) and it only knows unet/text_encoder(_2) prefixes, so both are set here
    flat = convert_state_dict_to_kohya(canonical)
    out = {f"{prefix}_{key}": t for key, t in flat.items() if not key.endswith(".alpha")}
    for key in [k for k in out if k.endswith(".lora_down.weight")]:
        out[key.removesuffix("lora_down.weight") + "alpha"] = torch.tensor(float(alpha))
    return out


def kohya_lora_metadata(
    family: str,
    base_model: str,
    rank: int,
    alpha: float,
    resolution: int | tuple[int, int],
    steps: int,
    *,
    v2: bool = False,
    base_model_version: str | None = None,
    output_name: str | None = None,
    extra: Mapping[str, object] | None = None,
) -> dict[str, str]:
    """kohya sd-scripts' ss_* metadata (network module, dim, alpha, base version, resolution...)."""
    if family not in KOHYA_NETWORK_MODULE:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    version = base_model_version or ("sd_v2" if v2 else KOHYA_BASE_VERSION[family])
    metadata: dict[str, object] = {
        "ss_network_module": KOHYA_NETWORK_MODULE[family],
        "ss_network_dim": int(rank),
        "ss_network_alpha": float(alpha),
        "ss_base_model_version": version,
        "ss_v2": bool(v2),
        "ss_sd_model_name": base_model,
        "ss_resolution": (int(width), int(height)),  # sd-scripts stores str((w, h))
        "ss_steps": int(steps),
        "ss_max_train_steps": int(steps),
    }
    if output_name is not None:
        metadata["ss_output_name"] = output_name
    metadata.update(extra or {})
    return {key: str(value) for key, value in metadata.items()}  # sd-scripts: all values str()


def write(path: str | Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> Path:
    """Write one safetensors LoRA file (parent folders created); returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path), metadata=dict(metadata))
    return path


def write_diffusers(
    folder: str | Path,
    state: Mapping[str, Tensor],
    component: str,
    rank: int,
    alpha: float,
    target_modules: Iterable[str],
) -> Path:
    """`folder/pytorch_lora_weights.safetensors` for `pipe.load_lora_weights(folder)`."""
    tensors = diffusers_lora_state(state, component)
    metadata = diffusers_lora_metadata(component, rank, alpha, target_modules)
    return write(Path(folder) / DIFFUSERS_WEIGHT_NAME, tensors, metadata)


def write_kohya(
    path: str | Path,
    state: Mapping[str, Tensor],
    component: str,
    family: str,
    rank: int,
    alpha: float,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """One kohya-layout .safetensors file, for ComfyUI and `pipe.load_lora_weights(path)`."""
    return write(path, kohya_lora_state(state, component, family, rank, alpha), metadata or {})
