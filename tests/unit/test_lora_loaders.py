"""Every LoRA component a diffusers family exports loads with the loader that reads its files.

The pipeline's own `load_lora_weights` reads only its `_lora_loadable_modules`: a LoRA of the
T5 of flux or sd3 in diffusers' file would be skipped without an error, so those are written as a
PEFT adapter folder (and the kohya file ComfyUI maps). Each case trains nothing: random LoRA
weights on the tiny pipelines' real components, exported by `lora_files`, loaded back into a
fresh pipeline, same output.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict, inject_adapter_in_model
from safetensors import safe_open

from splitstage.pipelines.diffusers.base import CLIP_LORA_TARGETS, T5_LORA_TARGETS
from splitstage.pipelines.diffusers.component_export import (
    LORA_COMPONENTS,
    PIPELINE_LORA_MODULES,
    lora_files,
)
from splitstage.pipelines.diffusers.lora_export import DIFFUSERS_WEIGHT_NAME, kohya_prefix
from splitstage.pipelines.family import ExportRequest
from tests.helpers.tiny_diffusers import build_pipeline

torch.set_num_threads(1)

RANK, ALPHA = 4, 8  # alpha != rank: a loader that ignores alpha is off by 2x
TEXT_CASES = [
    (family, component)
    for family, components in LORA_COMPONENTS.items()
    for component in components
    if component.startswith("text_encoder")
]
IDS = torch.tensor([[10, 3, 4, 5, 6, 1]])


def test_the_table_is_what_each_pipeline_loads():
    """PIPELINE_LORA_MODULES equals each family's diffusers pipeline's `_lora_loadable_modules`."""
    import diffusers

    for family in PIPELINE_LORA_MODULES:
        pipe = build_pipeline(family)
        loads = type(pipe)._lora_loadable_modules
        assert tuple(loads) == PIPELINE_LORA_MODULES[family], (family, loads)
        assert isinstance(pipe, diffusers.DiffusionPipeline)


def _output(pipe, component: str) -> torch.Tensor:
    """The text encoder's last hidden state on fixed token ids (eval: T5 has dropout)."""
    with torch.no_grad():
        return getattr(pipe, component).eval()(IDS)[0]


@functools.cache
def trained(family: str, component: str) -> tuple[dict, torch.Tensor, torch.Tensor, list]:
    """(peft state without adapter name, output with the LoRA, base output, targets)."""
    pipe = build_pipeline(family)
    base = _output(pipe, component)
    model = getattr(pipe, component)
    t5 = type(model).__name__.startswith("T5")
    targets = list(T5_LORA_TARGETS if t5 else CLIP_LORA_TARGETS)
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets), model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
    state = get_peft_model_state_dict(model)
    return state, _output(pipe, component), base, targets


def exported(family: str, component: str, folder) -> dict:
    """lora_files written under `folder` as the export writes them; {label: path}."""
    state, _, _, targets = trained(family, component)
    request = ExportRequest(lora=True, rank=RANK, alpha=ALPHA, targets=targets, steps=3)
    files = lora_files(
        family, component, state, request, base_model="tiny", resolution=64, output_name="job"
    )
    written = {}
    for label, (name, data) in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written[label] = path
    return written


@pytest.mark.parametrize(("family", "component"), TEXT_CASES)
def test_each_text_encoder_lora_loads_where_its_files_say(family, component, tmp_path):
    """In the pipeline's loader: diffusers' file reproduces the output. Not in it (the T5 of
    flux and sd3): no diffusers file (it would load nothing), a PEFT adapter folder that
    reproduces the output, and kohya names in ComfyUI's T5 map."""
    _, expected, base, _ = trained(family, component)
    assert (expected - base).abs().max() > 1e-2  # the adapter does change the output
    files = exported(family, component, tmp_path)
    pipe = build_pipeline(family)
    if component in PIPELINE_LORA_MODULES[family]:
        assert files[component].name == DIFFUSERS_WEIGHT_NAME
        pipe.load_lora_weights(str(tmp_path))
        torch.testing.assert_close(_output(pipe, component), expected, atol=1e-5, rtol=0)
        return
    assert not (tmp_path / DIFFUSERS_WEIGHT_NAME).exists()
    assert files[component].parent == tmp_path / component
    setattr(
        pipe,
        component,
        PeftModel.from_pretrained(getattr(pipe, component), str(tmp_path / component)),
    )
    torch.testing.assert_close(_output(pipe, component), expected, atol=1e-5, rtol=0)
    # comfy/lora.py model_lora_keys_clip: T5 keys as 'lora_te{2|3}_' + module path, '.' -> '_'
    prefix = kohya_prefix(family, component)
    assert prefix == {"flux": "lora_te2", "sd3": "lora_te3"}[family]
    model = getattr(build_pipeline(family), component)
    comfy = {f"{prefix}_{n.replace('.', '_')}" for n, _ in model.named_modules() if n}
    with safe_open(str(files[f"{component}_kohya"]), "pt") as f:
        modules = {key.split(".")[0] for key in f.keys()}  # noqa: SIM118 - safe_open is no dict
    assert modules and modules <= comfy


def test_the_pipeline_loader_would_drop_a_t5_lora_silently(tmp_path):
    """Why the T5 gets a PEFT folder: diffusers' own file of it loads nothing into FLUX."""
    from splitstage.pipelines.diffusers.lora_export import write_diffusers

    state, expected, base, targets = trained("flux", "text_encoder_2")
    write_diffusers(tmp_path, state, "text_encoder_2", RANK, ALPHA, targets)
    pipe = build_pipeline("flux")
    pipe.load_lora_weights(str(tmp_path))
    assert torch.equal(_output(pipe, "text_encoder_2"), base)
