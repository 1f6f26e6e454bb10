"""What an interrupted writer leaves in a cache (Ctrl-C, a killed worker mid-write: `*.tmp-*`
files) is removed by the next `preprocess` and by `cache verify`, which say how many bytes came
back; a temporary file whose writer still runs (this host: its process is alive; another host:
younger than a day) is left alone.

The writers are real processes killed with SIGKILL in the middle of a write.
Run: .venv/bin/python -m pytest -q -m slow tests/integration/test_interrupted_writes.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from splitstage.storage.files import STALE_TEMP_SECONDS, TEMP_MARK
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage1.preprocess import preprocess
from tests.helpers import preprocess_job
from tests.helpers.preprocess_job import make_config

pytestmark = pytest.mark.slow
assets = preprocess_job.assets  # the shared module-scoped fixture
ROOT = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent(
    """
    import os, signal, sys, time
    from splitstage.storage.files import temp_path
    path, size, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(temp_path(path), "wb") as out:  # what write_atomic writes through
        out.write(os.urandom(size))
        out.flush()
        print("written", flush=True)
        if then == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write: no clean-up runs
        time.sleep(600)
    """
)


def writer(path: str, size: int, then: str) -> subprocess.Popen:
    """A process that starts an atomic write of `size` bytes to `path`, then dies or waits."""
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, path, str(size), then],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.stdout.readline().strip() == "written"
    if then == "die":
        child.wait(timeout=60)
    return child


def temps(folder: Path) -> list[Path]:
    """The temporary files under `folder`."""
    return sorted(p for p in folder.rglob(f"*{TEMP_MARK}*") if p.is_file())


def test_rerun_and_verify_remove_what_an_interrupted_writer_left(assets, tmp_path):
    config = make_config(assets, tmp_path)
    preprocess(config, workers=1, progress=False)
    store = make_plan(config).cache
    cache = Path(store.root)
    shard = next((cache / "shards").iterdir())
    entry = next((cache / "index").iterdir())
    writer(str(shard), 300_000, "die")
    writer(str(entry), 1_000, "die")
    alive = writer(str(cache / "manifest.json"), 2_000, "wait")
    other = cache / f"index/x.json{TEMP_MARK}123-0123456789ab-ffffffff"  # another host's
    other.write_bytes(b"x" * 500)
    abandoned = cache / f"shards/y.safetensors{TEMP_MARK}124-0123456789ab-fffffffe"
    abandoned.write_bytes(b"y" * 700)
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(abandoned, (old, old))
    try:
        assert len(temps(cache)) == 5
        report = preprocess(config, workers=1, progress=False)
        assert (report.temp_files_removed, report.bytes_reclaimed) == (3, 301_700)
        assert "removed 3 unfinished temporary file(s) an interrupted run left (0.30 MB " in (
            report.line()
        )
        left = temps(cache)
        assert other in left and len(left) == 2  # the live writer's and the other host's
        writer(str(shard), 4_000, "die")
        verified = store.verify()
        assert (verified.temp_files_removed, verified.bytes_reclaimed) == (1, 4_000)
        assert verified.ok and any("removed 1 unfinished" in line for line in verified.lines())
        assert len(temps(cache)) == 2
    finally:
        alive.kill()
        alive.wait()
    again = preprocess(config, workers=1, progress=False)  # its writer is gone now
    assert again.temp_files_removed == 1 and temps(cache) == [other]
    assert preprocess(config, workers=1, progress=False).temp_files_removed == 0


def test_the_data_memo_folder_is_swept_too(tmp_path):
    from splitstage.data.hash_memo import FOLDER
    from splitstage.tasks.cache.store import MEMO_FOLDER, CacheStore

    assert MEMO_FOLDER == FOLDER
    memo = tmp_path / "cache" / FOLDER / "abc.parquet"
    memo.parent.mkdir(parents=True)
    writer(str(memo), 1_234, "die")
    assert CacheStore(str(tmp_path / "cache"), "ck").sweep_temp_files() == (1, 1_234)
    assert temps(tmp_path) == []
