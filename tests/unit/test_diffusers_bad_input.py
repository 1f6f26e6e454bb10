"""Catalogue: bad input to the diffusers families (sd, sdxl, sd3, flux) is refused before launch.

Every case is ONE line that names the field, file or component and what to change, raised as a
splitstage UserError (never a raw KeyError / OSError / traceback) by what `splitstage validate`
runs: the config, `make_plan` and the preflight, with no process started. The cases stand for
classes: a pretrained folder that is not one (or of another family), a component that is missing,
unreadable or pickled, a class no library has, a tokenizer or scheduler that is not there, settings
the model cannot take, `[models.<component>]` overrides that do not fit, and trainable settings
naming what the family lacks. A few run the real CLI in a subprocess: exit 2, one stderr line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.preflight import preflight
from tests.helpers.tiny_diffusers import write_tiny_folder

UNET = "diffusion_pytorch_model.safetensors"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """One torch thread; HF_HUB_OFFLINE=1 and any socket connect fails the test."""
    import huggingface_hub.constants

    def no_network(*args, **kwargs):
        raise AssertionError("tried to use the network")

    torch.set_num_threads(1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket.socket, "connect", no_network)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tiny sd and flux folders, a data set, override files: written once for the module."""
    root = tmp_path_factory.mktemp("diffusers-bad")
    for kind in ("sd", "flux"):
        write_tiny_folder(kind, root / kind)
    write_digits_dataset(root / "data", limit=8, size=32)
    files = root / "files"
    files.mkdir()
    state = load_file(root / "sd" / "unet" / UNET)
    save_file(state, files / "unet.safetensors")
    save_file(
        {f"model.diffusion_model.{k}": v for k, v in state.items()}, files / "ldm.safetensors"
    )
    reshaped = next(k for k, v in state.items() if v.ndim == 2)
    save_file({**state, reshaped: torch.zeros(3, 3)}, files / "reshaped.safetensors")
    vae = load_file(root / "sd" / "vae" / UNET)
    save_file({f"first_stage_model.{k}": v for k, v in vae.items()}, files / "vae-ldm.safetensors")
    (files / "garbage.safetensors").write_bytes(b"this is not a safetensors file")
    (files / "unet.ckpt").write_bytes(b"PK\x03\x04 pickle")
    (files / "unet.bin").write_bytes(b"PK\x03\x04 pickle")
    (files / "empty").mkdir()
    shutil.copytree(root / "sd" / "unet", files / "wide-unet")
    rewrite_json(files / "wide-unet" / "config.json", cross_attention_dim=64)
    (files / "config-only").mkdir()
    shutil.copy(root / "sd" / "unet" / "config.json", files / "config-only")
    # A sharded unet (two shards and their index, as save_pretrained writes), then one shard lost.
    sharded = files / "sharded"
    sharded.mkdir()
    keys = sorted(state)
    weight_map = {}
    for number, part in enumerate((keys[::2], keys[1::2]), start=1):
        name = f"diffusion_pytorch_model-0000{number}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, sharded / name)
        weight_map.update(dict.fromkeys(part, name))
    index = sharded / f"{UNET}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(root / "sd" / "unet" / "config.json", sharded)
    broken = files / "sharded-broken"
    shutil.copytree(sharded, broken)
    (broken / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    return root


def job(root: Path, pretrained: str | Path | None = None, family: str = "sd", **groups) -> dict:
    """A tiny valid job as a dict; `pipeline`, `trainable`, `models` groups are merged in."""
    denoiser = "unet" if family in ("sd", "sdxl") else "transformer"
    return {
        "job": {"name": "bad-input"},
        "pipeline": {
            "name": family,
            "pretrained": str(pretrained or root / family),
            "resolution": 64,
            **groups.get("pipeline", {}),
        },
        "models": groups.get("models", {}),
        "trainable": groups.get("trainable", {"lora_base_model": denoiser}),
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache")},
        "train": {"batch_size": 2, "max_steps": 1},
        "output": {"url": str(root / "out")},
    }


def validate(config: dict) -> list[str]:
    """What `splitstage validate` runs (config, plan, preflight), refusing to start processes."""

    def no_launch(*args, **kwargs):
        raise AssertionError("a process was launched before the input was checked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", no_launch)
        mp.setattr(multiprocessing.Process, "start", no_launch)
        parsed = config_from_dict(config)
        return preflight(make_plan(parsed)).warnings


def refused(config: dict, *needles: str) -> str:
    """The one-line UserError `validate` raises, holding every needle."""
    with pytest.raises(UserError) as info:
        validate(config)
    message = str(info.value)
    assert "\n" not in message.strip(), message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def edited(root: Path, tmp_path: Path, edit: Callable[[Path], object], kind: str = "sd") -> Path:
    """A copy of the tiny `kind` folder with `edit` applied."""
    folder = tmp_path / f"{kind}-edited"
    shutil.copytree(root / kind, folder)
    edit(folder)
    return folder


def rewrite_json(path: Path, **changes) -> None:
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


# name -> (edit of the sd folder, needles)
FOLDER_CASES = {
    "no model_index.json": (
        lambda f: remove(f / "model_index.json"),
        ["pipeline.pretrained", "has no model_index.json", "diffusers pipeline folder"],
    ),
    "model_index.json not JSON": (
        lambda f: (f / "model_index.json").write_text("{not json"),
        ["pipeline.pretrained", "model_index.json", "not a readable JSON"],
    ),
    "model_index.json without _class_name": (
        lambda f: (f / "model_index.json").write_text(json.dumps({"unet": ["diffusers", "X"]})),
        ["pipeline.pretrained", "names no pipeline class (_class_name)"],
    ),
    "a denoiser class no library has": (
        lambda f: rewrite_json(f / "model_index.json", unet=["diffusers", "NoSuchUNet"]),
        ["pipeline.pretrained", "model_index.json", "'unet'", "diffusers.NoSuchUNet"],
    ),
    "a frozen component's class no library has": (
        lambda f: rewrite_json(f / "model_index.json", vae=["diffusers", "NoSuchVAE"]),
        ["pipeline.pretrained", "'vae'", "diffusers.NoSuchVAE", "fix model_index.json"],
    ),
    "a library that builds nothing": (
        lambda f: rewrite_json(f / "model_index.json", text_encoder=["open_clip", "CLIP"]),
        ["'text_encoder'", "'open_clip'", "diffusers and transformers"],
    ),
    "a component model_index.json leaves out": (
        lambda f: rewrite_json(f / "model_index.json", vae=[None, None]),
        ["models.vae", "has no 'vae' component", "[models.vae] weights"],
    ),
    "vae/ deleted": (
        lambda f: remove(f / "vae"),
        ["pipeline.pretrained (vae/)", "does not exist", "[models.vae] weights"],
    ),
    "unet/ deleted": (
        lambda f: remove(f / "unet"),
        ["pipeline.pretrained (unet/)", "does not exist"],
    ),
    "unet weights only as .bin": (
        lambda f: (f / "unet" / UNET).rename(f / "unet" / "diffusion_pytorch_model.bin"),
        ["pipeline.pretrained (unet/)", "no safetensors weights", "convert them to safetensors"],
    ),
    "text encoder weights only as .bin": (
        lambda f: (f / "text_encoder" / "model.safetensors").rename(
            f / "text_encoder" / "pytorch_model.bin"
        ),
        ["pipeline.pretrained (text_encoder/)", "no safetensors weights", "pickle"],
    ),
    "unet config.json missing": (
        lambda f: remove(f / "unet" / "config.json"),
        ["pipeline.pretrained (unet/)", "has no config.json"],
    ),
    "unet config.json not JSON": (
        lambda f: (f / "unet" / "config.json").write_text("{oops"),
        ["pipeline.pretrained (unet/)", "unet/config.json", "not a readable JSON"],
    ),
    "vae config.json not JSON": (
        lambda f: (f / "vae" / "config.json").write_text("[1, 2"),
        ["pipeline.pretrained (vae/)", "vae/config.json", "not a readable JSON"],
    ),
    "text encoder config.json a list": (
        lambda f: (f / "text_encoder" / "config.json").write_text("[]"),
        ["pipeline.pretrained (text_encoder/)", "not a JSON object"],
    ),
    "unet config.json that builds nothing": (
        lambda f: rewrite_json(f / "unet" / "config.json", in_channels=-1),
        ["pipeline.pretrained (unet/)", "cannot build UNet2DConditionModel", "fix that config"],
    ),
    "tokenizer/ deleted": (
        lambda f: remove(f / "tokenizer"),
        ["pipeline.pretrained", "no tokenizer/ for text_encoder"],
    ),
    "tokenizer unreadable": (
        lambda f: (f / "tokenizer" / "tokenizer.json").write_text("{oops"),
        ["pipeline.pretrained", "tokenizer is not a readable tokenizer for text_encoder"],
    ),
    "scheduler/ deleted": (
        lambda f: remove(f / "scheduler"),
        ["pipeline.pretrained (scheduler/)", "scheduler_config.json", "no such"],
    ),
    "scheduler config not JSON": (
        lambda f: (f / "scheduler" / "scheduler_config.json").write_text("{"),
        ["pipeline.pretrained (scheduler/)", "not a readable JSON"],
    ),
    "scheduler predicting the sample": (
        lambda f: rewrite_json(f / "scheduler" / "scheduler_config.json", prediction_type="sample"),
        ["prediction_type", "'sample'", "pipeline.prediction_type = 'epsilon' or 'v_prediction'"],
    ),
    "a VAE config without scaling_factor": (
        lambda f: rewrite_json(f / "vae" / "config.json", scaling_factor=None),
        ["vae/config.json has no scaling_factor", "silently mis-scaled"],
    ),
    "a text encoder shard lost": (
        lambda f: shard_text_encoder(f, lose=True),
        ["pipeline.pretrained (text_encoder/)", "lists shard", "download every shard"],
    ),
}


def shard_text_encoder(folder: Path, *, lose: bool) -> None:
    """Split text_encoder/model.safetensors into two shards and an index (one lost if `lose`)."""
    encoder = folder / "text_encoder"
    state = load_file(encoder / "model.safetensors")
    (encoder / "model.safetensors").unlink()
    keys, weight_map = sorted(state), {}
    for number, part in enumerate((keys[::2], keys[1::2]), start=1):
        name = f"model-0000{number}-of-00002.safetensors"
        if not (lose and number == 2):
            save_file({k: state[k] for k in part}, encoder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (encoder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case", sorted(FOLDER_CASES))
def test_a_broken_pretrained_folder(case, assets, tmp_path):
    edit, needles = FOLDER_CASES[case]
    refused(job(assets, edited(assets, tmp_path, edit)), *needles)


def test_the_valid_jobs_pass(assets, tmp_path):
    """The baseline every case breaks: folders, overrides and a sharded index all validate."""
    files = assets / "files"
    for config in (
        job(assets),
        job(assets, family="flux"),
        job(assets, edited(assets, tmp_path, lambda f: shard_text_encoder(f, lose=False))),
        job(assets, models={"unet": {"weights": str(files / "unet.safetensors")}}),
        job(assets, models={"unet": {"weights": str(files / "sharded" / f"{UNET}.index.json")}}),
        job(assets, models={"unet": {"weights": str(files / "sharded")}}),
    ):
        warnings = validate(config)
        assert all("holds no samples" in w for w in warnings), warnings  # stage 1 has not run


def test_pretrained_that_is_no_folder(assets):
    refused(job(assets, assets / "nowhere"), "pipeline.pretrained", "does not exist")
    refused(
        job(assets, assets / "sd" / "model_index.json"),
        "pipeline.pretrained",
        "is a file",
        "[models.<component>] weights",
    )


def test_a_hub_id_not_in_the_cache_is_not_downloaded(assets, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    refused(
        job(assets, "org/model"),
        "pipeline.pretrained: 'org/model'",
        f"not in the Hugging Face cache ({cache})",
        "hf download org/model --local-dir DIR",
    )
    assert not any(cache.iterdir())  # nothing was fetched into it


@pytest.mark.parametrize(
    ("folder", "family", "right"), [("sd", "flux", "sd"), ("flux", "sd", "flux")]
)
def test_a_folder_of_another_family_names_its_family(assets, folder, family, right):
    refused(
        job(assets, assets / folder, family),
        "pipeline.pretrained",
        f"[pipeline] name = '{right}'",
    )


SETTING_CASES = {  # name -> (family, [pipeline] settings, needles)
    "sd resolution not a multiple of 8": ("sd", {"resolution": 100}, ["resolution", "of 8"]),
    "flux resolution not a multiple of 16": ("flux", {"resolution": 72}, ["of 16", "use 64"]),
    "caption dropout above 1": ("sd", {"caption_dropout": 1.5}, ["pipeline.caption_dropout"]),
    "caption dropout below 0": ("flux", {"caption_dropout": -0.1}, ["pipeline.caption_dropout"]),
    "unknown weighting scheme": (
        "flux",
        {"weighting_scheme": "karras"},
        ["pipeline.weighting_scheme", "logit_normal"],
    ),
    "weighting scheme for a UNet": ("sd", {"weighting_scheme": "none"}, ["unknown field"]),
    "prediction type sample": ("sd", {"prediction_type": "sample"}, ["pipeline.prediction_type"]),
    "prompt longer than CLIP's 77": ("sd", {"max_prompt_length": 100}, ["max_prompt_length", "77"]),
    "prompt longer than T5's 512": ("flux", {"max_prompt_length": 600}, ["512"]),
}


@pytest.mark.parametrize("case", sorted(SETTING_CASES))
def test_a_setting_the_model_cannot_take(case, assets):
    family, settings, needles = SETTING_CASES[case]
    refused(job(assets, family=family, pipeline=settings), *needles)


def unet_from(path: str) -> dict:
    return {"unet": {"weights": path}}


OVERRIDE_CASES = {  # name -> ([models] groups from the override files folder, needles)
    "a missing file": (
        lambda f: unet_from(f"{f}/nowhere.safetensors"),
        ["models.unet.weights", "does not exist"],
    ),
    "a pickled .ckpt": (
        lambda f: unet_from(f"{f}/unet.ckpt"),
        ["models.unet.weights", "unet.ckpt", "convert it to safetensors"],
    ),
    "a pickled .bin": (
        lambda f: unet_from(f"{f}/unet.bin"),
        ["models.unet.weights", "unet.bin", "convert it to safetensors"],
    ),
    "an empty folder": (
        lambda f: unet_from(f"{f}/empty"),
        ["models.unet.weights", "has no config.json"],
    ),
    "a folder without weights": (
        lambda f: unet_from(f"{f}/config-only"),
        ["models.unet.weights", "no safetensors weights"],
    ),
    "original-layout keys": (
        lambda f: unet_from(f"{f}/ldm.safetensors"),
        ["models.unet.weights", "does not fit UNet2DConditionModel", "diffusers-layout state dict"],
    ),
    "wrong shapes": (
        lambda f: unet_from(f"{f}/reshaped.safetensors"),
        ["models.unet.weights", "wrong shape", "(3, 3) vs (32, 32)", "diffusers-layout"],
    ),
    "not safetensors inside": (
        lambda f: unet_from(f"{f}/garbage.safetensors"),
        ["models.unet.weights", "not a readable safetensors file"],
    ),
    "a frozen vae in the original layout": (
        lambda f: {
            **unet_from(f"{f}/unet.safetensors"),
            "vae": {"weights": f"{f}/vae-ldm.safetensors"},
        },
        ["models.vae.weights", "does not fit AutoencoderKL", "diffusers-layout"],
    ),
    "an index with a shard lost": (
        lambda f: unet_from(f"{f}/sharded-broken/{UNET}.index.json"),
        ["models.unet.weights", "lists shard", "download every shard"],
    ),
    "a folder with a shard lost": (
        lambda f: unet_from(f"{f}/sharded-broken"),
        ["models.unet.weights", "00002-of-00002", "download every shard"],
    ),
    "a vae of another model (its latent channels)": (
        lambda f: {**unet_from(f"{f}/unet.safetensors"), "vae": {"weights": f"{f}/../flux/vae"}},
        ["models.vae.weights", "flux/vae/config.json has latent_channels=16", "has 4"],
    ),
    "a unet of another model (its text width)": (
        lambda f: unet_from(f"{f}/wide-unet"),
        ["models.unet.weights", "cross_attention_dim=64", "give a unet of this model"],
    ),
    "a builder": (lambda f: {"unet": {"builder": "x"}}, ["models.unet.builder", "weights ="]),
    "a key prefix": (
        lambda f: {"unet": {"weights": f"{f}/unet.safetensors", "key_prefix": "model."}},
        ["models.unet.key_prefix", "remove key_prefix"],
    ),
    "a component the family lacks": (
        lambda f: {**unet_from(f"{f}/unet.safetensors"), "transformer": {"builder": "x"}},
        ["models.transformer", "no model 'transformer'", "text_encoder, vae, unet"],
    ),
}


@pytest.mark.parametrize("case", sorted(OVERRIDE_CASES))
def test_an_override_that_does_not_fit(case, assets):
    models, needles = OVERRIDE_CASES[case]
    refused(job(assets, models=models(assets / "files")), *needles)


def test_override_problems_are_found_by_the_plan_itself(assets):
    """make_plan (which every command runs first) refuses a misfit override of the trained model,
    not only the preflight: the file is checked when the component is resolved."""
    config = config_from_dict(job(assets, models=unet_from(f"{assets}/files/ldm.safetensors")))
    with pytest.raises(UserError, match="diffusers-layout state dict"):
        make_plan(config)


def test_overriding_only_a_frozen_component_is_accepted(assets):
    """The folder supplies the trained unet: a [models.vae] override alone needs no unet entry."""
    validate(job(assets, models={"vae": {"weights": str(assets / "sd" / "vae")}}))
    refused(
        job(assets, models={"vae": {"weights": f"{assets}/files/vae-ldm.safetensors"}}),
        "models.vae.weights",
        "does not fit AutoencoderKL",
    )


TRAINABLE_CASES = {  # name -> ([trainable], needles)
    "LoRA on a model the family lacks": (
        {"lora_base_model": "transformer"},
        ["trainable:", "'transformer'", "text_encoder, unet, vae"],
    ),
    "full training of a model the family lacks": (
        {"full": ["transformer"]},
        ["'transformer'", "text_encoder, unet, vae"],
    ),
    "LoRA targets naming nothing": (
        {"lora_base_model": "unet", "lora_target_modules": ["to_qq"]},
        ["trainable.lora_target_modules", "to_qq", "adaptable modules include", "to_q"],
    ),
    "LoRA rank above a layer's width": (
        {"lora_base_model": "unet", "lora_rank": 100},
        ["trainable.lora_rank=100", "set lora_rank <= 32"],
    ),
}


@pytest.mark.parametrize("case", sorted(TRAINABLE_CASES))
def test_trainable_settings_the_family_cannot_train(case, assets):
    trainable, needles = TRAINABLE_CASES[case]
    refused(job(assets, trainable=trainable), *needles)


# -- the real CLI (a subprocess each: the diffusers import costs seconds) ------------------------
CLI_CASES = {  # name -> (edit of the sd folder, needles); each once raised a traceback or passed
    "unet config.json not JSON": FOLDER_CASES["unet config.json not JSON"],
    "scheduler predicting the sample": FOLDER_CASES["scheduler predicting the sample"],
}


def toml(config: dict) -> str:
    """The job dict as TOML (strings, numbers and flat tables are all it holds)."""
    lines = []
    for group, body in config.items():
        if group == "models" and not body:
            continue
        lines.append(f"[{group}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in body.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def cli_runs(assets, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Each CLI case's (exit code, stderr) from `splitstage validate`, run side by side."""
    root = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_HOME"] = str(root / "hf")
    running = {}
    for number, (case, (edit, _)) in enumerate(sorted(CLI_CASES.items())):
        folder = edited(assets, root / str(number), edit)
        path = root / f"job-{number}.toml"
        path.write_text(toml(job(assets, folder)))
        command = [sys.executable, "-m", "splitstage.cli", "validate", str(path)]
        running[case] = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for case, process in running.items():
        _, err = process.communicate(timeout=120)
        results[case] = (process.returncode, err)
    return results


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_validate_on_the_command_line(case, cli_runs):
    code, err = cli_runs[case]
    assert code == 2, err
    lines = [line for line in err.split("\n") if line and "\r" not in line]
    assert len(lines) == 1 and lines[0].startswith("splitstage: error: "), err
    assert "Traceback" not in err
    for needle in CLI_CASES[case][1]:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_the_folder_names_the_family_each_pipeline_class_has():
    """folder.PIPELINE_FAMILIES (what a wrong-family message suggests) is the families' own."""
    from splitstage.pipelines.diffusers import (
        flux,
        flux2,
        flux_kontext,
        qwenimage,
        qwenimage_edit,
        sd,
        sd3,
        sdxl,
        wan,
        wan_i2v,
        zimage,
    )
    from splitstage.pipelines.diffusers.folder import PIPELINE_FAMILIES

    families = (sd.SDFamily, sdxl.SDXLFamily, sd3.SD3Family, flux.FluxFamily)
    families += (qwenimage.QwenImageFamily, wan.WanFamily, zimage.ZImageFamily, flux2.Flux2Family)
    families += (flux_kontext.FluxKontextFamily, qwenimage_edit.QwenImageEditFamily)
    families += (wan_i2v.WanI2VFamily,)
    expected = {cls: family.name for family in families for cls in family.pipeline_classes}
    assert expected == PIPELINE_FAMILIES
