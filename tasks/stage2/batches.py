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

    def __init__(
        self,
        config: SplitstageConfig,
        store: CacheStore,
        rank: int,
        world_size: int,
        keys: list[str] | None = None,
    ):
        if keys is None:  # the samples of the last whole preprocess run
            manifest = store.read_manifest()
            keys = manifest.get("samples") if manifest else None
        self.dataset = CacheDataset(store, keys)
        self.config = config
        self.rank, self.world_size = rank, world_size

    def steps_per_epoch(self, offset: int = 0) -> int:
        """Full batches per rank in an epoch after `offset` samples (the same on every rank)."""
        per_rank = max(0, len(self.dataset) - offset) // self.world_size
        return per_rank // self.config.train.batch_size

    @property
    def stall_seconds(self) -> float:
        """Seconds the training loop waited for the cache."""
        return self.dataset.stall_seconds

    def iterate(self, epoch: int, offset: int = 0) -> Iterator[dict[str, Any]]:
        """This rank's batches of `epoch` after the first `offset` samples (all ranks')."""
        batches = self.dataset.iterate(
            epoch,
            self.config.job.seed,
            self.rank,
            self.world_size,
            self.config.train.batch_size,
            prefetch=self.config.train.prefetch,
            offset=offset,
        )
        for index, batch in enumerate(batches):
            if index >= self.steps_per_epoch(offset):
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

    def steps_per_epoch(self, offset: int = 0) -> int:
        """Full batches per rank in an epoch after `offset` samples (the same on every rank)."""
        per_rank = max(0, len(self.rows) - offset) // self.world_size
        return per_rank // self.config.train.batch_size

    def iterate(self, epoch: int, offset: int = 0) -> Iterator[dict[str, Any]]:
        """This rank's batches of `epoch` after `offset` samples, in the cache's order."""
        seed = self.config.job.seed
        order = epoch_order(list(self.rows), epoch, seed, self.rank, self.world_size, offset)
        size = self.config.train.batch_size
        for index in range(self.steps_per_epoch(offset)):
            keys = order[index * size : (index + 1) * size]
            base = self.config.data.base_path
            samples = [self.family.load_sample(self.rows[k], base) for k in keys]
            yield collate_samples(samples)
