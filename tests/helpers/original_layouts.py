"""Diffusers state dicts written back in their original single-file layouts (BFL FLUX, LDM SD
UNet, SD3), by hand from the published key tables: the inverse of diffusers' `from_single_file`
converters, independent of the key rules under test."""

from __future__ import annotations

import re

import torch

D = r"transformer_blocks\.(\d+)\."  # a double block
S = r"single_transformer_blocks\.(\d+)\."  # a single block
FLUX_RENAMES = [  # diffusers (regex) -> BFL; fused tensors are built in `flux_to_bfl`
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
    (S + r"attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale"),
    (S + r"attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale"),
    (S + r"proj_out\.", r"single_blocks.\1.linear2."),
    (r"proj_out\.", "final_layer.linear."),
]  # fmt: skip


def flux_to_bfl(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel state dict in BFL's flux1-dev.safetensors layout."""
    out: dict[str, torch.Tensor] = {}
    fused = {
        r"^" + D + r"attn\.to_([qkv])\.(\w+)$": "double_blocks.{0}.img_attn.qkv.{2}",
        r"^" + D + r"attn\.add_([qkv])_proj\.(\w+)$": "double_blocks.{0}.txt_attn.qkv.{2}",
        r"^" + S + r"attn\.to_([qkv])\.(\w+)$": "single_blocks.{0}.linear1.{2}",
        r"^" + S + r"proj_(mlp)\.(\w+)$": "single_blocks.{0}.linear1.{2}",
    }  # fmt: skip
    order = {"q": 0, "k": 1, "v": 2, "mlp": 3}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        for pattern, target in fused.items():
            match = re.match(pattern, key)
            if match:
                name = target.format(*match.groups())
                parts.setdefault(name, {})[order[match.group(2)]] = tensor
                break
        else:
            if key.startswith("norm_out.linear."):  # diffusers holds (scale, shift): swap back
                scale, shift = tensor.chunk(2, dim=0)
                out[key.replace("norm_out.linear.", "final_layer.adaLN_modulation.1.")] = torch.cat(
                    [shift, scale]
                )
                continue
            for pattern, target in FLUX_RENAMES:
                renamed, count = re.subn(f"^{pattern}", target, key)
                if count:
                    out[renamed] = tensor
                    break
            else:
                raise KeyError(f"no BFL name for {key}")
    for name, pieces in parts.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)])
    return {prefix + key: tensor.contiguous() for key, tensor in out.items()}


RESNET_RENAMES = [  # diffusers -> LDM inside a resnet
    ("norm1.", "in_layers.0."),
    ("conv1.", "in_layers.2."),
    ("time_emb_proj.", "emb_layers.1."),
    ("norm2.", "out_layers.0."),
    ("conv2.", "out_layers.3."),
    ("conv_shortcut.", "skip_connection."),
]
UNET_TOP = {  # diffusers -> LDM outside the blocks
    "conv_in.": "input_blocks.0.0.",
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",
    "add_embedding.linear_2.": "label_emb.0.2.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
}


def unet_to_ldm(
    state: dict[str, torch.Tensor], layers_per_block: int, prefix: str = "model.diffusion_model."
) -> dict[str, torch.Tensor]:
    """A UNet2DConditionModel state dict in the LDM (SD 1.x / SDXL single-file) layout."""
    per = layers_per_block + 1  # LDM numbers each resnet(+attention) and sampler as one block
    attended = {int(k.split(".")[1]) for k in state if re.match(r"up_blocks\.\d+\.attentions", k)}

    def resnet(rest: str) -> str:
        for old, new in RESNET_RENAMES:
            if rest.startswith(old):
                return new + rest[len(old) :]
        raise KeyError(f"no LDM name for resnet tensor {rest}")

    def ldm(key: str) -> str:
        for old, new in UNET_TOP.items():
            if key.startswith(old):
                return new + key[len(old) :]
        if m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
            i = 1 + int(m[1]) * per + int(m[3])
            if m[2] == "resnets":
                return f"input_blocks.{i}.0.{resnet(m[4])}"
            return f"input_blocks.{i}.1.{m[4]}"
        if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
            return f"input_blocks.{1 + int(m[1]) * per + layers_per_block}.0.op.{m[2]}"
        if m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", key):
            return f"middle_block.{2 * int(m[1])}.{resnet(m[2])}"
        if m := re.match(r"mid_block\.attentions\.0\.(.*)", key):
            return f"middle_block.1.{m[1]}"
        if m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
            i = int(m[1]) * per + int(m[3])
            if m[2] == "resnets":
                return f"output_blocks.{i}.0.{resnet(m[4])}"
            return f"output_blocks.{i}.1.{m[4]}"
        if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key):
            slot = 2 if int(m[1]) in attended else 1  # after the attention, if the block has one
            return f"output_blocks.{int(m[1]) * per + layers_per_block}.{slot}.conv.{m[2]}"
        raise KeyError(f"no LDM name for {key}")

    return {prefix + ldm(key): tensor.contiguous() for key, tensor in state.items()}


