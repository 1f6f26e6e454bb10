"""The stage-2 preflight counts batches as stage 2 plans them: within one aspect bucket, with the
bucket's tail. A cache whose sample count fills enough global batches but whose buckets do not
is refused by `validate` and `train` in one line, exit 2, before torchrun starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from splitstage.config.job import load_config
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.stage1.preprocess import preprocess
from tests.helpers.catalogue import check_one_line, cli

pytestmark = pytest.mark.slow
SHAPES = [(64, 64), (60, 120), (120, 60)]  # source (height, width): square, wide, tall
COUNTS = [5, 3, 3]  # 11 samples: 5 global batches of 2, but 2 + 1 + 1 within the buckets


def job(root: Path, folder: Path, *, accumulate: int, tail: str = "drop") -> str:
    """A tiny bucketed LoRA job as TOML (batch 2, one rank), written under `folder`."""
    text = f"""
[job]
name = "buckets"
[models.vae]
weights = "{root}/weights/vae.safetensors"
[models.dit]
weights = "{root}/weights/dit.safetensors"
[models.text_encoder]
builder = "tiny"
[trainable]
lora_base_model = "dit"
[data]
base_path = "{root}/data"
[data.buckets]
enabled = true
step = 16
tail = "{tail}"
[cache]
url = "{root}/cache"
shard_samples = 4
[train]
batch_size = 2
gradient_accumulation_steps = {accumulate}
max_steps = 1
[output]
url = "{folder}/out"
"""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"job-{accumulate}-{tail}.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> Path:
    """Images in three aspect ratios, preprocessed once into a bucketed cache."""
    root = tmp_path_factory.mktemp("preflight-buckets")
    (root / "data").mkdir()
    lines = ["image,prompt"]
    for shape, ((h, w), count) in enumerate(zip(SHAPES, COUNTS)):
        for i in range(count):
            Image.new("RGB", (w, h), (60 * shape, 30 * i, 200)).save(root / f"data/{shape}_{i}.png")
            lines.append(f"{shape}_{i}.png,shape {shape} number {i}")
    (root / "data/metadata.csv").write_text("\n".join(lines) + "\n")
    build_demo_weights(root / "weights")
    preprocess(load_config(job(root, root / "prep", accumulate=1)), workers=1, progress=False)
    return root


NEEDLES = [  # the buckets and their sizes, the real count, and fixes that would fit
    "11 samples in 3 buckets",
    ": 5, ",
    ": 3",
    "tail 'drop'",
    "give 4 batches per rank per epoch",
    "train.gradient_accumulation_steps=5: no update would run",
    "set train.batch_size <= 1",
    "lower train.gradient_accumulation_steps to <= 4",
    "set data.buckets.tail = 'repeat' (7 batches)",
    "larger data.buckets.step",
]


def test_validate_refuses_buckets_too_small_for_the_accumulation(cached, tmp_path, capsys):
    assert sum(COUNTS) // 2 >= 5  # the count over all samples would let this job through
    check_one_line(*cli(["validate", job(cached, tmp_path, accumulate=5)], capsys), *NEEDLES)


def test_train_refuses_it_before_any_weight_loads(cached, tmp_path, capsys):
    check_one_line(*cli(["train", job(cached, tmp_path, accumulate=5)], capsys), *NEEDLES)
    assert list(tmp_path.rglob("spec.json"))  # the rank's set-up refused it (rank_setup.py)
    assert not list(tmp_path.rglob("step-*")) and not list(tmp_path.rglob("*.safetensors"))


def test_validate_reports_the_tail_cost_of_a_job_that_fits(cached, tmp_path, capsys):
    code, err = cli(["validate", job(cached, tmp_path, accumulate=4)], capsys)
    assert code == 0, err
    assert "tail drop: 3 samples dropped and 0 repeated per epoch" in err
    code, err = cli(["validate", job(cached, tmp_path, accumulate=5, tail="repeat")], capsys)
    assert code == 0, err
    assert "tail repeat: 0 samples dropped and 3 repeated per epoch" in err
