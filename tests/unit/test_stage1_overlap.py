"""The overlapped stage-1 run with stand-in load/compute/write: order, grouping, errors."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch

from splitstage.data.dataset import DataError
from splitstage.tasks.stage1.overlap import OverlappedRun, signature


def sample(index: int) -> dict:
    """Row `index` decodes to a 4x4 image when even, 2x6 when odd."""
    h, w = (4, 4) if index % 2 == 0 else (2, 6)
    return {
        "image": torch.full((3, h, w), float(index)),
        "prompt": f"p{index}",
        "height": h,
        "width": w,
    }


def rows(n: int) -> list[tuple[int, str]]:
    return [(i, f"{i:04d}") for i in range(n)]


class Recorder:
    """Stand-ins that record what the run did."""

    def __init__(self, jitter: float = 0.0, bad: set[int] = frozenset(), fail_shard: int = 0):
        self.jitter, self.bad, self.fail_shard = jitter, bad, fail_shard
        self.batches: list[list[tuple]] = []
        self.shards: list[list[str]] = []
        self.loaded = 0
        self.lock = threading.Lock()

    def load(self, index: int) -> dict:
        if self.jitter:
            time.sleep(random.random() * self.jitter)
        with self.lock:
            self.loaded += 1
        if index in self.bad:
            raise DataError(f"metadata.csv row {index + 2}: cannot decode image")
        return sample(index)

    def compute(self, samples: list[dict]) -> list[dict]:
        batch = torch.stack([s["image"] for s in samples])  # fails unless one shape
        self.batches.append([signature(s) for s in samples])
        return [
            {"latents": image.mean(0), "prompt": s["prompt"]} for image, s in zip(batch, samples)
        ]

    def write(self, shard: dict) -> None:
        if self.fail_shard and len(self.shards) + 1 == self.fail_shard:
            raise OSError("the endpoint went away")
        self.shards.append(list(shard))

    def overlapped(self, **kw) -> OverlappedRun:
        kw = {"batch_size": 4, "shard_samples": 6, "decode_threads": 3, **kw}
        return OverlappedRun(load=self.load, compute=self.compute, write=self.write, **kw)


def stage1_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stage1-")]


def test_batches_hold_one_shape_and_every_partial_group_runs_at_the_end():
    rec = Recorder()
    done = []
    rec.overlapped(on_done=done.append).run(rows(11))
    assert all(len(set(batch)) == 1 for batch in rec.batches)
    assert [len(b) for b in rec.batches] == [4, 4, 2, 1]  # 6 even rows, 5 odd: full, then tails
    written = [k for shard in rec.shards for k in shard]
    assert sorted(written) == [k for _, k in rows(11)] and len(written) == 11
    assert [len(s) for s in rec.shards] == [6, 5]
    assert sum(done) == 11
    assert not stage1_threads()


def test_shards_depend_on_the_todo_order_only_not_on_thread_timing():
    reference = Recorder()
    reference.overlapped(decode_threads=1).run(rows(40))
    for seed in range(3):
        random.seed(seed)
        jittery = Recorder(jitter=0.003)
        jittery.overlapped(decode_threads=4).run(rows(40))
        assert jittery.shards == reference.shards
        assert jittery.batches == reference.batches


def test_too_many_waiting_samples_run_the_largest_group_first():
    rec = Recorder()
    rec.overlapped(batch_size=8, max_pending=5).run(rows(12))
    assert [len(b) for b in rec.batches] == [3, 4, 3, 2]  # 6 waiting > 5: the largest (first) goes
    assert sum(len(b) for b in rec.batches) == 12


def test_bad_row_raises_naming_it_after_committing_the_queued_shards():
    rec = Recorder(bad={30})
    interval = sys.getswitchinterval()
    with pytest.raises(DataError, match="row 32"):
        rec.overlapped().run(rows(200))
    assert sys.getswitchinterval() == interval  # lowered while running, restored
    assert rec.shards and all(len(s) == 6 for s in rec.shards)  # full shards before the error
    assert rec.loaded < 60  # stopped promptly: decoding ran a window ahead, no more
    assert not stage1_threads()


def test_bad_rows_are_skipped_and_reported_with_skip_bad_rows():
    rec = Recorder(bad={3, 8})
    skipped, done = [], []
    rec.overlapped(
        skip_bad_rows=True, on_skip=lambda k, e: skipped.append(k), on_done=done.append
    ).run(rows(12))
    assert skipped == ["0003", "0008"]
    assert sorted(k for s in rec.shards for k in s) == [k for i, k in rows(12) if i not in (3, 8)]
    assert sum(done) == 12


def test_a_failed_write_stops_the_run_and_is_raised_on_the_caller():
    rec = Recorder(fail_shard=2)
    with pytest.raises(OSError, match="endpoint went away"):
        rec.overlapped().run(rows(400))
    assert len(rec.shards) == 1
    assert rec.loaded < 100
    assert not stage1_threads()


def test_interrupt_drops_queued_shards_and_stops_the_threads():
    rec = Recorder()
    calls = []

    def compute(samples):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return rec.compute(samples)

    pipe = rec.overlapped()
    pipe.compute = compute
    with pytest.raises(KeyboardInterrupt):
        pipe.run(rows(100))
    assert not stage1_threads()


def test_memory_stays_bounded_by_the_window_and_the_queue():
    rec = Recorder()
    in_flight, peak = [0], [0]
    computed = []

    def load(index):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0] - len(computed))
        return rec.load(index)

    def slow_write(shard):
        time.sleep(0.01)
        rec.write(shard)

    def compute(samples):
        computed.extend(samples)
        return rec.compute(samples)

    pipe = rec.overlapped(decode_threads=2, prefetch=6)
    pipe.load, pipe.write, pipe.compute = load, slow_write, compute
    pipe.run(rows(120))
    assert len(rec.shards) == 20
    assert peak[0] <= 6 + 4 * 4 + 2  # prefetch window + pending groups (+ threads' work)
