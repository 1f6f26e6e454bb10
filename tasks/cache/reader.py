"""Stage-2 reader of the cache: per-epoch seeded order split over ranks, batches with prefetch.

Rank split: each epoch shuffles all keys with `(seed, epoch)`, DROPS the tail that does not divide
by `world_size` (different samples each epoch), and gives rank r every world_size-th key from r.
So all ranks get the same number of samples and no sample is on two ranks in one epoch.
"""

from __future__ import annotations

import copy
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from splitstage.pipelines.runtime import pad_sequences
from splitstage.tasks.cache.key_table import KeyTable
from splitstage.tasks.cache.store import CacheStore, SampleNotCachedError

_DONE = object()
_POLL_S = 0.1


class _Failure:
    """An exception raised in the prefetch thread, carried to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put into a bounded queue, giving up when the consumer stopped; True if it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def epoch_positions(
    count: int, epoch: int, seed: int, rank: int, world_size: int, offset: int = 0
) -> np.ndarray:
    """`epoch_order` as positions into the `count` sorted keys (the shuffle depends only on
    the count, so this is the order without the keys themselves)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if count < world_size:
        raise ValueError(
            f"{count} samples cannot be split over {world_size} ranks; use fewer ranks"
        )
    order = list(range(count))
    random.Random(f"splitstage-epoch:{seed}:{epoch}").shuffle(order)
    left = np.asarray(order[offset:], dtype=np.int64)
    usable = len(left) - len(left) % world_size
    return left[:usable][rank::world_size]


def epoch_order(
    keys: Iterable[str] | KeyTable,
    epoch: int,
    seed: int,
    rank: int,
    world_size: int,
    offset: int = 0,
) -> list[str]:
    """Rank `rank`'s keys for `epoch`: shuffle the sorted, de-duplicated keys with (seed, epoch),
    skip the first `offset` (consumed before a resume), drop the tail that does not divide by
    `world_size`, take every world_size-th key from rank.

    The ranks' first n keys together are exactly the next n * world_size keys of the epoch's
    order, so a resume with another world size or batch size continues exactly: every sample of
    the epoch is seen once (`offset` = samples consumed so far in the epoch, over all ranks)."""
    table = keys if isinstance(keys, KeyTable) else sorted(set(keys))
    positions = epoch_positions(len(table), epoch, seed, rank, world_size, offset)
    if isinstance(table, KeyTable):
        return table.decode(positions)
    return [table[i] for i in positions.tolist()]


