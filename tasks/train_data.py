"""Stage 2 batch sources: the cache (split mode) or the raw data set (unsplit reference)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.data import load_sample
from splitstage.tasks.cache_reader import CacheDataset, epoch_order
from splitstage.tasks.cache_store import CacheStore
from splitstage.tasks.preprocess import collate_samples, index_data_set


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

    def __init__(self, config: SplitstageConfig, rank: int, world_size: int):
        self.config = config
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
            base, image_size = self.config.data.base_path, self.config.pipeline.image_size
            samples = [load_sample(self.rows[k], base, image_size) for k in keys]
            yield collate_samples(samples)
