"""Stage 2 batch sources: the cache (split mode) or the raw data set (unsplit reference)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.family import Family
from splitstage.pipelines.runtime import collate_samples
from splitstage.tasks.cache.reader import CacheDataset, epoch_order
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.data_index import index_data_set


class CachedBatches:
    """Batches of boundary params read from the stage-1 cache with background prefetch."""

    def __init__(self, config: SplitstageConfig, store: CacheStore, rank: int, world_size: int):
        manifest = store.read_manifest()
        keys = manifest["samples"] if manifest else None
        self.dataset = CacheDataset(store, keys)
        self.config = config
        self.rank, self.world_size = rank, world_size

    def steps_per_epoch(self) -> int:
        """Full batches per epoch on each rank (the same on every rank)."""
        per_rank = len(self.dataset) // self.world_size
        return per_rank // self.config.train.batch_size

    @property
    def stall_seconds(self) -> float:
        """Seconds the training loop waited for the cache."""
        return self.dataset.stall_seconds

    def iterate(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, Any]]:
        """This rank's batches of `epoch` from `start_batch` on."""
        batches = self.dataset.iterate(
            epoch,
            self.config.job.seed,
            self.rank,
            self.world_size,
            self.config.train.batch_size,
            prefetch=self.config.train.prefetch,
            start_batch=start_batch,
        )
        for index, batch in enumerate(batches, start=start_batch):
            if index >= self.steps_per_epoch():
                break
            yield batch


class RawBatches:
    """Batches decoded from the data set every step: what training without a cache reads."""

    def __init__(self, config: SplitstageConfig, family: Family, rank: int, world_size: int):
        self.config = config
        self.family = family
        self.rank, self.world_size = rank, world_size
        data = index_data_set(config)
        self.rows = dict(zip(data.keys, data.rows))
        self.stall_seconds = 0.0

    def steps_per_epoch(self) -> int:
        """Full batches per epoch on each rank (the same on every rank)."""
        return len(self.rows) // self.world_size // self.config.train.batch_size

    def iterate(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, Any]]:
        """This rank's batches of `epoch`, in the same order the cache would give."""
        seed = self.config.job.seed
        order = epoch_order(list(self.rows), epoch, seed, self.rank, self.world_size)
        size = self.config.train.batch_size
        for index in range(start_batch, self.steps_per_epoch()):
            keys = order[index * size : (index + 1) * size]
            base = self.config.data.base_path
            samples = [self.family.load_sample(self.rows[k], base) for k in keys]
            yield collate_samples(samples)
