"""Read a DiffSynth-Studio pipeline object into a splitter Pipeline by duck typing.

diffsynth is never imported: installing it replaces a CPU torch with a CUDA build. Any object with
`.units` (each carrying PipelineUnit's declared fields) works, plus optional `in_iteration_models`
and `model_fn`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from splitstage.splitter import Pipeline, PipelineSpecError, unit_from_dict

# What DiffSynth's FlowMatchSFTLoss reads from the inputs, and what it makes fresh each step.
DEFAULT_LOSS_PARAMS = ("input_latents",)
DEFAULT_STEP_PARAMS = ("timestep", "noise", "latents")


def _field(unit: Any, name: str):
    value = getattr(unit, name, None)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return list(value)
    return value


def unit_names(units: Iterable[Any]) -> list[str]:
    """Class names, with `#2`, `#3` appended when a class appears more than once."""
    names: list[str] = []
    counts: dict[str, int] = {}
    for unit in units:
        base = type(unit).__name__
        counts[base] = counts.get(base, 0) + 1
        names.append(base if counts[base] == 1 else f"{base}#{counts[base]}")
    return names


def model_fn_params(model_fn: Any, model_names: Iterable[str]) -> tuple[str, ...]:
    """Named parameters of `model_fn` that are pipeline params (models and **kwargs excluded)."""
    if model_fn is None:
        return ()
    try:
        signature = inspect.signature(model_fn)
    except (TypeError, ValueError):
        return ()
    skip = set(model_names)
    return tuple(
        name
        for name, param in signature.parameters.items()
        if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and name not in skip
    )


def pipeline_from_diffsynth(
    pipe: Any,
    name: str | None = None,
    loss_params: Iterable[str] = DEFAULT_LOSS_PARAMS,
    step_params: Iterable[str] = DEFAULT_STEP_PARAMS,
) -> Pipeline:
    """Build a splitter Pipeline from a DiffSynth pipeline object (`.units`, `.model_fn`)."""
    units = getattr(pipe, "units", None)
    if units is None or isinstance(units, str | bytes) or not isinstance(units, Iterable):
        raise PipelineSpecError(
            f"{type(pipe).__name__} has no `units` list: pass a DiffSynth pipeline object "
            "(e.g. QwenImagePipeline) whose `.units` are PipelineUnit instances"
        )
    units = list(units)
    pipeline_name = name or type(pipe).__name__
    records = []
    for index, (unit, unit_name) in enumerate(zip(units, unit_names(units))):
        records.append(
            unit_from_dict(
                {
                    "name": unit_name,
                    "input_params": _field(unit, "input_params"),
                    "input_params_posi": _field(unit, "input_params_posi"),
                    "input_params_nega": _field(unit, "input_params_nega"),
                    "output_params": _field(unit, "output_params"),
                    "onload_model_names": _field(unit, "onload_model_names"),
                    "per_step": bool(getattr(unit, "per_step", False)),
                },
                pipeline_name,
                index,
            )
        )
    in_iteration = tuple(getattr(pipe, "in_iteration_models", None) or ())
    known = set(in_iteration)
    for record in records:
        known.update(record.models)
    return Pipeline(
        name=pipeline_name,
        units=tuple(records),
        model_fn_params=model_fn_params(getattr(pipe, "model_fn", None), known),
        loss_params=tuple(loss_params),
        in_iteration_models=in_iteration,
        step_params=tuple(step_params),
    )
