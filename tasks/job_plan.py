"""The job plan: the pipeline family, its split for the trainable models, and the cache key.

Naming the cache (`cache_key`) takes only the fingerprints; the cache room's store is imported
when a process opens the cache (`open_cache`, once per process through `JobPlan.cache`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.data.images import DECODE_VERSION
from splitstage.pipelines.family import Family, family_for
from splitstage.pipelines.runtime import RunnableUnit, select
from splitstage.splitter import Pipeline, SplitPlan, UnknownModelError, plan_split
from splitstage.storage import files as storage
from splitstage.storage.options import with_credentials
from splitstage.tasks.cache.fingerprint import cache_key, file_digest, stable_hash

if TYPE_CHECKING:
    from splitstage.tasks.cache.store import CacheStore

CACHE_DTYPE = "float32"


@dataclass(frozen=True)
class JobPlan:
    """Everything both stages derive from the config, computed once."""

    config: SplitstageConfig
    family: Family
    pipeline: Pipeline
    units: tuple[RunnableUnit, ...]
    split: SplitPlan

    @cached_property
    def cache(self) -> CacheStore:
        """This job's cache store, opened once per process (`open_cache`)."""
        return open_cache(self)

    def meta_model(self, name: str) -> Any:
        """Model `name` built once on the meta device (no weights): shapes and module names for
        every check that needs them, never a second build. Callers must not change it."""
        built = self.__dict__.setdefault("_meta_models", {})
        if name not in built:
            import torch  # the plan itself stays torch-free until a check needs a model

            built[name] = self.family.build_model(name, torch.device("meta"), meta=True)
        return built[name]

    @property
    def v1_units(self) -> list[RunnableUnit]:
        """Units stage 2 runs every step."""
        return select(self.units, self.split.v1)

    @property
    def v2_units(self) -> list[RunnableUnit]:
        """Units stage 1 runs once per sample."""
        return select(self.units, self.split.v2)

    def model_fingerprint(self, name: str) -> str:
        """Content hash of a model's weights file, or of the payload that identifies it."""
        source = self.family.fingerprint_source(name)
        if isinstance(source, str):
            return file_digest(source)
        if "files" in source:  # weights files by content (memoized), never by where they are
            source = {**source, "files": sorted(file_digest(path) for path in source["files"])}
        return stable_hash(source)

    @cached_property
    def cache_key(self) -> str:
        """Content-addressed name of this job's stage-1 cache."""
        bucket_settings = self.config.data.buckets.stage1_settings()
        buckets = {"buckets": bucket_settings} if bucket_settings else {}
        return cache_key(
            pipeline=self.pipeline.name,
            v2_units=[self.pipeline.unit(name).to_dict() for name in self.split.v2],
            boundary_params=list(self.split.boundary_params),
            model_fingerprints={m: self.model_fingerprint(m) for m in self.split.models["stage1"]},
            # How image files decode to pixels changes what stage 1 computes from the same bytes.
            settings={**self.family.stage1_settings(), "image_decode": DECODE_VERSION, **buckets},
            dtype=CACHE_DTYPE,
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready plan for logs, artifacts and the cache manifest."""
        return {**self.split.to_dict(), "cache_key": self.cache_key}


def make_plan(config: SplitstageConfig) -> JobPlan:
    """Build the pipeline family the config names and split it for the trainable models."""
    family = family_for(config)
    units = tuple(family.units())
    pipeline = family.pipeline_spec()
    try:
        split = plan_split(pipeline, config.trainable.models())
    except UnknownModelError as error:
        raise ConfigError(f"trainable: {error}; set trainable.full / lora_base_model") from None
    family.check_models(list(config.models))
    _ = family.buckets  # [data.buckets] must give buckets for the family: refused here if not
    return JobPlan(config=config, family=family, pipeline=pipeline, units=units, split=split)


def open_cache(plan: JobPlan, cache_key: str | None = None) -> CacheStore:
    """The cache store this job reads and writes (`cache_key` when already known)."""
    from splitstage.tasks.cache.store import CacheStore  # the cache room, once a cache is opened

    cache = plan.config.cache  # a credentials_block's secrets join the options in memory only
    options = with_credentials(
        cache.url, cache.storage_options, cache.credentials_block, field="cache.credentials_block"
    )
    store = CacheStore(cache.url, cache_key or plan.cache_key, options)
    if storage.is_local(store.fs) and (file := _file_in_the_way(os.path.dirname(store.root))):
        raise ConfigError(
            f"cache.url: {file} is a file, and the cache needs a folder there; point cache.url "
            "at a folder (created if missing) or a bucket"
        )
    store.image_sizes = image_sizes(plan.family)
    store.sequence_params = plan.family.sequence_params  # padded per batch, grouped as one
    return store


def _file_in_the_way(path: str) -> str | None:
    """`path` or its nearest existing ancestor, when that is not a folder."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path if path and not os.path.isdir(path) else None


def image_sizes(family: Family) -> list[tuple[int, int]] | None:
    """(height, width) pixels the family's images train at: its buckets, or its square."""
    if family.buckets is not None:
        return family.buckets.sizes
    resolution = family.image_resolution()
    return [(resolution[0], resolution[0])] if resolution else None
