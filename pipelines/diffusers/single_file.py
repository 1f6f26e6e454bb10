"""Original-layout single files (BFL's flux1-dev.safetensors, LDM SD 1.x / SDXL UNets, original
SD3) read through diffusers' own `from_single_file` converters, as key maps with slice rules.

The converter (diffusers.loaders.single_file_model's `checkpoint_mapping_fn` for the class) runs
once on a row-id proxy of the file's header (`key_rules.derive_rules`): no weights are read, and
each rank later reads only its slices of the original tensors. The converter gets the model's
diffusers config, as `from_single_file(config=...)` does (the LDM UNet one numbers blocks by
its layers_per_block); a full checkpoint's other tensors (VAE, text encoders, EMA) are
ignored, as diffusers ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from splitstage.pipelines.key_rules import KeyRuleError, Rule, derive_rules

# Class -> (layout name for messages, keys one of which marks the original layout: the
# CHECKPOINT_KEY_NAMES diffusers detects these files by; an LDM UNet by its conv_in). Each
# converter is renames / row slices only, tested exact against the diffusers folder's load.
LAYOUTS = {
    "FluxTransformer2DModel": ("BFL FLUX", "flux"),
    "SD3Transformer2DModel": ("original SD3", "sd3"),
    "UNet2DConditionModel": ("original (LDM) Stable Diffusion", "inpainting"),
}
FLUX_CONVERTER_WIDTH = 3072  # diffusers' FLUX converter hard-codes inner_dim = 3072


class SingleFileError(ValueError):
    """An original-layout file diffusers' converter cannot map onto the model; one line."""


def layout_name(model: nn.Module) -> str | None:
    """The original layout a model's class can read ('BFL FLUX'...), None when it has none."""
    entry = LAYOUTS.get(_class_name(model))
    return entry[0] if entry else None


def is_original_layout(model: nn.Module, keys) -> bool:
    """True when the file's keys carry the marker of the class's original layout."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    entry = LAYOUTS.get(_class_name(model))
    if entry is None:
        return False
    markers = CHECKPOINT_KEY_NAMES[entry[1]]
    markers = [markers] if isinstance(markers, str) else markers
    keys = set(keys)
    return any(marker in keys for marker in markers)


def single_file_rules(
    model: nn.Module, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, Rule], str] | None:
    """({model key: Rule}, layout name) reading an original-layout file into `model`; None when
    the file is not in its class's original layout (header shapes only; no tensor is read)."""
    if not is_original_layout(model, shapes):
        return None
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    plain = _plain(model)
    name = _class_name(model)
    convert = SINGLE_FILE_LOADABLE_CLASSES[name]["checkpoint_mapping_fn"]
    config: dict[str, Any] = dict(plain.config)
    scale = _row_scale(plain)
    try:
        rules = derive_rules(lambda proxy: convert(proxy, config=config), shapes, row_scale=scale)
    except KeyRuleError as error:
        raise SingleFileError(f"diffusers' {convert.__name__} {error}") from None
    except (KeyError, IndexError, RuntimeError, ValueError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise SingleFileError(
            f"diffusers' {convert.__name__} cannot convert it ({reason}); is it a "
            f"{LAYOUTS[name][0]} checkpoint of this architecture?"
        ) from None
    return rules, LAYOUTS[name][0]


def _row_scale(model: nn.Module) -> int:
    """How many times wider diffusers' FLUX converter assumes the model is (1 at real size)."""
    if _class_name(model) != "FluxTransformer2DModel":
        return 1
    width = model.config.num_attention_heads * model.config.attention_head_dim
    if FLUX_CONVERTER_WIDTH % width:
        raise SingleFileError(
            f"diffusers' FLUX converter assumes width {FLUX_CONVERTER_WIDTH}, which {width} "
            "does not divide"
        )
    return FLUX_CONVERTER_WIDTH // width


def _plain(model: nn.Module) -> nn.Module:
    """The diffusers model under a peft wrapper, if any."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _class_name(model: nn.Module) -> str:
    """The model's diffusers class name, also once fully_shard swapped in its FSDP subclass."""
    for cls in type(_plain(model)).__mro__:
        if cls.__name__ in LAYOUTS:
            return cls.__name__
    return type(_plain(model)).__name__
