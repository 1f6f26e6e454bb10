"""Stage 1's writer with `prepare` (an encoder thread ahead of the committing writer), with
stand-ins: writes keep the shard order, and every prepared shard is written or discarded."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.stage1.overlap import OverlappedRun
from splitstage.tasks.stage1.preprocess import _write
from splitstage.tasks.stage1.preprocess_report import ShardReport


class Ahead:
    """prepare/write/discard stand-ins that record what happened to each shard."""

    def __init__(self, fail_at: int = 0, interrupt_at: int = 0) -> None:
        self.fail_at, self.interrupt_at = fail_at, interrupt_at
        self.prepared: list[int] = []
        self.written: list[int] = []
        self.discarded: list[int] = []
        self.threads: set[str] = set()

    def prepare(self, shard: dict) -> int:
        self.threads.add(threading.current_thread().name)
        number = len(self.prepared)
        self.prepared.append(number)
        assert sorted(shard) == [f"{i:04d}" for i in range(3 * number, 3 * number + 3)]
        return number

    def write(self, number: int) -> None:
        time.sleep(0.002)  # a commit takes a while: the encoder runs ahead meanwhile
        if number + 1 == self.fail_at:
            raise OSError("the endpoint went away")
        if number + 1 == self.interrupt_at:
            raise KeyboardInterrupt
        self.written.append(number)

    def overlapped(self, **kw) -> OverlappedRun:
        return OverlappedRun(
            load=lambda i: {"x": torch.full((2,), float(i))},
            compute=lambda samples: samples,
            prepare=self.prepare,
            write=self.write,
            discard=self.discarded.append,
            batch_size=3,
            shard_samples=3,
            decode_threads=1,
            **kw,
        )


def rows(n: int) -> list[tuple[int, str]]:
    return [(i, f"{i:04d}") for i in range(n)]


def stage1_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stage1-")]


def test_prepared_shards_are_written_in_order_after_preparing_on_the_encoder():
    rec = Ahead()
    rec.overlapped().run(rows(30))
    assert rec.written == list(range(10)) and rec.discarded == []
    assert rec.threads == {"stage1-encode"}
    assert not stage1_threads()


@pytest.mark.parametrize("how", ["fail", "interrupt"])
def test_prepared_shards_never_written_are_discarded(how):
    rec = Ahead(**{f"{how}_at": 3})
    with pytest.raises(OSError if how == "fail" else KeyboardInterrupt):
        rec.overlapped(ahead=3).run(rows(300))
    assert rec.written == [0, 1]  # nothing after the failed one
    assert len(rec.prepared) < 15  # stopped promptly: at most `ahead` (+ the encoder's) beyond
    assert sorted(rec.written + rec.discarded) == [n for n in rec.prepared if n != 2]
    assert not stage1_threads()


def test_stage1_write_commits_a_prepared_shard_and_counts_it(tmp_path):
    store = CacheStore(str(tmp_path), "ck")
    report = ShardReport(0, 1)
    prepared = store.prepare_shard({"00ab": {"x": torch.ones(2)}})
    assert prepared.data is not None and not (tmp_path / "ck").exists()  # local: at the commit
    _write(store, prepared, report)
    assert store.committed_keys() == {"00ab"}
    assert (report.shards_written, report.bytes_written) == (1, prepared.info.nbytes)
