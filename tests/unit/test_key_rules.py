"""Key rules found by running a converter on a row-id proxy: renames, dim-0 splits and row
swaps read exactly (whole or by region); anything else is refused; an LDM UNet checkpoint reads
as renames of its UNet tensors, an original SD3 file as all of the model's tensors; a file the
converter cannot map is refused in one line."""

from __future__ import annotations

import pytest
import torch

from splitstage.pipelines.diffusers.single_file import SingleFileError, single_file_rules
from splitstage.pipelines.key_rules import KeyRuleError, derive_rules
from tests.helpers.original_layouts import sd3_to_original, unet_to_ldm


def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A converter in diffusers' style: a rename, a fused qkv split, a shift/scale swap."""
    q, k, v = torch.chunk(state["qkv"], 3, dim=0)
    shift, scale = state["mod"].chunk(2, dim=0)
    return {"w": state["a"], "q": q, "k": k, "v": v, "norm": torch.cat([scale, shift])}


def test_rules_read_what_the_converter_computes_region_by_region():
    state = {"a": torch.randn(4, 3), "qkv": torch.randn(6, 5), "mod": torch.randn(8)}
    shapes = {key: tuple(t.shape) for key, t in state.items()}
    rules = derive_rules(convert, shapes)
    want = convert(dict(state))
    assert rules["w"].is_rename(shapes) and not rules["k"].is_rename(shapes)

    def read(name, region):
        return state[name] if region is None else state[name][region]

    for key, rule in rules.items():
        assert rule.shape(shapes) == tuple(want[key].shape)
        assert torch.equal(rule.read(read, shapes, None), want[key])
        rows = want[key].shape[0]
        for lo, hi in [(0, 1), (1, rows), (rows // 2, rows), (rows, rows)]:
            region = (slice(lo, hi), *(slice(0, n) for n in want[key].shape[1:]))
            assert torch.equal(rule.read(read, shapes, region), want[key][region]), (key, lo)


def test_a_converter_that_computes_values_is_refused():
    with pytest.raises(KeyRuleError, match="w: the converter"):
        derive_rules(lambda s: {"w": s["a"] * 2}, {"a": (4, 3)})
    with pytest.raises(KeyRuleError, match="beyond rows"):
        derive_rules(lambda s: {"w": s["a"].reshape(1, -1).repeat(2, 1)}, {"a": (4, 1)})


def tiny_unet():
    """A 2-level UNet2DConditionModel on meta (the tiny SD one's shape)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        return UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            norm_num_groups=8,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
        )


def test_an_ldm_unet_checkpoint_reads_as_renames_of_its_unet_tensors():
    unet = tiny_unet()
    state = unet.state_dict()
    ldm = unet_to_ldm(state, layers_per_block=1)
    ldm["first_stage_model.encoder.conv_in.weight"] = torch.empty(8, 3, 3, 3, device="meta")
    shapes = {key: tuple(t.shape) for key, t in ldm.items()}
    rules, layout = single_file_rules(unet, shapes)
    assert layout == "original (LDM) Stable Diffusion"
    assert set(rules) == set(state)
    for key, rule in rules.items():
        assert rule.is_rename(shapes), key
        assert rule.shape(shapes) == tuple(state[key].shape), key
    assert not any(p.key.startswith("first_stage_model.") for r in rules.values() for p in r.pieces)
    assert single_file_rules(unet, {"conv_in.weight": (32, 4, 3, 3)}) is None


def tiny_sd3(**overrides):
    """A 2-block SD3Transformer2DModel on meta (the tiny SD3 one's shape)."""
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel

    config = {
        "sample_size": 8,
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 16,
        "num_layers": 2,
        "attention_head_dim": 8,
        "num_attention_heads": 4,
        "joint_attention_dim": 32,
        "caption_projection_dim": 32,
        "pooled_projection_dim": 32,
        "pos_embed_max_size": 16,
    }
    with init_empty_weights():
        return SD3Transformer2DModel(**(config | overrides))


@pytest.mark.parametrize("overrides", [{}, {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}])
def test_an_original_sd3_file_reads_every_tensor_of_the_model(overrides):
    sd3 = tiny_sd3(**overrides)  # SD3 medium's layout, then 3.5's (qk norms, a second attention)
    state = sd3.state_dict()
    shapes = {key: tuple(t.shape) for key, t in sd3_to_original(state).items()}
    rules, layout = single_file_rules(sd3, shapes)
    assert layout == "original SD3"
    assert {key: rule.shape(shapes) for key, rule in rules.items()} == {
        key: tuple(t.shape) for key, t in state.items()
    }


def test_a_file_of_another_architecture_is_refused_in_one_line():
    marker = "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"
    with pytest.raises(SingleFileError, match="cannot convert it .*original SD3") as error:
        single_file_rules(tiny_sd3(), {marker: (192,)})
    assert "\n" not in str(error.value)
    assert single_file_rules(tiny_sd3(), {"pos_embed.pos_embed": (1, 256, 32)}) is None
