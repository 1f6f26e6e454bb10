"""No model file is read before torchrun starts: `splitstage validate` and the launcher of a real
`splitstage train` read configs and safetensors headers only (demo and sd families here, the
diffsynth family in tests/diffsynth); the watch that says so sees a weights read when one happens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitstage.cli import main
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.pretrained_weights import PretrainedFile
from tests.helpers.tiny_diffusers import write_tiny_folder
from tests.helpers.tiny_job import make_workspace, tiny_config
from tests.helpers.toml_job import toml
from tests.helpers.weight_loads import weight_loads

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}


def job(root: Path, family: str) -> dict:
    """A tiny LoRA job of `family` on a digits data set (no cache yet: validate warns only)."""
    write_digits_dataset(root / "data", limit=4, size=32)
    document = {
        "job": {"name": f"{family}-no-weights"},
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache")},
        "train": {"batch_size": 2, "max_steps": 1},
        "output": {"url": str(root / "out")},
    }
    if family == "demo":
        weights = build_demo_weights(root / "weights")
        document["models"] = {
            "vae": {"weights": str(weights["vae"])},
            "dit": {"weights": str(weights["dit"])},
            "text_encoder": {"builder": "tiny"},
        }
        document["trainable"] = {"lora_base_model": "dit"}
    else:
        write_tiny_folder(family, root / family)
        pipeline = {"name": family, "pretrained": str(root / family), "resolution": 64}
        document |= {"pipeline": pipeline, "trainable": {"lora_base_model": "unet"}}
    return document


def test_the_watch_sees_weights_read(tmp_path):
    """The control: each way of reading tensors from a file is recorded, headers are not."""
    path, pickled = tmp_path / "w.safetensors", tmp_path / "w.pt"
    save_file({"w": torch.ones(2, 3)}, str(path))
    torch.save({"w": torch.ones(2)}, pickled)
    with weight_loads() as headers:
        assert PretrainedFile(str(path), "").shape("w") == (2, 3)
    with weight_loads() as seen:
        load_file(str(path))
        torch.load(pickled, weights_only=True)
        PretrainedFile(str(path), "").read("w")
    assert headers == []
    assert seen == [
        "safetensors.torch.load_file",
        "torch.serialization.load",
        "safe_open.get_tensor",
    ]


@pytest.mark.parametrize("family", ["demo", "sd"])
def test_validate_reads_no_weights(tmp_path, capsys, family, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "job.toml"
    path.write_text(toml(job(tmp_path, family)))
    with weight_loads() as seen:
        code = main(["validate", str(path)])
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "cache key:" in out and seen == []
    # the plan says what stage 2 holds each model in (here: a CPU, mixed precision auto)
    assert "stage 2 on cpu: compute: fp32 (train.mixed_precision = auto)" in out
    assert "frozen base fp32 (train.weight_dtype = auto), LoRA params fp32" in out


def test_the_launcher_reads_no_weights_before_or_while_torchrun_trains(tmp_path):
    """A real `train` (torchrun, one rank): the rank loads the DiT, this process nothing."""
    make_workspace(tmp_path, samples=4, seed=0)
    config = tiny_config(tmp_path, "no-weights", 0, batch_size=2, max_steps=1)
    lines: list[str] = []
    with weight_loads() as seen:
        report = train(config, run_root=tmp_path / "runs", env=ENV, on_line=lines.append)
    assert report.updates == 1 and "dit" in report.outputs
    assert seen == [], seen
