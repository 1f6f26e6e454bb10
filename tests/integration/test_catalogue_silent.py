"""Catalogue, class 3: results that were silently wrong. Real runs (torchrun, the demo's models):
a diverging loss stops with one line and exports nothing; a cache that no longer matches the data
set is named with its counts before training; a resume after a config change continues exactly
(saying what changed) or is refused naming the change."""

from __future__ import annotations

import csv
import shutil
import threading
import time
from pathlib import Path

import pytest

from splitstage.data.digits import write_digits_dataset
from splitstage.demo import write_demo_weights
from tests.helpers.catalogue import check_one_line, cli, job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """12 digits, the demo weights, and the job's cache filled once."""
    root = tmp_path_factory.mktemp("silent")
    write_digits_dataset(root / "data", limit=12)
    write_demo_weights(root / "weights")
    (root / "prep").mkdir()
    assert cli_ok(["preprocess", job(root, root / "prep")])
    return root


def cli_ok(args: list[str]) -> bool:
    from splitstage.cli import main

    return main(args) == 0


def test_a_diverging_loss_stops_with_one_line_and_exports_nothing(assets, tmp_path, capsys):
    path = job(assets, tmp_path, train="batch_size = 2\nmax_steps = 4\nlearning_rate = 1e30")
    code, err = cli(["train", path], capsys)
    check_one_line(code, err, "the loss is", "lower train.learning_rate")
    assert not list(tmp_path.glob("out/**/*.safetensors"))


def test_a_cache_that_no_longer_matches_the_data_set_is_named(assets, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(assets / "data", data)
    rows = list(csv.DictReader((data / "metadata.csv").open()))
    shutil.copy(data / rows[0]["image"], data / "images/added.png")
    rows = rows[1:] + [{"image": "images/added.png", "prompt": "a brand new digit"}]
    with (data / "metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    groups = {"data": f'base_path = "{data}"'}
    code, err = cli(["train", job(assets, tmp_path, **groups)], capsys)
    check_one_line(code, err, "1 of its 12 samples are not cached", "1 cached samples are no")
    path = job(
        assets,
        tmp_path,
        train="batch_size = 2\nmax_steps = 1\nallow_stale_cache = true",
        **groups,
    )
    assert cli_ok(["train", path])
    assert "training on those 11 samples" in capsys.readouterr().out


def test_resume_after_a_config_change_continues_exactly_or_is_refused(assets, tmp_path, capsys):
    first = "batch_size = 2\nepochs = 1\nmax_steps = 2\ncheckpoint_every = 1"
    assert cli_ok(["train", job(assets, tmp_path, train=first)])
    capsys.readouterr()
    # 12 samples, 4 seen: with batch 3 the epoch's other 8 give 2 more updates (2 dropped).
    second = "batch_size = 3\nepochs = 1\nlearning_rate = 5e-5\ncheckpoint_every = 1"
    assert cli_ok(["train", job(assets, tmp_path, train=second)])
    out = capsys.readouterr().out
    assert "train.batch_size changed 2 -> 3" in out and "train.learning_rate changed" in out
    assert "train catalogue: 4 updates" in out
    lora = 'lora_base_model = "dit"\nlora_rank = 4'
    refused = job(assets, tmp_path, trainable=lora, train=second)
    code, err = cli(["train", refused], capsys)
    check_one_line(code, err, "trainable.lora_rank: 8 -> 4", "another --run-id")


def test_a_second_train_of_the_same_run_is_refused_while_the_first_holds_it(
    assets, tmp_path, capsys
):
    from splitstage.config.job import load_config
    from splitstage.tasks.launch.launcher import train

    path = job(assets, tmp_path, train="batch_size = 2\nmax_steps = 100000\ncheckpoint_every = 1")
    cancel, errors = threading.Event(), []

    def first() -> None:
        try:
            train(load_config(path), cancel=cancel, on_line=lambda line: None)
        except Exception as error:  # cancelled: the torchrun error is expected
            errors.append(error)

    holder = threading.Thread(target=first)
    holder.start()
    lease = tmp_path / "out/catalogue/LEASE.json"
    try:
        deadline = time.monotonic() + 60
        while not lease.exists():
            assert time.monotonic() < deadline and holder.is_alive(), errors
            time.sleep(0.2)
        code, err = cli(["train", path], capsys)
        check_one_line(code, err, "is held by another training run", "another --run-id")
    finally:
        cancel.set()
        holder.join(timeout=60)
    assert not lease.exists()  # released when the first run ended
