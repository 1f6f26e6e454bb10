"""Stage 1, overlapped: load on threads, V2 on the caller, encode and write in the background.

Loading (`load`: reading the bytes, decoding, resizing) runs on a small thread pool, at most
`prefetch` samples ahead; results are taken in `todo` order, so everything downstream depends on
that order alone, never on thread timing. The threads overlap storage reads and resizing (Pillow
releases the GIL) with V2; decoding is serialised per process (`data.images.open_image`'s lock:
Python's warnings filters are process-wide), so decoding in parallel takes worker processes.
Decoded samples are grouped by their shape signature
(`signature`): a group runs through V2 (`compute`, on the calling thread, where torch's no_grad
and device live) when it holds `batch_size` samples, when the groups together hold more than
`max_pending` samples (the largest goes first), and at the end (in the order the groups began).
Computed records fill shards of `shard_samples` in that order; full shards go, through a queue of
`max_shards` shards, to ONE writer thread (`write`: encode, hash, upload, commit), so shards are
committed one at a time, in order. With `prepare`, an encoder thread runs it on each shard first
(encode, hash, start the upload: `CacheStore.prepare_shard`), at most `ahead` prepared shards
ahead of the writer, which then only commits: shard k+1 is encoded and uploaded while shard k
commits, and the commits stay one at a time, in order (so a kill after N commits is exact).
Memory: the prefetch window, the pending groups, a shard being filled and `max_shards` + 1 shards
(+ up to `ahead` + 2 prepared ones, uploading).

Errors: a writer failure stops the run at the next batch and is raised on the caller; a
failure on the caller (an undecodable row without `skip_bad_rows`, a unit error) lets the writer
commit the shards already queued, then is raised; KeyboardInterrupt drops them (prepared ones go
to `discard`). Either way the decode pool and the writer's threads are stopped and joined before
the call returns.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from splitstage.data.dataset import DataError
from splitstage.process.switch_interval import shorter_switch_interval

Record = dict[str, Any]
_DONE = object()


def signature(sample: Record) -> tuple:
    """What samples sharing a V2 batch must agree on: (name, shape, dtype) of each tensor value,
    height and width, and the names of the other fields (collation needs the same fields)."""
    tensors = tuple(
        (name, tuple(value.shape), str(value.dtype))
        for name, value in sorted(sample.items())
        if isinstance(value, torch.Tensor)
    )
    others = tuple(sorted(name for name, v in sample.items() if not isinstance(v, torch.Tensor)))
    return tensors, sample.get("height"), sample.get("width"), others


@dataclass
class OverlappedRun:
    """The callables and bounds of one stage-1 run (see the module docstring)."""

    load: Callable[[Any], Record]  # row -> decoded sample (DataError when it cannot be decoded)
    compute: Callable[[list[Record]], list[Record]]  # samples of one signature -> their records
    write: Callable[[Any], None]  # one shard {key: record} (or what `prepare` made) -> committed
    batch_size: int
    shard_samples: int
    skip_bad_rows: bool = False
    on_skip: Callable[[str, DataError], None] | None = None  # an undecodable row, skipped
    on_done: Callable[[int], None] | None = None  # samples finished (computed or skipped)
    decode_threads: int = 2
    prefetch: int = 0  # decoded samples ahead of V2; 0: 2 x batch_size + decode_threads
    max_pending: int = 0  # decoded samples waiting in groups; 0: 4 x batch_size
    max_shards: int = 2  # full shards queued for the writer
    # shard -> what `write` takes, run on an encoder thread ahead of `write` (encode, start
    # the upload); `discard` gets those never written (after an error or an interrupt)
    prepare: Callable[[dict[str, Record]], Any] | None = None
    discard: Callable[[Any], None] | None = None
    ahead: int = 2  # prepared shards waiting for `write`
    # V2 releases and retakes the GIL around every torch op; with the default 5 ms switch
    # interval a decode or writer thread holding it stalls each op (measured: the overlapped
    # run slower than the serial loop). Lowered while the run lasts, then restored.
    switch_interval: float = 0.0005

    def run(self, todo: Sequence[tuple[Any, str]]) -> None:
        """Decode, compute and write every (row, key) of `todo`; see the module docstring."""
        with shorter_switch_interval(self.switch_interval):
            self._start(todo)

    def _start(self, todo: Sequence[tuple[Any, str]]) -> None:
        """Start the decode pool and the writer, run, and stop both whatever happens."""
        writer = _Writer(self.write, self.max_shards, self.prepare, self.discard, self.ahead)
        pool = ThreadPoolExecutor(
            max(1, self.decode_threads),
            thread_name_prefix="stage1-decode",
            initializer=torch.set_num_threads,  # per thread: decode ops are tiny, the pool is
            initargs=(1,),  # the parallelism; V2 keeps the caller's threads
        )
        try:
            self._run(todo, pool, writer)
        except Exception:
            pool.shutdown(wait=True, cancel_futures=True)
            writer.close(drain=True)  # commit what is queued: it is complete and correct
            raise
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            writer.close(drain=False)
            raise
        pool.shutdown(wait=True)
        writer.close(drain=True)
        writer.raise_error()

    def _run(self, todo: Sequence[tuple[Any, str]], pool: ThreadPoolExecutor, writer) -> None:
        """The caller's loop: take decoded samples in order, run groups, hand shards on."""
        groups: dict[tuple, list[tuple[str, Record]]] = {}
        shard: dict[str, Record] = {}
        pending = 0
        for key, sample in self._decoded(todo, pool):
            writer.raise_error()
            if sample is None:
                self._done(1)
                continue
            sig = signature(sample)
            groups.setdefault(sig, []).append((key, sample))
            pending += 1
            crowded = pending > self._max_pending()
            if len(groups[sig]) < self.batch_size and crowded:  # too much waiting: the largest
                sig = max(groups, key=lambda s: len(groups[s]))
            if len(groups[sig]) >= self.batch_size or crowded:
                pending -= len(groups[sig])
                self._compute(groups.pop(sig), shard, writer)
        for group in list(groups.values()):
            self._compute(group, shard, writer)
        if shard:
            writer.put(shard)

    def _decoded(self, todo, pool: ThreadPoolExecutor) -> Iterator[tuple[str, Record | None]]:
        """(key, sample) in `todo` order, decoding up to `prefetch` ahead; sample None for an
        undecodable row skipped under `skip_bad_rows` (other DataErrors are raised here)."""
        ahead = self.prefetch or 2 * self.batch_size + self.decode_threads
        window: deque[tuple[str, Future]] = deque()
        rows = iter(todo)
        for row, key in rows:
            window.append((key, pool.submit(self.load, row)))
            if len(window) >= ahead:
                break
        while window:
            key, future = window.popleft()
            for row, next_key in rows:  # keep the window full before waiting
                window.append((next_key, pool.submit(self.load, row)))
                break
            try:
                yield key, future.result()
            except DataError as exc:
                if not self.skip_bad_rows:
                    raise
                if self.on_skip:
                    self.on_skip(key, exc)
                yield key, None

    def _compute(self, group: list[tuple[str, Record]], shard: dict, writer: _Writer) -> None:
        """Run one group through V2, add its records to the shard, queue every full shard."""
        records = self.compute([sample for _, sample in group])
        for (key, _), record in zip(group, records, strict=True):
            shard[key] = record
            if len(shard) >= self.shard_samples:
                writer.put(dict(shard))
                shard.clear()
        self._done(len(group))

    def _done(self, count: int) -> None:
        if self.on_done:
            self.on_done(count)

    def _max_pending(self) -> int:
        return self.max_pending or 4 * self.batch_size


