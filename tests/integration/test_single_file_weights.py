"""Original-layout single files (BFL FLUX and original SD3 as `[models.transformer] weights`,
LDM SD 1.x / SDXL as `[models.unet] weights`): read through diffusers' converters as key maps
with slice rules, equal to the diffusers-layout folder's load under 1 rank and under FSDP2 on 2
ranks (real torchrun, gloo); validation reads headers only.

Run: .venv/bin/python -m pytest -q tests/integration/test_single_file_weights.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitstage.cli import main
from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.tasks.job_plan import make_plan
from tests.helpers.original_layouts import flux_to_bfl, sd3_to_original, unet_to_ldm
from tests.helpers.tiny_diffusers import write_tiny_folder
from tests.helpers.toml_job import toml
from tests.helpers.weight_loads import weight_loads

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
WORKER = Path(__file__).parent / "workers" / "single_file_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Tiny FLUX, SD, SDXL and SD3 folders, their denoisers written in the original layouts
    (BFL's flux1-dev.safetensors; full checkpoints, the VAE's tensors beside the denoiser)."""
    root = tmp_path_factory.mktemp("single-file")
    for family in ("flux", "sd", "sdxl", "sd3"):
        write_tiny_folder(family, root / family)
    write_digits_dataset(root / "data", limit=4, size=32)
    state = load_file(root / "flux" / "transformer" / "diffusion_pytorch_model.safetensors")
    (root / "bfl").mkdir()
    save_file(flux_to_bfl(state), root / "bfl" / "flux1-dev.safetensors")
    (root / "original").mkdir()
    for family in ("sd", "sdxl", "sd3"):
        denoiser = "transformer" if family == "sd3" else "unet"
        state = load_file(root / family / denoiser / "diffusion_pytorch_model.safetensors")
        vae = load_file(root / family / "vae" / "diffusion_pytorch_model.safetensors")
        full = sd3_to_original(state) if family == "sd3" else unet_to_ldm(state, 1)
        full |= {f"first_stage_model.{key}": tensor for key, tensor in vae.items()}
        save_file(full, root / "original" / f"{family}.safetensors")
    return root


def document(root: Path, name: str, weights: Path | None, family: str = "flux", **train) -> dict:
    """A full fine-tuning job of `family`; `weights` overrides the folder's denoiser."""
    denoiser = "unet" if family in ("sd", "sdxl") else "transformer"
    models = {denoiser: {"weights": str(weights)}} if weights else {}
    return {
        "job": {"name": name},
        "pipeline": {"name": family, "pretrained": str(root / family), "resolution": 64},
        "models": models,
        "trainable": {"full": [denoiser]},
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache")},
        "train": {"batch_size": 2, "max_steps": 1} | train,
        "output": {"url": str(root / "out")},
    }


def loaded_state(root: Path, out: Path, nproc: int, weights: Path | None, **train) -> dict:
    """The trained denoiser as stage 2 builds it under `nproc` torchrun ranks, gathered."""
    out.mkdir(parents=True)
    config = config_from_dict(document(root, out.name, weights, **train))
    (out / "config.json").write_text(config.model_dump_json())
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command += ["--standalone", str(WORKER), str(out / "config.json"), str(out)]
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "Error" in line]
    assert done.returncode == 0, "\n".join(errors[:5]) or done.stderr[-3000:]
    return load_file(out / "state-rank0.safetensors")


@pytest.fixture(scope="module")
def folder_load(root, tmp_path_factory) -> dict:
    """The reference: the diffusers-layout folder's transformer, loaded by stage 2 on 1 rank."""
    return loaded_state(root, tmp_path_factory.mktemp("ref") / "folder", 1, None)


@pytest.fixture(scope="module")
def folder_loads(root, tmp_path_factory) -> dict:
    """Per family, the reference: the folder's denoiser loaded by stage 2 on 1 rank (lazily)."""
    base, loads = tmp_path_factory.mktemp("family-ref"), {}

    def load(family: str) -> dict:
        if family not in loads:
            loads[family] = loaded_state(root, base / family, 1, None, family=family)
        return loads[family]

    return load


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_bfl_flux_file_loads_as_the_diffusers_folder(root, tmp_path, folder_load, nproc):
    train = {"parallelism": "fsdp", "nproc_per_node": 2} if nproc == 2 else {}
    bfl = root / "bfl" / "flux1-dev.safetensors"
    state = loaded_state(root, tmp_path / f"bfl-{nproc}", nproc, bfl, **train)
    original = load_file(root / "flux" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert set(state) == set(folder_load) == set(original)
    for key, tensor in folder_load.items():
        assert torch.equal(state[key], tensor), key
        assert torch.equal(tensor, original[key]), key


@pytest.mark.parametrize(
    ("family", "nproc"), [("sd", 1), ("sdxl", 1), ("sd", 2), ("sd3", 1), ("sd3", 2)]
)
def test_an_ldm_or_sd3_checkpoint_loads_as_the_diffusers_folder(
    root, tmp_path, folder_loads, family, nproc
):
    train = {"parallelism": "fsdp", "nproc_per_node": 2} if nproc == 2 else {}
    file = root / "original" / f"{family}.safetensors"
    state = loaded_state(root, tmp_path / f"orig-{nproc}", nproc, file, family=family, **train)
    folder_load = folder_loads(family)
    denoiser = "transformer" if family == "sd3" else "unet"
    original = load_file(root / family / denoiser / "diffusion_pytorch_model.safetensors")
    assert set(state) == set(folder_load) == set(original)
    for key, tensor in folder_load.items():
        assert torch.equal(state[key], tensor), key
        assert torch.equal(tensor, original[key]), key


@pytest.mark.parametrize(("family", "file"), [("flux", "bfl/flux1-dev"), ("sdxl", "original/sdxl")])
def test_validate_reads_only_the_header_of_an_original_layout_file(
    root, tmp_path, capsys, family, file
):
    weights = root / f"{file}.safetensors"
    path = tmp_path / "job.toml"
    path.write_text(toml(document(root, "validate", weights, family=family)))
    with weight_loads() as seen:
        code = main(["validate", str(path)])
    assert code == 0, capsys.readouterr().err
    assert seen == []


def test_the_cache_key_fingerprints_the_file_as_it_is(root, tmp_path):
    bfl = root / "bfl" / "flux1-dev.safetensors"
    config = config_from_dict(document(root, "fp", bfl))
    plan = make_plan(config)
    other = tmp_path / "flux1-dev.safetensors"
    state = load_file(bfl)
    state["final_layer.linear.bias"] = state["final_layer.linear.bias"] + 1
    save_file(state, other)
    changed = make_plan(config_from_dict(document(root, "fp", other)))
    assert plan.model_fingerprint("transformer") != changed.model_fingerprint("transformer")
