"""The bad-input catalogue's shared parts: tiny assets, a valid job as TOML, the real CLI, and
the one-line check every case makes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitstage.cli import main
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.demo.weight_files import build_demo_weights


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("catalogue")
    write_digits_dataset(root / "data", limit=6)
    build_demo_weights(root / "weights")
    return root


def config_text(assets: Path, data: Path | None = None, extra: str = "", **sections) -> str:
    """A valid tiny job config as TOML, with `extra` lines appended."""
    data = data or assets / "data"
    return (
        f'[models.vae]\nweights = "{assets}/weights/vae.safetensors"\n'
        f'[models.dit]\nweights = "{assets}/weights/dit.safetensors"\n'
        '[models.text_encoder]\nbuilder = "tiny"\n'
        '[trainable]\nlora_base_model = "dit"\n'
        f'[data]\nbase_path = "{data}"\n'
        f'[cache]\nurl = "{assets}/cache"\n' + extra
    )


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


def check_one_line(code: int, err: str, *needles: str) -> None:
    """Exit 2, one error line (progress bars drawn before it aside), no traceback."""
    assert code == 2, err
    lines = [line for line in err.split("\n") if line and "\r" not in line]
    assert len(lines) == 1 and lines[0].startswith("splitstage: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def job(root: Path, tmp_path: Path, *, trainable: str = 'lora_base_model = "dit"', **groups):
    """A tiny valid job as TOML; `groups` replace or add whole [group] bodies (name -> lines)."""
    body = {
        "job": 'name = "catalogue"',
        "models.vae": f'weights = "{root}/weights/vae.safetensors"',
        "models.dit": f'weights = "{root}/weights/dit.safetensors"',
        "models.text_encoder": 'builder = "tiny"',
        "trainable": trainable,
        "data": f'base_path = "{root}/data"',
        "cache": f'url = "{root}/cache"\nshard_samples = 4',
        "train": "batch_size = 2\nmax_steps = 1",
        "output": f'url = "{tmp_path}/out"',
    }
    body.update({k.replace("__", "."): v for k, v in groups.items()})
    path = tmp_path / f"job-{time.monotonic_ns()}.toml"
    path.write_text("".join(f"[{name}]\n{lines}\n" for name, lines in body.items()))
    return str(path)


def cli(args: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of the real CLI, whether it returns or exits (argparse)."""
    try:
        code = main(args)
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err