J = r"transformer_blocks\.(\d+)\."  # an SD3 joint block
SD3_RENAMES = [  # diffusers (regex) -> original SD3; fused qkv and swaps are in `sd3_to_original`
    (r"pos_embed\.pos_embed", "pos_embed"),
    (r"pos_embed\.proj\.", "x_embedder.proj."),
    (r"time_text_embed\.timestep_embedder\.linear_1\.", "t_embedder.mlp.0."),
    (r"time_text_embed\.timestep_embedder\.linear_2\.", "t_embedder.mlp.2."),
    (r"time_text_embed\.text_embedder\.linear_1\.", "y_embedder.mlp.0."),
    (r"time_text_embed\.text_embedder\.linear_2\.", "y_embedder.mlp.2."),
    (r"context_embedder\.", "context_embedder."),
    (J + r"attn\.norm_q\.", r"joint_blocks.\1.x_block.attn.ln_q."),
    (J + r"attn\.norm_k\.", r"joint_blocks.\1.x_block.attn.ln_k."),
    (J + r"attn\.norm_added_q\.", r"joint_blocks.\1.context_block.attn.ln_q."),
    (J + r"attn\.norm_added_k\.", r"joint_blocks.\1.context_block.attn.ln_k."),
    (J + r"attn\.to_out\.0\.", r"joint_blocks.\1.x_block.attn.proj."),
    (J + r"attn\.to_add_out\.", r"joint_blocks.\1.context_block.attn.proj."),
    (J + r"attn2\.norm_q\.", r"joint_blocks.\1.x_block.attn2.ln_q."),
    (J + r"attn2\.norm_k\.", r"joint_blocks.\1.x_block.attn2.ln_k."),
    (J + r"attn2\.to_out\.0\.", r"joint_blocks.\1.x_block.attn2.proj."),
    (J + r"norm1\.linear\.", r"joint_blocks.\1.x_block.adaLN_modulation.1."),
    (J + r"ff\.net\.0\.proj\.", r"joint_blocks.\1.x_block.mlp.fc1."),
    (J + r"ff\.net\.2\.", r"joint_blocks.\1.x_block.mlp.fc2."),
    (J + r"ff_context\.net\.0\.proj\.", r"joint_blocks.\1.context_block.mlp.fc1."),
    (J + r"ff_context\.net\.2\.", r"joint_blocks.\1.context_block.mlp.fc2."),
    (r"proj_out\.", "final_layer.linear."),
]  # fmt: skip


def sd3_to_original(
    state: dict[str, torch.Tensor], prefix: str = "model.diffusion_model."
) -> dict[str, torch.Tensor]:
    """An SD3Transformer2DModel state dict in the original (SD3 medium single-file) layout."""
    fused = {
        r"^" + J + r"attn\.to_([qkv])\.(\w+)$": "joint_blocks.{0}.x_block.attn.qkv.{2}",
        r"^" + J + r"attn\.add_([qkv])_proj\.(\w+)$": "joint_blocks.{0}.context_block.attn.qkv.{2}",
        r"^" + J + r"attn2\.to_([qkv])\.(\w+)$": "joint_blocks.{0}.x_block.attn2.qkv.{2}",
    }  # fmt: skip
    last = max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = next((m for p in fused if (m := re.match(p, key))), None)
        if match:
            name = fused[match.re.pattern].format(*match.groups())
            parts.setdefault(name, {})[match.group(2)] = tensor
            continue
        if m := re.match(J + r"norm1_context\.linear\.(\w+)$", key):
            name = f"joint_blocks.{m[1]}.context_block.adaLN_modulation.1.{m[2]}"
            # diffusers holds the last (context_pre_only) block's as (scale, shift): swap back
            out[name] = torch.cat(tensor.chunk(2)[::-1]) if int(m[1]) == last else tensor
            continue
        if key.startswith("norm_out.linear."):  # (scale, shift) in diffusers: swap back
            name = key.replace("norm_out.linear.", "final_layer.adaLN_modulation.1.")
            out[name] = torch.cat(tensor.chunk(2)[::-1])
            continue
        for pattern, target in SD3_RENAMES:
            renamed, count = re.subn(f"^{pattern}", target, key)
            if count:
                out[renamed] = tensor
                break
        else:
            raise KeyError(f"no original SD3 name for {key}")
    for name, pieces in parts.items():
        out[name] = torch.cat([pieces[c] for c in "qkv"])
    return {prefix + key: tensor.contiguous() for key, tensor in out.items()}
