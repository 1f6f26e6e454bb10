"""A resumed run ends bitwise where an uninterrupted one does, for each family added beside
Qwen-Image-Edit (whose own test file checks it): FLUX.1 Kontext (references), Wan
image-to-video (clips, a conditioning frame, a batch that is a whole epoch), Z-Image and FLUX.2,
on their tiny folders with caption dropout drawn every step.
Run: .venv/bin/pytest -m slow tests/integration/test_families_resume.py
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from splitstage.data.digits import write_digits_dataset
from tests.helpers.diffusers_families import assert_resume_is_bitwise, lora_job
from tests.helpers.family_roots import add_reference_images, write_clips_dataset
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
DROPOUT = 0.5  # caption dropout: a per-step draw the resumed run must draw again the same way
JOBS = {  # each family's job settings beside lora_job's: prompt length, batch, clips
    "flux_kontext": {"pipeline": {"max_prompt_length": 16}},
    "zimage": {"pipeline": {"max_prompt_length": 48}},
    "flux2": {"pipeline": {"max_prompt_length": 48}},
    "wan_i2v": {  # 2 clips a batch: each update an epoch, so the resume starts the second
        "data": {"video": {"num_frames": 5, "frame_stride": 2}},
        "train": {"epochs": 2},
    },
}


def write_root(root: Path, family: str) -> Path:
    """The family's tiny folder in root/family and its data in root/data: 4 digits (with
    reference images for Kontext), or 2 short clips for Wan."""
    if family == "wan_i2v":
        write_clips_dataset(root / "data", count=2)
    else:
        write_digits_dataset(root / "data", limit=4, size=32)
    if family == "flux_kontext":
        add_reference_images(root / "data")
    write_tiny_folder(family, root / family)
    return root


def resume_job(root: Path, family: str, max_steps: int):
    """The family's LoRA job (see lora_job) with caption dropout, for `max_steps` updates."""
    settings = JOBS[family]
    pipeline = {"caption_dropout": DROPOUT} | settings.get("pipeline", {})
    data, train = settings.get("data"), settings.get("train", {})
    return lora_job(
        root, family, "resume", pipeline=pipeline, data=data, max_steps=max_steps, **train
    )


@pytest.mark.parametrize("family", list(JOBS))
def test_a_resumed_run_ends_bitwise_where_an_uninterrupted_one_does(tmp_path_factory, family):
    """1 update, then a resume to 2, give the losses and the LoRA of 2 updates in one go."""
    torch.set_num_threads(1)
    root = write_root(tmp_path_factory.mktemp(family), family)
    assert_resume_is_bitwise(partial(resume_job, root, family), root, halt=1, total=2)
