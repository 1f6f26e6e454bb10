"""A resume is refused on other base weights or another family, before launch, in one line that
names both and how to start fresh; the checkpoint stays intact. Real runs (the CLI, torchrun, the
demo's models; tiny diffusers folders for sd -> sdxl). A checkpoint that records no base is refused
too, and the export's metadata names the base it was trained on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from splitstage.data.digits import write_digits_dataset
from splitstage.demo import write_demo_weights
from splitstage.tasks.stage2.checkpoint import EXTRA, pack_extra, unpack_extra
from tests.helpers.catalogue import check_one_line, cli, job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """8 digits, the demo weights, a second DiT file of the same architecture, the cache."""
    root = tmp_path_factory.mktemp("identity")
    write_digits_dataset(root / "data", limit=8)
    write_demo_weights(root / "weights")
    dit = root / "weights/dit.safetensors"
    with safe_open(str(dit), "pt") as handle:
        metadata = handle.metadata()
    other = {k: t + 0.01 for k, t in load_file(str(dit)).items()}
    save_file(other, str(root / "other-dit.safetensors"), metadata=metadata)
    (root / "prep").mkdir()
    from splitstage.cli import main

    assert main(["preprocess", job(root, root / "prep")]) == 0
    return root


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under a folder, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_resume_on_other_base_weights_is_refused_and_the_checkpoint_kept(
    assets, tmp_path, capsys
):
    train = "batch_size = 2\nmax_steps = 2\ncheckpoint_every = 1"
    code, err = cli(["train", job(assets, tmp_path, train=train)], capsys)
    assert code == 0, err
    checkpoints = tmp_path / "out/catalogue/checkpoints"
    before = tree_digest(checkpoints)
    assert "step-00000002/COMPLETE" in before

    other = f'weights = "{assets}/other-dit.safetensors"'
    longer = "batch_size = 2\nmax_steps = 4\ncheckpoint_every = 1"
    code, err = cli(["train", job(assets, tmp_path, train=longer, models__dit=other)], capsys)
    check_one_line(
        code,
        err,
        "checkpoint step 2 was trained on other base weights",
        f"dit: trained on {assets}/weights/dit.safetensors (sha256 ",
        f"now {assets}/other-dit.safetensors (sha256 ",
        "another --run-id",
        str(checkpoints),
    )
    assert tree_digest(checkpoints) == before  # nothing lost, nothing written

    # A checkpoint that records no base (not splitstage's, or damaged): refused, nothing lost.
    extra_file = checkpoints / "step-00000002" / EXTRA
    original = extra_file.read_bytes()
    extra = unpack_extra(original)
    assert extra["settings"]["base"]["models"]["dit"]["source"].endswith("dit.safetensors")
    del extra["settings"]["base"]
    extra_file.write_bytes(pack_extra(extra, "extra_state"))
    changed = tree_digest(checkpoints)
    code, err = cli(["train", job(assets, tmp_path, train=longer)], capsys)
    check_one_line(code, err, "checkpoint step 2", "records no family or base weights")
    assert tree_digest(checkpoints) == changed
    extra_file.write_bytes(original)
    from splitstage.cli import main

    assert main(["train", job(assets, tmp_path, train=longer)]) == 0
    assert "resumed from checkpoint step 2" in capsys.readouterr().out

    # The export names the base it was trained on (and a resume on it is accepted).
    with safe_open(str(tmp_path / "out/catalogue/dit_lora.safetensors"), "pt") as handle:
        metadata = handle.metadata()
    assert metadata["splitstage_family"] == "demo"
    base = json.loads(metadata["splitstage_base"])
    assert base["dit"]["source"] == f"{assets}/weights/dit.safetensors"
    assert (
        base["dit"]["fingerprint"]
        == hashlib.sha256((assets / "weights/dit.safetensors").read_bytes()).hexdigest()
    )
    assert metadata["lora"] == "true"  # the family's own metadata is kept


def test_a_family_or_pretrained_folder_switch_is_refused_before_launch(tmp_path, capsys):
    """The same run resumed as sdxl (another family), then as sd on another folder (other
    weights under the same family: `pipeline.pretrained`): each one line, nothing lost."""
    from tests.helpers.tiny_diffusers import write_tiny_folder

    write_digits_dataset(tmp_path / "data", limit=4, size=32)
    folders = {"sd": ("sd", 0), "sdxl": ("sdxl", 0), "sd-other": ("sd", 1)}
    for folder, (kind, seed) in folders.items():
        write_tiny_folder(kind, tmp_path / folder, seed=seed)

    def sd_job(folder: str) -> str:
        kind = folders[folder][0]
        body = {
            "job": 'name = "switch"',
            "pipeline": f'name = "{kind}"\npretrained = "{tmp_path / folder}"\nresolution = 64',
            "trainable": 'lora_base_model = "unet"\nlora_rank = 4',
            "data": f'base_path = "{tmp_path / "data"}"',
            "cache": f'url = "{tmp_path / "cache"}"\nshard_samples = 4',
            "train": "batch_size = 2\nmax_steps = 2\ncheckpoint_every = 1",
            "output": f'url = "{tmp_path / "out"}"',
        }
        path = tmp_path / f"{folder}.toml"
        path.write_text("".join(f"[{name}]\n{lines}\n" for name, lines in body.items()))
        return str(path)

    torch.set_num_threads(1)
    first, second, third = (sd_job(folder) for folder in folders)
    code, err = cli(["preprocess", first], capsys)
    assert code == 0, err
    code, err = cli(["train", first], capsys)
    assert code == 0, err
    checkpoints = tmp_path / "out/switch/checkpoints"
    before = tree_digest(checkpoints)
    # refused before the cache is even looked at (no sdxl preprocess) and before any rank starts
    code, err = cli(["train", second], capsys)
    check_one_line(
        code,
        err,
        "checkpoint step 2 was trained on the 'sd' family",
        "this config names 'sdxl'",
        "another --run-id",
    )
    assert "shape" not in err
    assert tree_digest(checkpoints) == before
    code, err = cli(["train", third], capsys)
    check_one_line(
        code,
        err,
        "checkpoint step 2 was trained on other base weights",
        f"now {tmp_path / 'sd-other'}",
        "another --run-id",
    )
    assert tree_digest(checkpoints) == before
