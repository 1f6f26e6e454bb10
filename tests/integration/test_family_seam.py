"""The seam is real: a second family, defined only in the tests and found through its entry point,
runs plan -> preprocess -> split training -> export (and unsplit) with no edit outside it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from splitstage.config.families import family_names
from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess

pytestmark = pytest.mark.slow
PLUGIN = Path(__file__).parent / "plugin"
ENV = {"SPLITSTAGE_DEVICE": "cpu"}


@pytest.fixture(scope="module")
def plugin_path():
    """Put the tiny family's folder (module + .dist-info) on sys.path and PYTHONPATH."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(PLUGIN))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, plugin_path) -> Path:
    from splitstage_tiny_family.family import write_denoiser_weights

    root = tmp_path_factory.mktemp("seam")
    write_digits_dataset(root / "data", limit=24, size=16)
    write_denoiser_weights(root / "denoiser.safetensors", side=4, labels=32)
    return root


def tiny_config(root: Path, name: str, **train):
    return config_from_dict(
        {
            "job": {"name": name, "seed": 1},
            "pipeline": {"name": "tiny", "image_size": 16},
            "models": {"denoiser": {"weights": str(root / "denoiser.safetensors")}},
            "trainable": {"lora_base_model": "denoiser", "lora_rank": 2},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache"), "shard_samples": 8},
            "train": {"batch_size": 4, "max_steps": 3, "log_every": 1} | train,
            "output": {"url": str(root / "out")},
        }
    )


def test_the_entry_point_registers_the_family(plugin_path):
    assert "tiny" in family_names()
    with pytest.raises(ConfigError, match=r"pipeline.name: unknown pipeline family 'nope'.*tiny"):
        config_from_dict({"pipeline": {"name": "nope"}})
    with pytest.raises(ConfigError, match="pipeline.labels"):
        config_from_dict({"pipeline": {"name": "tiny", "labels": 1}})


def test_plan_preprocess_train_export_through_the_seam(workspace):
    config = tiny_config(workspace, "seam-split")
    plan = make_plan(config)
    assert plan.split.v1 == () and list(plan.split.v2) == ["Encode", "HashLabels"]
    assert set(plan.split.boundary_params) == {"latents_0", "label"}
    assert plan.split.models == {"stage1": ("encoder",), "stage2": ("denoiser",)}
    # The stage-1 settings are exactly those the family marked: noise_steps is not one.
    assert plan.family.stage1_settings() == {"image_size": 16, "labels": 32}
    changed = tiny_config(workspace, "x")
    changed.pipeline.noise_steps = 10
    assert make_plan(changed).cache_key == plan.cache_key
    changed.pipeline.labels = 16
    assert make_plan(changed).cache_key != plan.cache_key

    first = preprocess(config, workers=1, progress=False)
    assert (first.computed, first.reused) == (24, 0)

    report = train(config, run_root=workspace / "runs", env=ENV, on_line=lambda line: None)
    assert report.models_loaded == ["denoiser"] and report.updates == 3
    assert all(math.isfinite(loss) for loss in report.losses)
    exported = load_file(report.outputs["denoiser"])
    assert exported and all(k.startswith("pipe.denoiser.") and "lora_" in k for k in exported)
    assert {k.split(".")[2] for k in exported} == {"proj_in", "proj_out"}  # the family's targets

    unsplit = train(
        tiny_config(workspace, "seam-unsplit", mode="unsplit"),
        run_root=workspace / "runs",
        env=ENV,
        on_line=lambda line: None,
    )
    assert unsplit.models_loaded == ["denoiser", "encoder"]
    assert unsplit.losses == report.losses


def test_the_cli_validates_a_plugin_family_job(workspace, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(
        f'[pipeline]\nname = "tiny"\n'
        f'[models.denoiser]\nweights = "{workspace}/denoiser.safetensors"\n'
        f'[trainable]\nlora_base_model = "denoiser"\n[data]\nbase_path = "{workspace}/data"\n'
        f'[cache]\nurl = "{workspace}/cache"\n'
    )
    run = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", "validate", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert run.returncode == 0, run.stderr
    assert "HashLabels" in run.stdout and "denoiser" in run.stdout
