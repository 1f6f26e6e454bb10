"""The split plan: V1/V2 with reasons, boundary params, per-stage models and offload, hazards."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from splitstage.splitter.errors import UnknownModelError, did_you_mean
from splitstage.splitter.split import split_units
from splitstage.splitter.units import Pipeline, parse_trainable

PIPELINE_INPUT = "pipeline input"


@dataclass(frozen=True)
class SplitPlan:
    """Everything stage 1 and stage 2 need to know, computed from the units alone."""

    pipeline: str
    trainable: tuple[str, ...]
    v1: tuple[str, ...]
    v2: tuple[str, ...]
    reasons: dict[str, str]
    boundary_params: tuple[str, ...]
    boundary_sources: dict[str, str]
    models: dict[str, tuple[str, ...]]
    offload: dict[str, tuple[str, ...]]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    unit_order: dict[str, int] = field(default_factory=dict)
    unit_models: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The `splitstage plan --format json` object (stable contract: add keys, never rename)."""
        return {
            "pipeline": self.pipeline,
            "trainable": list(self.trainable),
            "v1": list(self.v1),
            "v2": list(self.v2),
            "reasons": dict(self.reasons),
            "boundary_params": list(self.boundary_params),
            "boundary_sources": dict(self.boundary_sources),
            "models": {stage: list(names) for stage, names in self.models.items()},
            "offload": {stage: list(names) for stage, names in self.offload.items()},
            "warnings": list(self.warnings),
        }


def check_trainable(pipeline: Pipeline, trainable: Iterable[str]) -> None:
    """Refuse trainable models that no unit and no in-iteration model uses."""
    known = pipeline.model_names()
    for name in trainable:
        if name not in known:
            listed = ", ".join(sorted(known)) or "(none)"
            raise UnknownModelError(
                f"trainable model '{name}' is used by no unit and no in-iteration model of "
                f"pipeline '{pipeline.name}'.{did_you_mean(name, known)} Known models: {listed}"
            )


def plan_split(pipeline: Pipeline, trainable: str | Iterable[str] | None) -> SplitPlan:
    """Split `pipeline` for the trainable models and derive boundary params and offload plans."""
    trainable = parse_trainable(trainable if isinstance(trainable, str) else list(trainable or []))
    check_trainable(pipeline, trainable)
    units = pipeline.units
    result = split_units(units, trainable)
    v1_set = set(result.v1)
    graph = result.graph

    # Stage 2 replays V1 in order: a param read before any V1 unit wrote it must come from stage 1.
    boundary: dict[str, str] = {}
    written_in_stage2: set[str] = set()
    last_v2_producer: dict[str, int] = {}
    for index in result.v2:
        for param in graph.outputs[index]:
            last_v2_producer[param] = index

    def need(param: str) -> None:
        if param in written_in_stage2 or param in boundary:
            return
        producer = last_v2_producer.get(param)
        boundary[param] = units[producer].name if producer is not None else PIPELINE_INPUT

    warnings: list[str] = []
    latest: dict[str, int] = {}  # most recent producer of each param in full pipeline order
    for index, unit in enumerate(units):
        if index in v1_set:
            for param in graph.inputs[index]:
                if param in written_in_stage2:
                    continue
                need(param)
                producer = last_v2_producer.get(param)
                if producer is not None and producer > index:
                    seen = latest.get(param)
                    origin = f"from unit '{units[seen].name}'" if seen is not None else "as input"
                    warnings.append(
                        f"V1 unit '{unit.name}' reads '{param}' {origin}, but V2 "
                        f"unit '{units[producer].name}' rewrites it later, so stage 2 sees that "
                        f"later value (DiffSynth-Studio behaves the same); mark "
                        f"'{units[producer].name}' per_step or write a new param name"
                    )
            written_in_stage2.update(graph.outputs[index])
        for param in graph.outputs[index]:
            latest[param] = index
    for param in (*pipeline.model_fn_params, *pipeline.loss_params):
        if param not in pipeline.step_params:
            need(param)

    stage1 = _ordered_models(units[i].onload_model_names for i in result.v2)
    stage2 = _ordered_models(
        [units[i].onload_model_names for i in result.v1] + [pipeline.in_iteration_models, trainable]
    )
    everything = sorted(pipeline.model_names())
    return SplitPlan(
        pipeline=pipeline.name,
        trainable=trainable,
        v1=tuple(units[i].name for i in result.v1),
        v2=tuple(units[i].name for i in result.v2),
        reasons={units[i].name: result.reasons[i].text() for i in result.v1},
        boundary_params=tuple(boundary),
        boundary_sources=boundary,
        models={"stage1": stage1, "stage2": stage2},
        offload={
            "stage1": tuple(m for m in everything if m not in stage1),
            "stage2": tuple(m for m in everything if m not in stage2),
        },
        warnings=tuple(warnings),
        unit_order={unit.name: i for i, unit in enumerate(units)},
        unit_models={unit.name: unit.onload_model_names for unit in units},
    )


def _ordered_models(groups: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """Unique model names in first-use order."""
    names: dict[str, None] = {}
    for group in groups:
        for name in group:
            names.setdefault(name, None)
    return tuple(names)
