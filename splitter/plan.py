"""The split plan: V1/V2 with reasons, boundary params, per-stage models and offload, hazards."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitstage.splitter.errors import UnknownModelError, did_you_mean
from splitstage.splitter.split import Reason, UnitSplit, split_units
from splitstage.splitter.units import Pipeline, Unit, parse_trainable

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
    """Refuse trainable models that no unit and no in-iteration model uses.

    A bare-string `onload_model_names` uses every substring of it, as DiffSynth-Studio's
    `model in onload_model_names` test does (the plan warns about it).
    """
    known = pipeline.model_names()
    for name in trainable:
        if name not in known and not any(
            isinstance(unit.onload_model_names, str) and name in unit.onload_model_names
            for unit in pipeline.units
        ):
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
    boundary, hazards, stage1, stage2 = _derive(pipeline, units, result, trainable)
    warnings: list[str] = []
    if any(unit.string_fields for unit in units):
        warnings += string_field_warnings(pipeline, trainable, result, boundary)
    warnings += hazards
    everything = sorted(pipeline.model_names())
    return SplitPlan(
        pipeline=pipeline.name,
        trainable=trainable,
        v1=tuple(units[i].name for i in result.v1),
        v2=tuple(units[i].name for i in result.v2),
        reasons={units[i].name: _reason_text(units[i], result.reasons[i]) for i in result.v1},
        boundary_params=tuple(boundary),
        boundary_sources=boundary,
        models={"stage1": stage1, "stage2": stage2},
        offload={
            "stage1": tuple(m for m in everything if m not in stage1),
            "stage2": tuple(m for m in everything if m not in stage2),
        },
        warnings=tuple(warnings),
        unit_order={unit.name: i for i, unit in enumerate(units)},
        unit_models={unit.name: unit.models for unit in units},
    )


def _derive(
    pipeline: Pipeline, units: Sequence[Unit], result: UnitSplit, trainable: tuple[str, ...]
) -> tuple[dict[str, str], list[str], tuple[str, ...], tuple[str, ...]]:
    """Boundary params (param -> producer), hazard warnings, and the models of each stage."""
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

    stage1 = _ordered_models(units[i].models for i in result.v2)
    stage2 = _ordered_models(
        [units[i].models for i in result.v1] + [pipeline.in_iteration_models, trainable]
    )
    return boundary, warnings, stage1, stage2


def _reason_text(unit: Unit, reason: Reason) -> str:
    text = reason.text()
    names = unit.onload_model_names
    if reason.kind == "model" and isinstance(names, str) and reason.model != names:
        text += (
            f" (a substring of its onload_model_names string '{names}', which "
            "DiffSynth-Studio's `in` test matches)"
        )
    return text


# Each comparison re-splits the pipeline: above this many bare-string fields, or this many
# units re-split in all, one combined comparison replaces the per-field ones.
MAX_FIELD_COMPARISONS = 32
MAX_COMPARED_UNITS = 1_000_000


def _quoted(names: Iterable[str], most: int = 12) -> str:
    names = list(names)
    shown = ", ".join(f"'{name}'" for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def string_field_warnings(
    pipeline: Pipeline,
    trainable: tuple[str, ...],
    result: UnitSplit,
    boundary: dict[str, str],
) -> list[str]:
    """One warning per bare-string unit field: how DiffSynth-Studio (and so this split) reads it,
    and what reading it as the one name it probably means would change, computed by re-splitting.
    """
    units = pipeline.units
    fields = [(i, f) for i, unit in enumerate(units) for f in unit.string_fields]
    compare_each = (
        len(fields) <= MAX_FIELD_COMPARISONS and len(fields) * len(units) <= MAX_COMPARED_UNITS
    )
    for_whom = f"for trainable {_quoted(trainable)}" if trainable else "with nothing trainable"
    known = sorted(pipeline.model_names())
    out = []
    for index, name in fields:
        unit = units[index]
        value = getattr(unit, name)
        text = (
            f"unit '{unit.name}': {name} is the bare string '{value}', not a list of names "
            "(a one-element tuple missing its comma?); "
        )
        if not value:
            out.append(text + "DiffSynth-Studio reads it as no names, and so does this split")
            continue
        if name == "onload_model_names":
            text += _substring_text(known, value, trainable)
        else:
            chars = _quoted(dict.fromkeys(value))
            verb = "reads" if name == "input_params" else "writes"
            text += (
                f"DiffSynth-Studio iterates its characters, so the unit {verb} {chars}, not "
                f"'{value}'"
            )
        text += "; this split does the same (DiffSynth-Studio parity). "
        if compare_each:
            alternative = list(units)
            alternative[index] = unit.as_intended((name,))
            change = _difference(pipeline, alternative, result, boundary, trainable)
            text += (
                f"Read as ('{value}',), {for_whom} it would: {change}"
                if change
                else f"Read as ('{value}',), the split and the cache {for_whom} are the same"
            )
        else:
            text += "See the combined warning for what reading each as one name would change"
        out.append(text)
    if not compare_each:
        alternative = [unit.as_intended() for unit in units]
        change = _difference(pipeline, alternative, result, boundary, trainable)
        out.append(
            f"{len(fields)} unit fields are bare strings; read each as one name, {for_whom} they "
            f"would: {change}"
            if change
            else f"{len(fields)} unit fields are bare strings; reading each as one name gives the "
            f"same split and cache {for_whom}"
        )
    return out


def _substring_text(known: Sequence[str], value: str, trainable: tuple[str, ...]) -> str:
    matched = [m for m in trainable if m in value and m != value]
    text = "DiffSynth-Studio tests `model in onload_model_names`, a substring test on a string: "
    if matched:
        text += (
            f"trainable {_quoted(matched)} matches as a substring of '{value}', so the unit "
            "uses a trainable model"
        )
    elif value in trainable:
        text += f"trainable '{value}' matches it whole, as the one-name reading would"
    else:
        text += "no trainable model is a substring of it"
    others = [m for m in known if m in value and m != value and m not in trainable]
    if others:
        text += f" (training {_quoted(others)} would match it too)"
    return text


def _difference(
    pipeline: Pipeline,
    alternative: Sequence[Unit],
    result: UnitSplit,
    boundary: dict[str, str],
    trainable: tuple[str, ...],
) -> str:
    """What splitting `alternative` instead would change ('; '-separated clauses), or ''."""
    other = split_units(alternative, trainable)
    other_boundary, _, _, _ = _derive(pipeline, alternative, other, trainable)
    names = [unit.name for unit in pipeline.units]
    now_v1, other_v1 = set(result.v1), set(other.v1)
    to_v1 = [names[i] for i in other.v1 if i not in now_v1]
    to_v2 = [names[i] for i in result.v1 if i not in other_v1]
    parts = []
    if to_v1:
        parts.append(f"make {_quoted(to_v1)} V1 (now V2, cached)")
    if to_v2:
        parts.append(f"make {_quoted(to_v2)} V2 (now V1)")
    added = [p for p in other_boundary if p not in boundary]
    if added:
        sources = ", ".join(f"'{p}' (from {_source(other_boundary[p])})" for p in added[:12])
        more = f" and {len(added) - 12} more" if len(added) > 12 else ""
        parts.append(f"cache {sources}{more}")
    dropped = [p for p in boundary if p not in other_boundary]
    if dropped:
        parts.append(f"stop caching {_quoted(dropped)}")
    moved = [p for p in boundary if p in other_boundary and other_boundary[p] != boundary[p]]
    for param in moved[:12]:
        parts.append(
            f"take '{param}' from {_source(other_boundary[param])} instead of "
            f"{_source(boundary[param])}"
        )
    return "; ".join(parts)


def _source(producer: str) -> str:
    return "the pipeline input" if producer == PIPELINE_INPUT else f"unit '{producer}'"


def _ordered_models(groups: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """Unique model names in first-use order."""
    names: dict[str, None] = {}
    for group in groups:
        for name in group:
            names.setdefault(name, None)
    return tuple(names)