class _Stage:
    """ONE background thread calling `fn` on items in the order they were put; after a failure
    (or a cancel) it drops the items left, passing each to `drop`, until closed."""

    def __init__(self, name: str, fn: Callable, size: int, state: _State, drop=None) -> None:
        self._fn, self._drop, self._state = fn, drop, state
        self._queue: queue.Queue = queue.Queue(max(1, size))
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            cancelled = self._state.cancel.is_set()
            try:
                if not cancelled:
                    self._fn(item)
                elif self._drop is not None:
                    self._drop(item)
            except BaseException as exc:  # raised on the caller's thread; the loop goes on
                self._state.fail(exc)

    def put(self, item: Any) -> None:
        """Queue an item, waiting while the queue is full; raise the first error of any stage."""
        while True:
            self._state.raise_error()
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Stop the thread after the items queued (run, or dropped when cancelled)."""
        self._queue.put(_DONE)
        self._thread.join()


class _State:
    """What the writer's stages share: the first error, and the cancel it sets."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.cancel = threading.Event()
        self._lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc
        self.cancel.set()

    def raise_error(self) -> None:
        """Raise the exception a stage failed with first, if one did."""
        if self.error is not None:
            raise self.error


class _Writer:
    """The background writer: `write` on ONE thread, in the order shards were put; with
    `prepare`, each shard first goes through `prepare` on an encoder thread, at most `ahead`
    prepared shards waiting for `write` (those never written go to `discard`)."""

    def __init__(self, write, max_shards: int, prepare=None, discard=None, ahead: int = 2) -> None:
        self._state = _State()
        size = ahead if prepare else max_shards
        self._writer = _Stage("stage1-writer", write, size, self._state, discard)
        self._stages = [self._writer]
        self._entry = self._writer
        if prepare is not None:

            def encode(shard: dict[str, Record]) -> None:
                prepared = prepare(shard)
                try:
                    self._writer.put(prepared)
                except BaseException:
                    if discard is not None:
                        discard(prepared)
                    raise

            self._entry = _Stage("stage1-encode", encode, max_shards, self._state)
            self._stages.insert(0, self._entry)

    def put(self, shard: dict[str, Record]) -> None:
        """Queue a shard, waiting while the queue is full; raise the writer's error if it died."""
        self._entry.put(shard)

    def raise_error(self) -> None:
        """Raise the exception a write (or prepare) failed with, if one did."""
        self._state.raise_error()

    def close(self, drain: bool) -> None:
        """Stop the threads (after the queued shards when `drain`, else after the current one)."""
        if not drain:
            self._state.cancel.set()
        for stage in self._stages:  # the encoder first: what it prepares goes on to the writer
            stage.close()
