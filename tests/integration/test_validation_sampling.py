"""Validation sampling while training, on a tiny SD folder: prompts encoded in stage 1 beside the
cache (not in its key), grids every N updates and at the end, the same images for a seed, in
TensorBoard too, refused before launch when the prompts are not encoded, never failing a run."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.tasks.cache.validation_prompts import prompts_path
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.outputs import run_places
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.tiny_diffusers import write_tiny_folder
from tests.helpers.wandb_records import history

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
PROMPTS = ["a handwritten digit seven", "a handwritten digit one"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("validation")
    write_digits_dataset(root / "data", limit=8, size=32)
    write_tiny_folder("sd", root / "sd")
    return root


def job(root: Path, name: str, validation=None, **train):
    return config_from_dict(
        {
            "job": {"name": name, "seed": 2},
            "pipeline": {"name": "sd", "pretrained": str(root / "sd"), "resolution": 64},
            "trainable": {"lora_base_model": "unet", "lora_rank": 4},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache")},
            "train": {"batch_size": 4, "max_steps": 2, "learning_rate": 1e-3} | train,
            "output": {"url": str(root / "out")},
            "validation": validation
            if validation is not None
            else {"prompts": PROMPTS, "steps": 3, "every": 1, "images_per_prompt": 2},
            "tracking": {"report_to": ["tensorboard"]},
        }
    )


def run(config, root: Path, env=None):
    return train(config, run_root=root / "runs", env={**ENV, **(env or {})}, on_line=lambda _: None)


def pixels(path: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(Path(path).read_bytes())).convert("RGB"))


def test_prompts_are_encoded_beside_the_cache_and_grids_are_written(root):
    plain = job(root, "no-validation", validation={})
    config = job(root, "sampled")
    assert make_plan(config).cache_key == make_plan(plain).cache_key  # not in the samples' key
    first = preprocess(plain, workers=1, progress=False)
    assert first.computed == 8 and first.validation_prompts is None
    with pytest.raises(ConfigError, match=r"validation.prompts are not encoded.*preprocess"):
        preflight(make_plan(config), run_places(config, "v", root / "runs"))  # before training
    again = preprocess(config, workers=1, progress=False)
    assert (again.computed, again.reused) == (0, 8)  # only the prompts were encoded
    assert Path(again.validation_prompts).is_file()

    report = run(config, root)
    assert sorted(report.samples) == ["1", "2"]  # every update, and the end
    grid = pixels(report.samples["2"])
    assert grid.shape[0] > 2 * 64 and grid.shape[1] == 2 * 64  # 2 prompts x 2 images
    assert report.models_loaded == ["unet"]  # the decoder is loaded only while decoding

    repeat = run(job(root, "sampled-again"), root)
    assert np.array_equal(pixels(repeat.samples["2"]), grid)  # same seed, same images
    other = run(job(root, "other-seed", validation={"prompts": PROMPTS, "seed": 9}), root)
    assert not np.array_equal(
        pixels(other.samples["2"]), grid[: pixels(other.samples["2"]).shape[0]]
    )

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(report.run_dir) / "tracking" / "sampled")).Reload()
    scalars = {"loss", "grad_norm", "lr", "samples_per_s", "peak_rss_gib"}
    assert scalars <= set(events.Tags()["scalars"])
    assert all(s.value > 0 for s in events.Scalars("peak_rss_gib"))  # rank 0's peak, in GiB
    log = read_metrics(Path(report.run_dir))
    assert len(log) == 2 and all(0 < record["peak_rss_gib"] < 1024 for record in log)
    assert [e.step for e in events.Images("samples")] == [1, 2]
    assert [s.step for s in events.Scalars("loss")] == [1, 2]


def test_changed_prompts_keep_the_cache_and_a_sampling_failure_never_fails_the_run(root):
    config = job(root, "changed", validation={"prompts": ["a handwritten digit two"]})
    preprocess(config, workers=1, progress=False)
    fs, path, _ = prompts_path(make_plan(config))
    assert Path(path).is_file()
    report = run(config, root, env={"SPLITSTAGE_FAULT_VALIDATION": "1"})
    assert report.updates == 2 and report.samples == {}
    assert Path(report.outputs["unet"]).is_file()  # exported as usual
    log = read_metrics(Path(report.run_dir))
    assert len(log) == 2 and all("loss" in record for record in log)


def test_wandb_offline_gets_the_figures_and_the_grids(root):
    pytest.importorskip("wandb")  # in the test extra: installed wherever `make test` runs
    config = job(root, "wandb-offline")
    config.tracking.report_to = ["wandb"]
    folder = root / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_SILENT": "true"}
    preprocess(config, workers=1, progress=False)
    report = run(config, root, env=env)
    assert report.updates == 2
    (offline,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history(offline)
    assert [row["_step"] for row in rows] == [1, 2]
    assert [row["loss"] for row in rows] == pytest.approx(report.losses)
    assert all(row["grad_norm"] > 0 and row["lr"] == 1e-3 for row in rows)
    assert all(0 < row["peak_rss_gib"] < 1024 for row in rows)  # GiB, not KiB
    assert all(row["samples/_type"] == "images/separated" for row in rows)  # the grids
    assert len(list(offline.parent.glob("files/media/images/samples_*.png"))) == 2


def test_bad_validation_settings_are_one_line_errors(root, monkeypatch):
    with pytest.raises(ConfigError, match="negative_prompts has 1 entries for 2 prompts"):
        job(root, "x", validation={"prompts": PROMPTS, "negative_prompts": ["blurry"]})
    with pytest.raises(ConfigError, match="validation.steps"):
        job(root, "x", validation={"prompts": PROMPTS, "steps": 0})
    config = job(root, "wandb")
    config.tracking.report_to = ["wandb"]
    real_find_spec = importlib.util.find_spec  # wandb is installed here: hide it from the check
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"tracking.report_to: wandb is not installed; `pip"):
        preflight(make_plan(config), run_places(config, "v", root / "runs"))