def collate(
    samples: list[dict[str, Any]],
    keys: list[str],
    mode: str = "stack",
    sequences: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """Batch samples: tensors stacked (or concatenated on dim 0), JSON values as lists;
    `sequences` (the family's sequence params) padded to the batch's longest first."""
    params = list(samples[0])
    out: dict[str, Any] = {}
    for key, sample in zip(keys, samples):
        if set(sample) != set(params):
            diff = sorted(set(sample) ^ set(params))
            raise ValueError(
                f"sample {key!r} has different params from sample {keys[0]!r} (differ: {diff}); "
                f"one cache must hold the same params for every sample"
            )
    samples = pad_sequences(samples, sequences) if sequences and mode == "stack" else samples
    for param in params:
        values = [s[param] for s in samples]
        kinds = {isinstance(v, torch.Tensor) for v in values}
        if kinds == {False}:
            out[param] = [copy.deepcopy(v) for v in values]
            continue
        if kinds != {True}:
            raise ValueError(f"param {param!r} is a tensor in some samples and not in others")
        try:
            out[param] = torch.stack(values) if mode == "stack" else torch.cat(values)
        except RuntimeError:
            shapes = sorted({tuple(v.shape) for v in values})
            raise ValueError(
                f"cannot batch param {param!r}: samples have shapes {shapes}; use batch_size=1 "
                f"or make the unit that produces it emit one shape"
            ) from None
    return out


class CacheDataset:
    """Samples of a `CacheStore` for stage 2: `epoch_order` and prefetching `iterate`.

    `keys` defaults to every committed sample; their order does not matter (they are sorted, and
    duplicates dropped) so the same set gives the same epoch orders everywhere. They are held as
    a `KeyTable` (no str per sample); `groups` gives, aligned with them, each sample's group
    (identical param dtypes and shapes: an aspect bucket) and `group_labels` names each group.

    `collate="stack"` adds a batch dimension; `"cat"` concatenates on dim 0 (for DiffSynth-style
    values that already carry a batch dimension of 1). Verified shards are kept in an LRU of up
    to `shard_cache_bytes` so a shard is not fetched again for every batch that touches it.
    `stall_seconds` is how long the consumer of the last `iterate` waited for data.
    """

    def __init__(
        self,
        store: CacheStore,
        keys: Iterable[str] | KeyTable | None = None,
        *,
        collate: str = "stack",
        shard_cache_bytes: int = 256 * 2**20,
    ) -> None:
        if collate not in ("stack", "cat"):
            raise ValueError(f"collate must be 'stack' or 'cat', got {collate!r}")
        self.store = store
        self.keys = store.key_table() if keys is None else KeyTable.from_keys(keys)
        missing = store.missing(self.keys) if keys is not None else self.keys[:0]
        if len(missing):
            raise SampleNotCachedError(
                f"{len(missing)} of {len(self.keys)} sample keys are not in cache {store.url} "
                f"(e.g. {', '.join(missing[:3])}); run preprocess for them first"
            )
        self.groups, self.group_labels = store.groups_of(self.keys)
        self.collate = collate
        self.shard_cache_bytes = shard_cache_bytes
        self.stall_seconds = 0.0
        self.batches_yielded = 0
        self._shards: OrderedDict[str, tuple[dict[str, dict[str, Any]], int]] = OrderedDict()
        self._shards_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.keys)

    def epoch_order(
        self, epoch: int, seed: int, rank: int, world_size: int, offset: int = 0
    ) -> list[str]:
        """This rank's sample keys for `epoch` after `offset`: seeded shuffle, strided split."""
        return epoch_order(self.keys, epoch, seed, rank, world_size, offset)

    def batches(
        self,
        epoch: int,
        seed: int,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool = False,
        offset: int = 0,
    ) -> list[list[str]]:
        """This rank's batches of sample keys for `epoch` (same count on every rank)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = self.epoch_order(epoch, seed, rank, world_size, offset)
        out = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if drop_last and out and len(out[-1]) < batch_size:
            out.pop()
        return out

    def _fetch(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """Samples for `keys`: shards from the LRU, the rest in one batched, verified read."""
        owners = self.store.shard_of(keys)
        with self._lock:
            cached = {s: self._shards[s][0] for s in set(owners.values()) if s in self._shards}
            for s in cached:
                self._shards.move_to_end(s)
        todo = sorted(set(owners.values()) - set(cached))
        fresh = self.store.read_shards(todo) if todo else {}
        with self._lock:
            for shard_id, samples in fresh.items():
                self._remember(shard_id, samples)
        shards = {**cached, **fresh}
        return {k: shards[owners[k]][k] for k in keys}

    def _remember(self, shard_id: str, samples: dict[str, dict[str, Any]]) -> None:
        """Keep a parsed shard in the LRU, evicting the oldest past `shard_cache_bytes`."""
        size = sum(
            v.nbytes for s in samples.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        if size > self.shard_cache_bytes:
            return
        self._shards[shard_id] = (samples, size)
        self._shards_bytes += size
        while self._shards_bytes > self.shard_cache_bytes:
            _, (_, old) = self._shards.popitem(last=False)
            self._shards_bytes -= old

    def _produce(
        self, batches: list[list[str]], group: int, q: queue.Queue, stop: threading.Event
    ) -> None:
        """Prefetch thread: read groups of batches (each shard once per group), enqueue them."""
        try:
            for i in range(0, len(batches), group):
                chunk = batches[i : i + group]
                samples = self._fetch([k for b in chunk for k in b])
                for keys in chunk:
                    batch = collate(
                        [samples[k] for k in keys], keys, self.collate, self.store.sequence_params
                    )
                    if not _put(q, (keys, batch), stop):
                        return
            _put(q, _DONE, stop)
        except BaseException as exc:  # handed to the consumer, which raises it
            _put(q, _Failure(exc), stop)

    def iterate(
        self,
        epoch: int,
        seed: int,
        rank: int,
        world_size: int,
        batch_size: int,
        prefetch: int = 2,
        start_batch: int = 0,
        *,
        drop_last: bool = False,
        group_batches: int | None = None,
        with_keys: bool = False,
        offset: int = 0,
    ) -> Iterator[dict[str, Any]]:
        """Yield this rank's batches of `epoch` from `start_batch` on, prefetching in a thread.

        `prefetch` batches wait in a bounded queue (0: read in the caller, no thread); reads are
        grouped `group_batches` batches at a time (default max(1, prefetch)). Errors from the
        thread are raised here. `with_keys=True` yields `(sample_keys, batch)` pairs.
        """
        all_batches = self.batches(epoch, seed, rank, world_size, batch_size, drop_last, offset)
        if not 0 <= start_batch <= len(all_batches):
            raise ValueError(
                f"start_batch={start_batch} is outside the {len(all_batches)} batches of rank "
                f"{rank} in epoch {epoch}; was the checkpoint written with another batch_size "
                f"or world_size?"
            )
        todo = all_batches[start_batch:]
        group = group_batches or max(1, prefetch)
        self.stall_seconds = 0.0
        self.batches_yielded = 0
        if prefetch <= 0:
            return self._iterate_inline(todo, group, with_keys)
        return self._iterate_threaded(todo, group, prefetch, with_keys)

    def iterate_keys(
        self, batches: list[list[str]], prefetch: int = 2, *, with_keys: bool = False
    ) -> Iterator[dict[str, Any]]:
        """Yield the given batches of sample keys (a batch plan's), prefetching in a thread."""
        self.stall_seconds = 0.0
        self.batches_yielded = 0
        group = max(1, prefetch)
        if prefetch <= 0:
            return self._iterate_inline(batches, group, with_keys)
        return self._iterate_threaded(batches, group, prefetch, with_keys)

    def _iterate_inline(
        self, batches: list[list[str]], group: int, with_keys: bool
    ) -> Iterator[dict[str, Any]]:
        """No-thread iteration: the consumer waits for every read (all of it counts as stall)."""
        for i in range(0, len(batches), group):
            t0 = time.perf_counter()
            chunk = batches[i : i + group]
            samples = self._fetch([k for b in chunk for k in b])
            made = [
                (
                    keys,
                    collate(
                        [samples[k] for k in keys], keys, self.collate, self.store.sequence_params
                    ),
                )
                for keys in chunk
            ]
            self.stall_seconds += time.perf_counter() - t0
            for keys, batch in made:
                self.batches_yielded += 1
                yield (keys, batch) if with_keys else batch

    def _iterate_threaded(
        self, batches: list[list[str]], group: int, prefetch: int, with_keys: bool
    ) -> Iterator[dict[str, Any]]:
        """Consumer side of the prefetch thread; stops and joins the thread when it stops."""
        q: queue.Queue = queue.Queue(maxsize=prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._produce,
            args=(batches, group, q, stop),
            name="splitstage-prefetch",
            daemon=True,
        )
        self._thread = thread
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = self._get(q, thread)
                self.stall_seconds += time.perf_counter() - t0
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                self.batches_yielded += 1
                keys, batch = item
                yield (keys, batch) if with_keys else batch
        finally:
            stop.set()
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            thread.join(timeout=30)

    @staticmethod
    def _get(q: queue.Queue, thread: threading.Thread) -> Any:
        """Wait for the next item; fail loudly if the thread died without reporting."""
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                if not thread.is_alive() and q.empty():
                    raise RuntimeError("prefetch thread ended without a result") from None
