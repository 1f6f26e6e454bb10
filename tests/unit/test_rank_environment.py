"""What the launcher puts in the ranks' environment besides the user's: one OpenMP thread per
rank, and a fixed glibc mmap threshold (a rank's peak RSS then holds run to run); a value the
user exported wins."""

from __future__ import annotations

from pathlib import Path

from splitstage.tasks.launch.launcher import MMAP_THRESHOLD, torchrun_spec
from tests.helpers.tiny_job import tiny_config


def test_ranks_get_a_fixed_mmap_threshold_unless_the_user_sets_one(tmp_path, monkeypatch):
    config = tiny_config(Path(tmp_path), "env", seed=0)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = torchrun_spec(config, None).env
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(MMAP_THRESHOLD) == "1048576"
    assert env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    env = torchrun_spec(config, None).env
    assert (env["MALLOC_MMAP_THRESHOLD_"], env["OMP_NUM_THREADS"]) == ("65536", "4")
