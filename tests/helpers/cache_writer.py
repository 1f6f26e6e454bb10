"""Stage 1's writer path on stand-in samples, shared by the cache-writer tests and their child."""

from __future__ import annotations

from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.stage1.overlap import OverlappedRun
from tests.helpers.cache_samples import key_of, make_samples


def overlapped_run(store: CacheStore, write, shards: int, per_shard: int = 2):
    """Stage 1's writer path with stand-in decode and V2, and its rows: `shards` shards of
    `per_shard` samples (shard s holds samples per_shard * s, ...)."""
    return OverlappedRun(
        load=lambda i: make_samples([i])[key_of(i)],
        compute=lambda samples: samples,
        prepare=store.prepare_shard,
        write=write,
        discard=lambda prepared: prepared.discard(),
        batch_size=per_shard,
        shard_samples=per_shard,
        decode_threads=1,
    ), [(i, key_of(i)) for i in range(shards * per_shard)]
