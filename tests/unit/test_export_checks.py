"""What can be exported is known before launch: `splitstage validate` refuses, in one line, a
key prefix to remove that the export would not remove (a typo, or a diffusers layout whose loaders
need its keys) and a LoRA of a component the family's LoRA files cannot hold. Export metadata and
the resume-identity check, as functions."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from splitstage.tasks.stage2.export import with_metadata
from splitstage.tasks.stage2.resume import ResumeConfigError, check_resume_identity
from tests.helpers.catalogue import assets, check_one_line, cli, job  # noqa: F401


def test_a_prefix_no_exported_key_starts_with_is_refused(assets, tmp_path, capsys):  # noqa: F811
    typo = job(
        assets, tmp_path, output=f'url = "{tmp_path}/out"\nremove_prefix_in_ckpt = "pipe.dti."'
    )
    code, err = cli(["validate", typo], capsys)
    check_one_line(
        code, err, "output.remove_prefix_in_ckpt = 'pipe.dti.'", "remove nothing", "'pipe.dit.'"
    )
    right = job(
        assets, tmp_path, output=f'url = "{tmp_path}/out"\nremove_prefix_in_ckpt = "pipe.dit."'
    )
    code, err = cli(["validate", right], capsys)
    assert code == 0, err


@pytest.fixture(scope="module")
def sd(tmp_path_factory) -> Path:
    """A tiny sd folder and 4 digits."""
    from splitstage.data.digits import write_digits_dataset
    from tests.helpers.tiny_diffusers import write_tiny_folder

    root = tmp_path_factory.mktemp("sd-export")
    write_tiny_folder("sd", root / "sd")
    write_digits_dataset(root / "data", limit=4, size=32)
    return root


def sd_job(root: Path, tmp_path: Path, trainable: str, output: str = "") -> str:
    """A tiny sd LoRA job as TOML."""
    body = {
        "pipeline": f'name = "sd"\npretrained = "{root / "sd"}"\nresolution = 64',
        "trainable": trainable,
        "data": f'base_path = "{root / "data"}"',
        "cache": f'url = "{root / "cache"}"',
        "train": "batch_size = 2",
        "output": f'url = "{tmp_path / "out"}"\n{output}',
    }
    path = tmp_path / f"sd-{time.monotonic_ns()}.toml"
    path.write_text("".join(f"[{name}]\n{lines}\n" for name, lines in body.items()))
    return str(path)


def test_diffusers_exports_refuse_a_prefix_to_remove(sd, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    path = sd_job(sd, tmp_path, 'lora_base_model = "unet"', 'remove_prefix_in_ckpt = "unet."')
    code, err = cli(["validate", path], capsys)
    check_one_line(
        code,
        err,
        "output.remove_prefix_in_ckpt = 'unet.'",
        "pytorch_lora_weights.safetensors",
        "remove output.remove_prefix_in_ckpt",
    )
    full = sd_job(sd, tmp_path, 'full = ["unet"]', 'remove_prefix_in_ckpt = "pipe."')
    code, err = cli(["validate", full], capsys)
    check_one_line(code, err, "output.remove_prefix_in_ckpt = 'pipe.'", "save_pretrained folder")


def test_a_lora_of_a_component_the_family_cannot_export_is_refused(sd, tmp_path, capsys):
    torch.set_num_threads(1)
    path = sd_job(sd, tmp_path, 'lora_base_model = "vae"')
    code, err = cli(["validate", path], capsys)
    check_one_line(
        code, err, "trainable.lora_base_model = 'vae'", "a LoRA only of unet, text_encoder"
    )
    code, err = cli(["validate", sd_job(sd, tmp_path, 'lora_base_model = "text_encoder"')], capsys)
    assert code == 0, err


def test_metadata_is_added_and_the_tensors_kept(tmp_path):
    tensors = {"a.lora_A.weight": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int16)}
    data = with_metadata(save(tensors, {"format": "pt"}), {"splitstage_family": "sd"})
    assert int.from_bytes(data[:8], "little") % 8 == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"format": "pt", "splitstage_family": "sd"}
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor)


def identity(family: str = "sd", **fingerprints: str) -> dict:
    models = {
        name: {"fingerprint": fp, "source": f"/w/{name}.safetensors"}
        for name, fp in (fingerprints or {"unet": "aa" * 32}).items()
    }
    return {"family": family, "pipeline": family, "task": "sft", "models": models}


def test_resume_identity_refuses_another_family_or_base_or_none_recorded():
    where = {"step": 2, "checkpoint_url": "/ckpt"}
    assert check_resume_identity({"base": identity()}, identity(), **where) == []
    untasked = {k: v for k, v in identity().items() if k != "task"}  # an older splitstage's
    (line,) = check_resume_identity({"base": untasked}, identity(), **where)
    assert "records no train.task" in line and "resumed as train.task = 'sft'" in line
    with pytest.raises(ResumeConfigError) as error:
        check_resume_identity({"base": identity()}, identity("sdxl"), **where)
    assert "'sd' family" in str(error.value) and "names 'sdxl'" in str(error.value)
    assert "another --run-id (or delete /ckpt)" in str(error.value)
    with pytest.raises(ResumeConfigError) as error:
        check_resume_identity({"base": identity()}, identity(unet="bb" * 32), **where)
    message = str(error.value)
    assert "unet: trained on /w/unet.safetensors (sha256 aaaaaaaaaaaa)" in message
    assert "now /w/unet.safetensors (sha256 bbbbbbbbbbbb)" in message and "\n" not in message
    for foreign in (None, {"seed": 0}):  # no settings, or no identity: not splitstage's
        with pytest.raises(
            ResumeConfigError, match=r"step 2 under /ckpt records no family or base"
        ):
            check_resume_identity(foreign, identity(), **where)
