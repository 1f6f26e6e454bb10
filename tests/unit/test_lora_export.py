"""LoRA export: files written from peft tensors load into fresh diffusers pipelines, same output."""

from __future__ import annotations

import functools
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from safetensors import safe_open

from splitstage.pipelines.diffusers import lora_export as le
from tests.helpers.tiny_diffusers import build_pipeline

torch.set_num_threads(1)

RANK, ALPHA = 4, 8  # alpha != rank on purpose: a loader that ignores alpha is off by 2x
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
JOINT = [*ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
CASES = {  # name -> (family, component, target modules)
    "sd": (
        "sd",
        "unet",
        [*ATTENTION, "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
        + ["conv1", "conv2", "time_emb_proj"],
    ),
    "sdxl": ("sdxl", "unet", [*ATTENTION, "proj_in", "ff.net.2", "conv1", "time_emb_proj"]),
    "sd3": ("sd3", "transformer", JOINT),
    "flux": ("flux", "transformer", JOINT),
    "flux_mlp": ("flux", "transformer", [*ATTENTION, "proj_mlp", "ff.net.2", "norm1.linear"]),
    "sd_te": ("sd", "text_encoder", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
}
# what comfy/lora.py LORA_CLIP_MAP lets a kohya text-encoder key name
COMFY_CLIP_MODULES = ["mlp_fc1", "mlp_fc2", "self_attn_k_proj", "self_attn_q_proj"]
COMFY_CLIP_MODULES += ["self_attn_v_proj", "self_attn_out_proj"]


def _inputs(family: str, component: str) -> dict:
    """Fixed inputs for the tiny denoiser / text encoder of `family`."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    if component.startswith("text_encoder"):
        return {"input_ids": torch.tensor([[10, 3, 4, 5, 6, 1]])}
    if family == "sd":
        return {
            "sample": r(1, 4, 8, 8),
            "timestep": torch.tensor([10]),
            "encoder_hidden_states": r(1, 5, 32),
        }
    if family == "sdxl":
        added = {"text_embeds": r(1, 48), "time_ids": r(1, 6)}
        return {
            "sample": r(1, 4, 8, 8),
            "timestep": torch.tensor([10]),
            "encoder_hidden_states": r(1, 5, 80),
            "added_cond_kwargs": added,
        }
    joint = {"encoder_hidden_states": r(1, 5, 32), "pooled_projections": r(1, 32)}
    if family == "sd3":
        return {"hidden_states": r(1, 16, 8, 8), "timestep": torch.tensor([10.0]), **joint}
    return {
        "hidden_states": r(1, 16, 64),
        "timestep": torch.tensor([0.5]),
        **joint,
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(5, 3),
        "guidance": torch.tensor([3.5]),
    }


def _output(pipe, family: str, component: str) -> torch.Tensor:
    """The component's first output on the fixed inputs."""
    with torch.no_grad():
        return getattr(pipe, component)(**_inputs(family, component), return_dict=False)[0]


@functools.cache
def trained(case: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(peft state without adapter name, output with the adapter, base output) for a case."""
    family, component, targets = CASES[case]
    pipe = build_pipeline(family)
    base = _output(pipe, family, component)
    model = getattr(pipe, component)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    inject_adapter_in_model(config, model, adapter_name="default")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
    state = get_peft_model_state_dict(model, adapter_name="default")
    assert state and all(".default." not in k for k in state)
    return state, _output(pipe, family, component), base


def _loaded(case: str, source) -> torch.Tensor:
    """Output of a fresh pipeline (same base weights) after `load_lora_weights(source)`."""
    family, component, _ = CASES[case]
    pipe = build_pipeline(family)
    pipe.load_lora_weights(str(source))
    return _output(pipe, family, component)


@pytest.mark.parametrize("case", ["sd", "sdxl", "sd3", "flux", "flux_mlp", "sd_te"])
def test_diffusers_file_loads_at_trained_scale(case, tmp_path):
    family, component, targets = CASES[case]
    state, expected, base = trained(case)
    assert (expected - base).abs().max() > 1e-2  # the adapter does change the output
    path = le.write_diffusers(tmp_path, state, component, RANK, ALPHA, targets)
    assert path.name == "pytorch_lora_weights.safetensors"
    torch.testing.assert_close(_loaded(case, tmp_path), expected, atol=1e-5, rtol=0)


def test_without_metadata_diffusers_would_load_at_scale_one(tmp_path):
    state, expected, base = trained("sd")
    le.write(tmp_path / le.DIFFUSERS_WEIGHT_NAME, le.diffusers_lora_state(state, "unet"), {})
    got = _loaded("sd", tmp_path)  # r inferred from shapes, lora_alpha defaults to r: scale 1
    assert (got - expected).abs().max() > 1e-2 and (got - base).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["sd", "sdxl", "flux", "sd_te"])
def test_kohya_file_loads_in_diffusers(case, tmp_path):
    family, component, _ = CASES[case]
    state, expected, _ = trained(case)
    meta = le.kohya_lora_metadata(family, "tiny", RANK, ALPHA, 64, 10)
    path = le.write_kohya(
        tmp_path / "lora.safetensors", state, component, family, RANK, ALPHA, meta
    )
    torch.testing.assert_close(_loaded(case, path), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["sd", "sdxl", "sd3", "flux", "flux_mlp"])
def test_kohya_names_are_the_ones_comfyui_maps(case):
    """comfy/lora.py maps '<prefix>_' + diffusers weight name, dots as '_'."""
    family, component, _ = CASES[case]
    state, _, _ = trained(case)
    model = getattr(build_pipeline(family), component)
    prefix = le.kohya_prefix(family, component)
    names = [
        n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    comfy = {f"{prefix}_{n.replace('.', '_')}": n for n in names}
    assert len(comfy) == len(names)  # flattening is unambiguous for this model
    kohya = le.kohya_lora_state(state, component, family, RANK, ALPHA)
    mapped = {comfy[k.split(".")[0]] for k in kohya}
    assert mapped == {k.removesuffix(".lora_A.weight") for k in state if "lora_A" in k}
    assert prefix == {"unet": "lora_unet", "transformer": "lora_transformer"}[component]


def test_text_encoder_kohya_names_follow_comfyui_clip_map():
    state, _, _ = trained("sd_te")
    kohya = le.kohya_lora_state(state, "text_encoder", "sd", RANK, ALPHA)
    comfy = {
        f"lora_te_text_model_encoder_layers_{b}_{c}" for b in range(2) for c in COMFY_CLIP_MODULES
    }
    assert {k.split(".")[0] for k in kohya} == comfy
    dstate = le.diffusers_lora_state(state, "text_encoder")
    assert all(k.startswith("text_encoder.text_model.encoder.layers.") for k in dstate)


def test_kohya_layout_is_diffusers_converter_with_real_alpha():
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    state, _, _ = trained("sd")
    ours = le.kohya_lora_state(state, "unet", "sd", RANK, ALPHA)
    theirs = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in state.items()})
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if key.endswith(".alpha"):
            assert value.ndim == 0 and value.item() == ALPHA and theirs[key].item() == RANK
        else:
            assert torch.equal(value, theirs[key])


def test_written_metadata(tmp_path):
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    meta = le.diffusers_lora_metadata("transformer", RANK, ALPHA, ["to_v", "to_q", "to_q"])
    assert json.loads(meta[LORA_ADAPTER_METADATA_KEY]) == {
        "transformer.r": 4,
        "transformer.lora_alpha": 8,
        "transformer.target_modules": ["to_q", "to_v"],
    }
    te = le.diffusers_lora_metadata("text_encoder", RANK, ALPHA, ["q_proj"])
    merged = json.loads(le.merge_diffusers_metadata(meta, te)[LORA_ADAPTER_METADATA_KEY])
    assert merged["text_encoder.r"] == 4 and merged["transformer.r"] == 4
    kohya = le.kohya_lora_metadata("flux", "black-forest-labs/FLUX.1-dev", 4, 8, (1024, 768), 500)
    assert kohya == {
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": "4",
        "ss_network_alpha": "8.0",
        "ss_base_model_version": "flux1",
        "ss_v2": "False",
        "ss_sd_model_name": "black-forest-labs/FLUX.1-dev",
        "ss_resolution": "(1024, 768)",
        "ss_steps": "500",
        "ss_max_train_steps": "500",
    }
    state, _, _ = trained("flux")
    path = le.write_kohya(tmp_path / "k.safetensors", state, "transformer", "flux", 4, 8, kohya)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == kohya


@pytest.mark.parametrize(
    ("state", "error"),
    [
        ({"a.lora_A.default.weight": torch.zeros(4, 2)}, "plain LoRA key"),
        ({"a.lora_A.weight": torch.zeros(4, 2)}, "no matching"),
        (
            {"unet.a.lora_A.weight": torch.zeros(4, 2), "unet.a.lora_B.weight": torch.zeros(2, 4)},
            "relative",
        ),
        ({"a.lora_A.weight": torch.zeros(2, 2), "a.lora_B.weight": torch.zeros(2, 2)}, "rank 2"),
    ],
)
def test_rejects_what_would_not_load(state, error):
    with pytest.raises(ValueError, match=error):
        le.kohya_lora_state(state, "unet", "sd", RANK, ALPHA)


def test_rejects_unknown_family_or_component():
    state = {"a.lora_A.weight": torch.zeros(4, 2), "a.lora_B.weight": torch.zeros(2, 4)}
    with pytest.raises(ValueError, match="family"):
        le.kohya_lora_state(state, "unet", "sd4", RANK, ALPHA)
    with pytest.raises(ValueError, match="no component"):
        le.kohya_lora_state(state, "unet", "flux", RANK, ALPHA)
    with pytest.raises(ValueError, match="component"):
        le.diffusers_lora_state(state, "vae")
