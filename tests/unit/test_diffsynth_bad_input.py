"""Bad input to the diffsynth family is one line, before anything launches (main environment:
diffsynth is not installed here, so the install hint is what a job gets)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitstage.config.job import config_from_dict
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import make_plan


def group(tmp_path: Path, **overrides):
    """A diffsynth [pipeline] group over an empty model file and tokenizer folder."""
    (tmp_path / "dit.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer").mkdir(exist_ok=True)
    return {
        "name": "diffsynth",
        "pipeline_class": "ZImagePipeline",
        "model_paths": [str(tmp_path / "dit.safetensors")],
        "tokenizer_path": str(tmp_path / "tokenizer"),
    } | overrides


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"pipeline_class": "NoSuchPipeline"}, "ZImagePipeline, WanVideoPipeline"),
        ({"model_paths": ["/nowhere/dit.safetensors"]}, "model_paths[0]: file /nowhere"),
        ({"tokenizer_path": "/nowhere/tok"}, "tokenizer_path: folder /nowhere/tok"),
    ],
)
def test_config_errors_name_the_field(tmp_path, overrides, expected):
    with pytest.raises(UserError) as error:
        config_from_dict({"pipeline": group(tmp_path, **overrides)})
    assert expected in str(error.value) and "\n" not in str(error.value).strip()


def test_without_diffsynth_the_plan_says_how_to_install(tmp_path):
    config = config_from_dict(
        {"pipeline": group(tmp_path), "trainable": {"lora_base_model": "dit"}}
    )
    with pytest.raises(UserError) as error:
        make_plan(config)
    line = str(error.value)
    assert "pip install 'splitstage[diffsynth]'" in line and "torchvision" in line


def test_the_cli_exits_2_with_one_line(tmp_path):
    path = tmp_path / "job.toml"
    tok = tmp_path / "tokenizer"
    path.write_text(
        '[pipeline]\nname = "diffsynth"\npipeline_class = "FooPipeline"\n'
        f'model_paths = ["{tmp_path}/dit.safetensors"]\ntokenizer_path = "{tok}"\n'
    )
    group(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", "validate", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "FooPipeline" in done.stderr and len(done.stderr.strip().splitlines()) == 1
