"""A full fine-tune's denoiser also exported as an original-layout single file (LDM SD / SDXL
UNet, original SD3, BFL FLUX): it reads back exactly through splitstage's single-file import and
diffusers' `from_single_file` (where its converter takes tiny widths), and equals the published
layouts' independent hand-written tables; a model the converter cannot read is warned about.

Run: .venv/bin/python -m pytest -q tests/unit/test_original_layout_export.py
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from splitstage.pipelines.diffusers.component_export import component_folder_files
from splitstage.pipelines.diffusers.components import load_frozen
from splitstage.pipelines.diffusers.folder import PipelineFolder
from splitstage.pipelines.diffusers.original_layout_export import original_layout_files
from tests.helpers.original_layouts import flux_to_bfl, sd3_to_original, unet_to_ldm
from tests.helpers.tiny_diffusers import write_tiny_folder

DENOISER = {"sd": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}
PUBLISHED = {  # independent tables of the published layouts (tests/helpers/original_layouts.py)
    "sd": lambda state: unet_to_ldm(state, layers_per_block=1),
    "sdxl": lambda state: unet_to_ldm(state, layers_per_block=1),
    "sd3": sd3_to_original,
    "flux": flux_to_bfl,
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One tiny Hub-style folder per family."""
    root = tmp_path_factory.mktemp("original-export")
    for family in DENOISER:
        write_tiny_folder(family, root / family)
    return root


def exported(root: Path, family: str, tmp_path: Path):
    """(component, trained state, path of the exported original file) for `family`."""
    component = PipelineFolder(str(root / family), {}, ()).component(DENOISER[family])
    base = load_frozen(component, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(1)  # "trained": every tensor moved off the base
    state = {
        key: tensor + torch.randn(tensor.shape, generator=generator)
        for key, tensor in base.state_dict().items()
    }
    files = component_folder_files(component, state)
    label = f"{component.name}_original"
    file_name, data = files[label]
    assert file_name == f"{component.name}_original.safetensors"
    assert f"{component.name}/config.json" in {name for name, _ in files.values()}
    path = tmp_path / file_name
    path.write_bytes(data)
    return component, state, path


@pytest.mark.parametrize("family", list(DENOISER))
def test_the_original_file_reads_back_through_the_single_file_import(root, family, tmp_path):
    component, state, path = exported(root, family, tmp_path)
    written = load(path.read_bytes())
    prefixed = family != "flux"  # LDM / SD3 checkpoints prefix the denoiser; BFL's file does not
    assert all(key.startswith("model.diffusion_model.") == prefixed for key in written)
    published = PUBLISHED[family](state)
    assert written.keys() == published.keys()
    assert all(torch.equal(tensor, published[key]) for key, tensor in written.items())
    single = dataclasses.replace(component, weights=path, field="models.x.weights")
    loaded = load_frozen(single, torch.device("cpu"), torch.float32).state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in state.items())


# diffusers' FLUX converter hard-codes width 3072 (torch.split by 3072 rows): it cannot read a
# tiny BFL file, which splitstage's import (the converter on a row-scaled proxy) reads above.
@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3"])
def test_the_original_file_loads_with_diffusers_from_single_file(root, family, tmp_path):
    import diffusers

    component, state, path = exported(root, family, tmp_path)
    cls = getattr(diffusers, component.class_name)
    model = cls.from_single_file(
        str(path), config=str(root / family), subfolder=component.name, local_files_only=True
    )
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in state.items())


def test_a_width_the_flux_converter_cannot_read_is_warned_in_one_line(caplog):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(  # width 2 x 20 = 40 does not divide 3072
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=20,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(4, 8, 8),
    )
    with caplog.at_level(logging.WARNING):
        assert original_layout_files("transformer", model) == {}
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "transformer: no BFL FLUX single file written: diffusers' FLUX converter assumes width "
        "3072, which 40 does not divide"
    ]
    assert original_layout_files("text_encoder", torch.nn.Linear(2, 2)) == {}  # no layout
