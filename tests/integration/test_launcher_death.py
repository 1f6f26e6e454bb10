"""A SIGKILLed launcher takes its torchrun tree with it (no rank trains on, writing, after the
run's lease went), and the rerun on the same host takes the dead holder's lease at once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from splitstage.data.digits import write_digits_dataset
from splitstage.demo import write_demo_weights
from splitstage.process.liveness import is_alive
from tests.helpers.catalogue import job

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def command(proc: psutil.Process) -> str:
    """A process's command line ('' once it has exited or is a zombie)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "SPLITSTAGE_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "splitstage.cli", *args], env=env, cwd=ROOT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killed_launcher_ends_its_ranks_and_the_rerun_takes_the_run(tmp_path):
    write_digits_dataset(tmp_path / "data", limit=8)
    write_demo_weights(tmp_path / "weights")
    (tmp_path / "prep").mkdir()
    path = job(tmp_path, tmp_path, train="batch_size = 2\nepochs = 100000\ncheckpoint_every = 5")
    assert cli(["preprocess", path]).wait(timeout=120) == 0
    launcher = cli(["train", path])
    metrics = tmp_path / "out/catalogue/metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and launcher.poll() is None, "training never started"
        time.sleep(0.2)
    tree = psutil.Process(launcher.pid).children(recursive=True)
    assert any("stage2.worker" in command(p) for p in tree)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60  # torchrun stops its workers first; slow on a loaded box
    while alive := [p for p in tree if is_alive(p)]:  # a zombie awaiting its reaper is dead
        assert time.monotonic() < deadline, [command(p) for p in alive]
        time.sleep(0.2)
    lines = metrics.read_text().count("\n")
    time.sleep(1.0)
    assert metrics.read_text().count("\n") == lines  # nothing writes for the dead run any more
    rerun = job(
        tmp_path,
        tmp_path,
        train="batch_size = 2\nepochs = 100000\nmax_steps = 12\ncheckpoint_every = 5",
    )
    assert cli(["train", rerun]).wait(timeout=180) == 0  # the dead pid's lease is taken at once


def test_an_output_folder_deleted_mid_run_is_one_line_without_thread_tracebacks(tmp_path):
    """The run's lease goes with its folder: the run stops with one line (the lost lease, or a
    rank's write into the deleted folder if that comes first); TensorBoard's writer thread,
    whose folder went too, prints no traceback."""
    write_digits_dataset(tmp_path / "data", limit=8)
    write_demo_weights(tmp_path / "weights")
    train = "batch_size = 2\nepochs = 100000\ncheckpoint_every = 5"
    path = job(tmp_path, tmp_path, train=train, tracking='report_to = "tensorboard"')
    assert cli(["preprocess", path]).wait(timeout=120) == 0
    env = {**os.environ, "SPLITSTAGE_DEVICE": "cpu", "SPLITSTAGE_LEASE_TTL": "3"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "splitstage.cli", "train", path],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "out/catalogue/metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline and launcher.poll() is None, "training never started"
        time.sleep(0.2)
    lease = tmp_path / "out/catalogue/LEASE.json"
    while lease.exists():  # ranks still writing into it can make one pass fail: not empty
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 2, (out, err)
    assert "Traceback" not in out + err, out + err
    # the lease's loss, or a rank's write into the deleted folder, whichever is seen first
    last = err.strip().splitlines()[-1]
    assert "training stopped: " in last, err
