"""A tiny stage-1 job on digits (24 samples) and demo weights, shared by the preprocess tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.demo.weight_files import build_demo_weights


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """Digits (24 samples) and demo weights, shared read-only by the module's tests."""
    root = tmp_path_factory.mktemp("assets")
    write_digits_dataset(root / "data", limit=24)
    build_demo_weights(root / "weights")
    return root


def make_config(assets: Path, tmp: Path, **overrides):
    """A tiny job whose data set is a private copy (tests may edit it)."""
    data = tmp / "data"
    if not data.exists():
        shutil.copytree(assets / "data", data)
    document = {
        "models": {
            "vae": {"weights": str(assets / "weights/vae.safetensors")},
            "dit": {"weights": str(assets / "weights/dit.safetensors")},
            "text_encoder": {"builder": "tiny"},
        },
        "trainable": {"lora_base_model": "dit"},
        "data": {"base_path": str(data)},
        "cache": {"url": str(tmp / "cache"), "shard_samples": 8},
        "preprocess": {"batch_size": 4},
    }
    for group, fields in overrides.items():
        document.setdefault(group, {}).update(fields)
    return config_from_dict(document)
