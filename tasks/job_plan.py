"""The job plan: the pipeline family, its split for the trainable models, and the cache key."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from splitstage.pipelines import demo
from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.models import text_encoder_path
from splitstage.pipelines.runtime import RunnableUnit, select
from splitstage.splitter import Pipeline, SplitPlan, plan_split
from splitstage.tasks.fingerprint import cache_key, file_digest, stable_hash

CACHE_DTYPE = "float32"


@dataclass(frozen=True)
class JobPlan:
    """Everything both stages derive from the config, computed once."""

    config: SplitstageConfig
    pipeline: Pipeline
    units: tuple[RunnableUnit, ...]
    split: SplitPlan

    @property
    def v1_units(self) -> list[RunnableUnit]:
        """Units stage 2 runs every step."""
        return select(self.units, self.split.v1)

    @property
    def v2_units(self) -> list[RunnableUnit]:
        """Units stage 1 runs once per sample."""
        return select(self.units, self.split.v2)

    def model_fingerprint(self, name: str) -> str:
        """Content hash of a model's weights (or of its built-in source)."""
        source = demo.model_source(self.config, name)
        if source.weights:
            demo.require_weights_file(source.weights, f"models.{name}.weights")
            return file_digest(source.weights)
        if source.builder == "minilm":
            return file_digest(text_encoder_path() / "model.safetensors")
        return stable_hash({"builder": source.builder, "seed": self.config.job.seed})

    @cached_property
    def cache_key(self) -> str:
        """Content-addressed name of this job's stage-1 cache."""
        return cache_key(
            pipeline=self.pipeline.name,
            v2_units=[self.pipeline.unit(name).to_dict() for name in self.split.v2],
            boundary_params=list(self.split.boundary_params),
            model_fingerprints={m: self.model_fingerprint(m) for m in self.split.models["stage1"]},
            settings=demo.stage1_settings(self.config),
            dtype=CACHE_DTYPE,
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready plan for logs, artifacts and the cache manifest."""
        return {**self.split.to_dict(), "cache_key": self.cache_key}


def make_plan(config: SplitstageConfig) -> JobPlan:
    """Build the pipeline named by the config and split it for the trainable models."""
    units = tuple(demo.units())
    pipeline = demo.pipeline_spec()
    split = plan_split(pipeline, config.trainable.models())
    demo.check_models(config, list(config.models))
    return JobPlan(config=config, pipeline=pipeline, units=units, split=split)
