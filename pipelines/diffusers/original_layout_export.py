"""Original-layout single files (LDM SD 1.x / SDXL UNet, original SD3, BFL FLUX) written from a
trained diffusers denoiser: diffusers' own `from_single_file` converter, inverted.

Each diffusers key gets its original name from the tables below (several keys naming one original
tensor are fused, as qkv and FLUX's linear1 are); where each key's rows go inside that tensor
(the fused order, the scale/shift swaps) is not written here: diffusers' converter is run on a
row-id proxy of the original header (`single_file.single_file_rules`, as loading does) and its
answer read backwards. The result is checked to cover every original row exactly once and to
give back every diffusers tensor, else refused. Only the denoiser is written (no VAE or text
encoders): the file ComfyUI's "Load Diffusion Model" node and diffusers' `from_single_file` of
the denoiser class read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from splitstage.pipelines.diffusers.single_file import (
    SingleFileError,
    layout_name,
    single_file_rules,
)

log = logging.getLogger(__name__)
ORIGINAL_SUFFIX = "_original"  # <output>/<component>_original.safetensors, beside <component>/
LDM_PREFIX = "model.diffusion_model."  # what an LDM / SD3 checkpoint puts before the denoiser

D = r"transformer_blocks\.(\d+)\."  # a FLUX double block, an SD3 joint block
S = r"single_transformer_blocks\.(\d+)\."  # a FLUX single block
FLUX_NAMES = [  # diffusers (regex, whole key start) -> BFL flux1-dev.safetensors
    (r"time_text_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"time_text_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"time_text_embed\.text_embedder\.linear_1\.", "vector_in.in_layer."),
    (r"time_text_embed\.text_embedder\.linear_2\.", "vector_in.out_layer."),
    (r"time_text_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"time_text_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"context_embedder\.", "txt_in."),
    (r"x_embedder\.", "img_in."),
    (D + r"norm1\.linear\.", r"double_blocks.\1.img_mod.lin."),
    (D + r"norm1_context\.linear\.", r"double_blocks.\1.txt_mod.lin."),
    (D + r"attn\.to_[qkv]\.", r"double_blocks.\1.img_attn.qkv."),
    (D + r"attn\.add_[qkv]_proj\.", r"double_blocks.\1.txt_attn.qkv."),
    (D + r"attn\.norm_q\.weight", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (D + r"attn\.norm_k\.weight", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (D + r"attn\.norm_added_q\.weight", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (D + r"attn\.norm_added_k\.weight", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (D + r"ff\.net\.0\.proj\.", r"double_blocks.\1.img_mlp.0."),
    (D + r"ff\.net\.2\.", r"double_blocks.\1.img_mlp.2."),
    (D + r"ff_context\.net\.0\.proj\.", r"double_blocks.\1.txt_mlp.0."),
    (D + r"ff_context\.net\.2\.", r"double_blocks.\1.txt_mlp.2."),
    (D + r"attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (D + r"attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (S + r"norm\.linear\.", r"single_blocks.\1.modulation.lin."),
    (S + r"(attn\.to_[qkv]|proj_mlp)\.", r"single_blocks.\1.linear1."),
    (S + r"attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale"),
    (S + r"attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale"),
    (S + r"proj_out\.", r"single_blocks.\1.linear2."),
    (r"proj_out\.", "final_layer.linear."),
    (r"norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
]  # fmt: skip
SD3_NAMES = [  # diffusers (regex, whole key start) -> original SD3 (sd3_medium.safetensors)
    (r"pos_embed\.pos_embed", "pos_embed"),
    (r"pos_embed\.proj\.", "x_embedder.proj."),
    (r"time_text_embed\.timestep_embedder\.linear_1\.", "t_embedder.mlp.0."),
    (r"time_text_embed\.timestep_embedder\.linear_2\.", "t_embedder.mlp.2."),
    (r"time_text_embed\.text_embedder\.linear_1\.", "y_embedder.mlp.0."),
    (r"time_text_embed\.text_embedder\.linear_2\.", "y_embedder.mlp.2."),
    (r"context_embedder\.", "context_embedder."),
    (D + r"attn\.to_[qkv]\.", r"joint_blocks.\1.x_block.attn.qkv."),
    (D + r"attn\.add_[qkv]_proj\.", r"joint_blocks.\1.context_block.attn.qkv."),
    (D + r"attn2\.to_[qkv]\.", r"joint_blocks.\1.x_block.attn2.qkv."),
    (D + r"attn\.norm_q\.", r"joint_blocks.\1.x_block.attn.ln_q."),
    (D + r"attn\.norm_k\.", r"joint_blocks.\1.x_block.attn.ln_k."),
    (D + r"attn\.norm_added_q\.", r"joint_blocks.\1.context_block.attn.ln_q."),
    (D + r"attn\.norm_added_k\.", r"joint_blocks.\1.context_block.attn.ln_k."),
    (D + r"attn\.to_out\.0\.", r"joint_blocks.\1.x_block.attn.proj."),
    (D + r"attn\.to_add_out\.", r"joint_blocks.\1.context_block.attn.proj."),
    (D + r"attn2\.norm_q\.", r"joint_blocks.\1.x_block.attn2.ln_q."),
    (D + r"attn2\.norm_k\.", r"joint_blocks.\1.x_block.attn2.ln_k."),
    (D + r"attn2\.to_out\.0\.", r"joint_blocks.\1.x_block.attn2.proj."),
    (D + r"norm1\.linear\.", r"joint_blocks.\1.x_block.adaLN_modulation.1."),
    (D + r"norm1_context\.linear\.", r"joint_blocks.\1.context_block.adaLN_modulation.1."),
    (D + r"ff\.net\.0\.proj\.", r"joint_blocks.\1.x_block.mlp.fc1."),
    (D + r"ff\.net\.2\.", r"joint_blocks.\1.x_block.mlp.fc2."),
    (D + r"ff_context\.net\.0\.proj\.", r"joint_blocks.\1.context_block.mlp.fc1."),
    (D + r"ff_context\.net\.2\.", r"joint_blocks.\1.context_block.mlp.fc2."),
    (r"proj_out\.", "final_layer.linear."),
    (r"norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
]  # fmt: skip
RESNET_NAMES = {  # inside a resnet, diffusers -> LDM (update_unet_resnet_ldm_to_diffusers)
    "norm1.": "in_layers.0.",
    "conv1.": "in_layers.2.",
    "time_emb_proj.": "emb_layers.1.",
    "norm2.": "out_layers.0.",
    "conv2.": "out_layers.3.",
    "conv_shortcut.": "skip_connection.",
}


class OriginalLayoutError(ValueError):
    """A trained state diffusers' converter cannot be inverted onto; the message says why."""


