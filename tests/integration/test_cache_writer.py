"""Stage 1's overlapped cache writer on S3 (moto on loopback): shards are encoded and uploaded
ahead, yet each index entry follows its own shard file, commits go strictly in order, and a kill
after N commits leaves exactly N committed shards."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from splitstage.tasks.cache.store import CacheStore
from tests.helpers.cache_samples import key_of, make_samples
from tests.helpers.cache_writer import overlapped_run

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

ROOT = Path(__file__).resolve().parents[2]


def test_a_prepared_shard_is_invisible_until_write_shard_commits_it(s3_bucket):
    url, options = s3_bucket
    store = CacheStore(url, "ck", options)
    prepared = store.prepare_shard(make_samples([1, 2]))
    prepared.wait()  # its file was uploaded ahead ...
    assert store.fs.exists(prepared.shard_path)
    assert not store.fs.exists(prepared.index_path)  # ... but nothing names it yet
    assert CacheStore(url, "ck", options).committed_keys() == set()
    assert len(CacheStore(url, "ck", options).verify().orphans) == 1
    info = store.write_shard(prepared)
    assert store.committed_keys() == {key_of(1), key_of(2)}
    again = CacheStore(url, "ck", options)
    assert again.write_shard(make_samples([2, 1])) == info  # idempotent: same id, same files
    report = again.verify()
    assert report.ok and report.orphans == [] and again.stats().shards == 1
    with pytest.raises(ValueError, match="prepared for another cache"):
        CacheStore(url, "other", options).write_shard(store.prepare_shard(make_samples([3])))


def test_uploads_overlap_but_each_entry_follows_its_shard_and_commits_keep_their_order(s3_bucket):
    url, options = s3_bucket
    store = CacheStore(url, "ck", options)
    events: list[tuple[str, str]] = []  # ("start" | "end", file name), in time order
    lock = threading.Lock()
    real = store.fs._pipe_file

    async def logged(path, data, **kw):
        name = path.rsplit("/", 1)[-1]
        with lock:
            events.append(("start", name))
        if name.endswith(".json"):
            await asyncio.sleep(0.05)  # slow commits: the next shard uploads meanwhile
        await real(path, data, **kw)
        with lock:
            events.append(("end", name))

    store.fs._pipe_file = logged
    handed: list[str] = []

    def write(prepared):
        handed.append(prepared.info.shard_id)
        store.write_shard(prepared)

    pipe, todo = overlapped_run(store, write, shards=6)
    pipe.run(todo)
    expected = [
        CacheStore("memory://order", "ck").write_shard(make_samples([2 * s, 2 * s + 1])).shard_id
        for s in range(6)
    ]
    assert handed == expected  # committed in the order the shards were filled
    entries = [n.removesuffix(".json") for kind, n in events if kind == "start" and ".json" in n]
    assert entries == expected  # index entries put in that order ...
    at = {event: i for i, event in enumerate(events)}
    for shard_id in expected:  # ... each after its shard file is fully written
        assert at[("end", f"{shard_id}.safetensors")] < at[("start", f"{shard_id}.json")]
    in_flight = 0
    for kind, name in events:  # one commit at a time
        if name.endswith(".json"):
            in_flight += 1 if kind == "start" else -1
            assert in_flight <= 1
    overlapped = [
        s
        for k, s in zip(expected, expected[1:])
        if at[("start", f"{s}.safetensors")] < at[("end", f"{k}.json")]
    ]
    assert overlapped  # shard k+1 was uploading while shard k committed
    assert store.committed_keys() == {key_of(i) for i in range(12)}
    assert CacheStore(url, "ck", options).verify().orphans == []


KILLED_WRITER = textwrap.dedent(
    """
    import asyncio
    import sys
    from splitstage.tasks.cache.store import CacheStore
    from splitstage.tasks.stage1.preprocess import _write
    from splitstage.tasks.stage1.preprocess_report import ShardReport
    from tests.helpers.cache_writer import overlapped_run

    url, endpoint = sys.argv[1:3]
    store = CacheStore(url, "ck", {"client_kwargs": {"endpoint_url": endpoint}})
    real = store.fs._pipe_file

    async def slow_commits(path, data, **kw):  # the next shards upload while one commits
        if path.endswith(".json"):
            await asyncio.sleep(0.05)
        await real(path, data, **kw)

    store.fs._pipe_file = slow_commits
    report = ShardReport(0, 1)
    pipe, todo = overlapped_run(store, lambda prepared: _write(store, prepared, report), shards=8)
    pipe.run(todo)
    """
)


def test_fault_kill_after_n_commits_is_exact_with_uploads_ahead(s3_bucket, s3_endpoint):
    url, options = s3_bucket
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPLITSTAGE_FAULT_KILL_AFTER_SHARDS": "3"}
    started = time.perf_counter()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, url, s3_endpoint], env=env, timeout=120
    )
    assert killed.returncode == -9, time.perf_counter() - started
    store = CacheStore(url, "ck", options)
    assert store.committed_keys() == {key_of(i) for i in range(6)}  # the first 3 shards, exactly
    report = store.verify()
    assert report.ok  # every entry names a whole shard
    assert 1 <= len(report.orphans) <= 3  # uploaded ahead (<= 2 queued + 1), never committed
    store.write_shards([make_samples([i, i + 1]) for i in range(6, 16, 2)])  # the rerun's part
    store.refresh()
    assert store.committed_keys() == {key_of(i) for i in range(16)}
    assert store.verify().orphans == []
