"""Issue 26, tracebacks that hide the cause: bad CLI paths and shapes, and the stage-2 write paths
on a full disk, each ONE line naming the path or field and what to change, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.catalogue import check_one_line, cli, config_text
from tests.helpers.signals import default_sigint

ROOT = Path(__file__).resolve().parents[2]


def _out_dir_cases(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    images_file = tmp_path / "images-is-a-file"
    images_file.mkdir()
    (images_file / "images").write_text("x")
    return {
        "a file": (str(a_file), ["OUT_DIR", "a-file", "exists and is not a folder"]),
        "under a file": (str(a_file / "sub"), ["a-file/sub", "a file stands where a folder"]),
        "no such parent": ("/proc/x", ["/proc/x", "does not exist"]),
        "a file inside": (str(images_file), ["images-is-a-file/images", "not a folder"]),
    }


@pytest.mark.parametrize("case", ["a file", "under a file", "no such parent", "a file inside"])
def test_data_digits_out_dir(case, tmp_path, capsys):
    out, needles = _out_dir_cases(tmp_path)[case]
    check_one_line(*cli(["data", "digits", out, "--limit", "2"], capsys), *needles)


@pytest.mark.parametrize("case", ["a file", "no such parent"])
def test_demo_weights_out_dir_fails_before_training(case, tmp_path):
    out, needles = _out_dir_cases(tmp_path)[case]
    result = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", "demo-weights", out],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    check_one_line(result.returncode, result.stderr, *needles)


@pytest.mark.parametrize(
    "stages, needles",
    [
        ([["blocks.0", ["blocks.1"]]], ["stage 0", "got list ['blocks.1']", "flat list"]),
        ([["blocks.0"], [{"a": 1}]], ["stage 1", "got dict"]),
        ([["blocks.0", 3], ["blocks.1"]], ["stage 0", "got int 3"]),
    ],
)
def test_stages_validate_nested_entries(stages, needles, tmp_path, capsys):
    path = tmp_path / "stages.json"
    path.write_text(json.dumps(stages))
    args = ["stages", "--modules", "blocks.0,blocks.1", "--validate", str(path)]
    check_one_line(*cli(args, capsys), *needles)


REFUSING_RANK = (
    "import os, sys\n"
    "rank = os.environ['RANK']\n"
    "print(f'[rank{rank}] splitstage: error: refusing on purpose', file=sys.stderr)\n"
    "sys.exit(2)\n"
)


def test_a_rank_refusal_shows_the_rank_line_and_logs_torchruns_report(tmp_path):
    from splitstage.process.torchrun import AGENT_LOG, TorchrunSpec, run_torchrun

    script = tmp_path / "rank.py"
    script.write_text(REFUSING_RANK)
    shown: list[str] = []
    result = run_torchrun(TorchrunSpec(str(script), nproc_per_node=2), on_line=shown.append)
    assert result.returncode == 1 and result.failed_rank is not None
    text = "\n".join(shown)
    assert "splitstage: error: refusing on purpose" in text
    assert "Traceback" not in text and "ChildFailedError" not in text and "exitcode" not in text
    log = Path(result.log_dir) / AGENT_LOG
    assert shown[-1] == f"torchrun's own report of the failure: {log}"
    report = log.read_text()
    assert "ChildFailedError" in report and "Root Cause" in report and "refusing" in report


def test_an_agent_traceback_that_is_not_a_failed_child_is_shown(tmp_path):
    from splitstage.process.torchrun import AgentReport

    shown: list[str] = []
    report = AgentReport(str(tmp_path / "torchrun.log"), shown.append)
    lines = [
        "Traceback (most recent call last):",
        '  File "run.py", line 1, in main',
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: timed out",
    ]
    for line in ["[default0]:hello", *lines]:
        report(line)
    report.close()
    assert shown == ["[default0]:hello", *lines]


@pytest.fixture
def full_disk(tmp_path):
    """A 512 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    where = tmp_path / "small-disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


FULL_DISK_WRITES = (
    "import sys, torch\n"
    "from splitstage.storage.files import storage_errors\n"
    "from splitstage.tasks.stage2.checkpoint import save_checkpoint\n"
    "root, what = sys.argv[1], sys.argv[2]\n"
    "model = torch.nn.Linear(512, 512)\n"
    "if what == 'checkpoint':\n"
    "    save_checkpoint(root + '/ck', 2, model, None, {'update': 2})\n"
    "else:\n"
    "    open(root + '/filler', 'wb').write(b'x' * (500 << 10))\n"
    "    with storage_errors(root + '/out', 'write the export'):\n"
    "        torch.save(model.state_dict(), root + '/out.pt')\n"  # torch's zip writer: no errno
)


@pytest.mark.parametrize("what", ["checkpoint", "torch.save"])
def test_a_full_disk_names_the_path_and_that_it_is_full(what, full_disk):
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_WRITES, str(full_disk), what],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstage.storage.files.StorageFullError: cannot write "), last
    assert str(full_disk) in last and "no space left on device" in last
    assert "inline_container" not in last


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["importing", "computing"])
def test_ctrl_c_during_preprocess_with_workers_is_one_line(tmp_path, phase):
    """SIGINT to the terminal's process group (what Ctrl-C sends) while two pool workers run:
    'interrupted', exit 130, no worker traceback, and a rerun finishes the cache."""
    import signal
    import time

    import psutil

    from splitstage.data.digits import write_digits_dataset
    from splitstage.pipelines.demo.weight_files import build_demo_weights

    write_digits_dataset(tmp_path / "data", limit=256)
    build_demo_weights(tmp_path / "weights")
    path = tmp_path / "job.toml"
    # extra lines continue [cache]: 4-sample shards, so the first one appears as compute starts
    path.write_text(
        config_text(tmp_path, extra="shard_samples = 4\n[preprocess]\nbatch_size = 1\n")
    )
    command = [sys.executable, "-m", "splitstage.cli", "preprocess", str(path), "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 120
    while len(psutil.Process(process.pid).children()) < 2:  # both workers started
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.1)
    if phase == "importing":
        time.sleep(1.0)  # the workers import torch and the family (seconds)
    else:  # the first shard is written: the workers compute, 250-odd samples left
        while not list((tmp_path / "cache").glob("*/shards/*.safetensors")):
            assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
            time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "splitstage: interrupted"
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