def original_layout_files(component: str, model: nn.Module) -> dict[str, tuple[str, bytes]]:
    """`<component>_original.safetensors` of `model` (its dtype); else {} (warned if refused)."""
    layout = layout_name(model)
    if layout is None:
        return {}
    try:
        state = original_layout_state(model, model.state_dict())
    except (OriginalLayoutError, SingleFileError) as error:
        log.warning("%s: no %s single file written: %s", component, layout, error)
        return {}
    name = f"{component}{ORIGINAL_SUFFIX}"
    return {name: (f"{name}.safetensors", save(state, {"format": "pt"}))}


def original_layout_state(
    model: nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state` in the original layout whose diffusers conversion gives `state` back exactly."""
    prefix = "" if layout_name(model) == "BFL FLUX" else LDM_PREFIX
    names = {key: prefix + original_name(model, key) for key in state}
    groups: dict[str, list[str]] = {}
    for key, original in names.items():
        groups.setdefault(original, []).append(key)
    shapes = {original: _fused_shape(original, keys, state) for original, keys in groups.items()}
    found = single_file_rules(model, shapes)  # diffusers' converter on a row-id proxy
    if found is None:
        raise OriginalLayoutError("the written keys lack the layout's marker key")
    rules = found[0]
    if set(rules) != set(state):
        odd = sorted(set(rules) ^ set(state))[:3]
        raise OriginalLayoutError(f"the converter's keys differ from the model's at {odd}")
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for key, rule in rules.items():
        tensor = state[key]
        if rule.shape(shapes) != tuple(tensor.shape):
            raise OriginalLayoutError(f"{key}: the converter reads shape {rule.shape(shapes)}")
        row = 0
        for piece in rule.pieces:
            name, rows = piece.key, slice(piece.start, piece.stop)
            if name not in filled:
                filled[name] = torch.zeros(max(shapes[name][:1], default=1), dtype=torch.bool)
            if filled[name][rows].any():
                raise OriginalLayoutError(f"{name}: rows read twice by the converter")
            if rule.is_rename(shapes):  # the whole tensor under another name: no copy
                out[name] = tensor
            else:
                if name not in out:
                    out[name] = torch.empty(shapes[name], dtype=tensor.dtype, device=tensor.device)
                part = tensor[row : row + piece.stop - piece.start]
                out[name][rows] = part.reshape(out[name][rows].shape)
            filled[name][rows] = True
            row += piece.stop - piece.start
    unread = [name for name in shapes if name not in filled or not bool(filled[name].all())]
    if unread:
        raise OriginalLayoutError(f"{unread[0]}: rows the converter never reads")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def original_name(model: nn.Module, key: str) -> str:
    """The original-layout name (without the checkpoint prefix) of the diffusers key `key`."""
    layout = layout_name(model)
    if layout == "original (LDM) Stable Diffusion":
        return _ldm_name(key, model.config)
    table = FLUX_NAMES if layout == "BFL FLUX" else SD3_NAMES
    for pattern, target in table:
        renamed, count = re.subn(f"^{pattern}", target, key)
        if count:
            return renamed
    raise OriginalLayoutError(f"no {layout} name for {key}")


def _ldm_name(key: str, config: Mapping[str, Any]) -> str:
    """An LDM UNet name: LDM numbers each resnet (+ attention) and each sampler as one block."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    top = {k: v for table in DIFFUSERS_TO_LDM_MAPPING["unet"].values() for k, v in table.items()}
    top["class_embedding.weight"] = "label_emb.weight"  # num_class_embeds
    if key in top:
        return top[key]
    lpb = config["layers_per_block"]
    per = lpb + 1
    if m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
        index = 1 + int(m[1]) * per + int(m[3])
        return f"input_blocks.{index}." + _in_block(m[2], m[4])
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
        return f"input_blocks.{1 + int(m[1]) * per + lpb}.0.op.{m[2]}"
    if m := re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", key):
        index = 2 * int(m[2]) + (m[1] == "attentions")
        return f"middle_block.{index}." + _in_block(m[1], m[3])[2:]
    if m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
        return f"output_blocks.{int(m[1]) * per + int(m[3])}." + _in_block(m[2], m[4])
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key):
        block = int(m[1])
        slot = 2 if "CrossAttn" in config["up_block_types"][block] else 1  # after its attention
        return f"output_blocks.{block * per + lpb}.{slot}.conv.{m[2]}"
    raise OriginalLayoutError(f"no LDM name for {key}")


def _in_block(kind: str, rest: str) -> str:
    """`0.<resnet part>` or `1.<attention part>` inside one LDM block."""
    if kind == "attentions":
        return f"1.{rest}"
    for old, new in RESNET_NAMES.items():
        if rest.startswith(old):
            return f"0.{new}{rest[len(old) :]}"
    raise OriginalLayoutError(f"no LDM name for resnet tensor {rest}")


def _fused_shape(name: str, keys: list[str], state: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """The original tensor's shape: its diffusers parts stacked along dim 0."""
    shapes = [tuple(state[key].shape) for key in keys]
    if len(shapes) == 1:
        return shapes[0]
    if any(not shape or shape[1:] != shapes[0][1:] for shape in shapes):
        raise OriginalLayoutError(f"{name}: its parts {keys[:2]} do not stack along rows")
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])
