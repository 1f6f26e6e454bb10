"""Parts of different models in one pipeline folder are refused before anything loads.

Every width one component hands another (a text encoder's hidden size to the denoiser's
cross-attention, the VAE's latent channels to its input, a pooled embedding to its projection) is
read from the folder's config files by `validate`'s checks (the same run by `preprocess` and
`train`), for every diffusers family: one line naming both components and their fields, before
stage 1 spends hours on a cache the ranks then cannot use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.family import family_class
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.preflight import preflight
from tests.helpers.tiny_diffusers import write_tiny_folder

FAMILIES = ("sd", "sdxl", "sd3", "flux", "qwenimage", "wan", "zimage", "flux2", "wan_i2v")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """Each family's tiny folder and a data set, written once for the module."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("component-shapes")
    for family in FAMILIES:
        write_tiny_folder(family, root / family)
    write_digits_dataset(root / "data", limit=4, size=32)
    return root


def job(root: Path, family: str, pretrained: Path) -> dict:
    """A tiny LoRA job of `family` on `pretrained`."""
    denoiser = "unet" if family in ("sd", "sdxl") else "transformer"
    return {
        "job": {"name": "component-shapes"},
        "pipeline": {"name": family, "pretrained": str(pretrained), "resolution": 64},
        "trainable": {"lora_base_model": denoiser},
        "data": {"base_path": str(root / "data")},
        "cache": {"url": str(root / "cache")},
        "train": {"batch_size": 2, "max_steps": 1},
        "output": {"url": str(root / "out")},
    }


def validate(config: dict) -> None:
    """What `splitstage validate` runs: the config, the plan, the preflight."""
    preflight(make_plan(config_from_dict(config)))


def widened(config: dict, path: str, by: int) -> None:
    """The field at dotted `path` (first of `a|b` alternatives present) grown by `by`."""
    for alternative in path.split("|"):
        *parents, last = alternative.split(".")
        holder = config
        for part in parents:
            holder = holder.get(part, {})
        if isinstance(holder.get(last), int):
            holder[last] += by
            return
    raise AssertionError(f"{path} is not in the tiny config")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_whose_parts_match_passes(family, assets):
    validate(job(assets, family, assets / family))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_part_of_another_width_is_refused_naming_both_parts(family, assets, tmp_path):
    """For each width a component of the tiny folder gives, grow it (that config only: what a
    user's mixed folder has): refused in one line naming the giver's field and the first taker
    of it, with both values."""
    links = family_class(family).shape_links
    present = [
        link for link in links if all((assets / family / c).is_dir() for c in link.components)
    ]
    givers = {(link.given[0].component, link.given[0].field): link for link in reversed(present)}
    assert givers, f"{family} declares no shape links its tiny folder can check"
    for number, ((component, field), link) in enumerate(givers.items()):
        folder = tmp_path / f"{family}-{number}"
        shutil.copytree(assets / family, folder)
        path = folder / component / "config.json"
        config = json.loads(path.read_text())
        widened(config, field, 4096)  # past any padding the taker allows
        path.write_text(json.dumps(config))
        with pytest.raises(UserError) as info:
            validate(job(assets, family, folder))
        message = str(info.value)
        assert "\n" not in message, message
        name = field.split("|")[0].rsplit(".", 1)[-1]
        for needle in (
            f"the {component}'s {name}",
            f"the {link.taker.component}'s {link.taker.field}",
            "come from different models",
            f"[models.{component}] weights",
        ):
            assert needle in message, (needle, message)
