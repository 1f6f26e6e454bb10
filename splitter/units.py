"""Units and pipelines: DiffSynth-Studio's PipelineUnit fields plus `per_step`, validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitstage.splitter.errors import PipelineSpecError, did_you_mean

UNIT_FIELDS = (
    "name",
    "input_params",
    "input_params_posi",
    "input_params_nega",
    "output_params",
    "onload_model_names",
    "per_step",
)
PIPELINE_FIELDS = (
    "name",
    "units",
    "model_fn_params",
    "loss_params",
    "in_iteration_models",
    "step_params",
)


@dataclass(frozen=True)
class Unit:
    """One pipeline step: the params it reads and writes and the models it calls."""

    name: str
    input_params: tuple[str, ...] = ()
    input_params_posi: Mapping[str, str] = field(default_factory=dict)
    input_params_nega: Mapping[str, str] = field(default_factory=dict)
    output_params: tuple[str, ...] = ()
    onload_model_names: tuple[str, ...] = ()
    per_step: bool = False
    inputs: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        params = set(self.input_params)
        params.update(self.input_params_posi.values())
        params.update(self.input_params_nega.values())
        object.__setattr__(self, "inputs", tuple(sorted(params)))

    def fetch_input_params(self) -> list[str]:
        """All params read: `input_params` plus posi/nega values, sorted, unique (as DiffSynth)."""
        return list(self.inputs)

    def fetch_output_params(self) -> list[str]:
        """Params written, in declared order (as DiffSynth)."""
        return list(self.output_params)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record in the PIPELINE.json unit format."""
        return {
            "name": self.name,
            "input_params": list(self.input_params),
            "input_params_posi": dict(self.input_params_posi),
            "input_params_nega": dict(self.input_params_nega),
            "output_params": list(self.output_params),
            "onload_model_names": list(self.onload_model_names),
            "per_step": self.per_step,
        }


@dataclass(frozen=True)
class Pipeline:
    """An ordered list of units plus what the denoiser and the loss read."""

    name: str
    units: tuple[Unit, ...]
    model_fn_params: tuple[str, ...] = ()
    loss_params: tuple[str, ...] = ()
    in_iteration_models: tuple[str, ...] = ()
    # Made fresh by the training step (noise, timestep), so never cached.
    step_params: tuple[str, ...] = ()

    def __post_init__(self):
        seen: dict[str, int] = {}
        for index, unit in enumerate(self.units):
            if unit.name in seen:
                raise PipelineSpecError(
                    f"pipeline '{self.name}': unit name '{unit.name}' is used by units "
                    f"#{seen[unit.name]} and #{index}; give every unit a unique name"
                )
            seen[unit.name] = index

    def model_names(self) -> set[str]:
        """Every model a unit or the denoiser calls."""
        names = set(self.in_iteration_models)
        for unit in self.units:
            names.update(unit.onload_model_names)
        return names

    def unit(self, name: str) -> Unit:
        """The unit called `name`, or an error listing the closest name."""
        for unit in self.units:
            if unit.name == name:
                return unit
        names = [u.name for u in self.units]
        raise PipelineSpecError(
            f"pipeline '{self.name}' has no unit '{name}'.{did_you_mean(name, names)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record in the PIPELINE.json format."""
        return {
            "name": self.name,
            "units": [u.to_dict() for u in self.units],
            "model_fn_params": list(self.model_fn_params),
            "loss_params": list(self.loss_params),
            "in_iteration_models": list(self.in_iteration_models),
            "step_params": list(self.step_params),
        }


def _where(pipeline: str, unit: str | None, key: str) -> str:
    return (
        f"pipeline '{pipeline}', unit '{unit}', field '{key}'"
        if unit
        else (f"pipeline '{pipeline}', field '{key}'")
    )


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    """A list of non-empty strings; `None` means empty."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise PipelineSpecError(
            f"{where}: expected a list of names, got {type(value).__name__} {value!r}"
        )
    for item in value:
        if not isinstance(item, str) or not item:
            raise PipelineSpecError(
                f"{where}: every entry must be a non-empty string, got {item!r}"
            )
    return tuple(value)


def _str_map(value: Any, where: str) -> dict[str, str]:
    """A dict of unit argument -> pipeline param; `None` means empty."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PipelineSpecError(
            f"{where}: expected an object mapping unit argument -> pipeline param, "
            f"got {type(value).__name__} {value!r}"
        )
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str) or not item:
            raise PipelineSpecError(
                f"{where}: entry {key!r}: {item!r} must map a string argument to a non-empty "
                "param name"
            )
    return dict(value)


def unit_from_dict(record: Any, pipeline: str = "pipeline", index: int = 0) -> Unit:
    """Validate one unit record and build a Unit; errors name the unit and the field."""
    if not isinstance(record, Mapping):
        raise PipelineSpecError(
            f"pipeline '{pipeline}', unit #{index}: expected an object with fields "
            f"{', '.join(UNIT_FIELDS)}, got {type(record).__name__}"
        )
    name = record.get("name")
    if not isinstance(name, str) or not name:
        raise PipelineSpecError(
            f"pipeline '{pipeline}', unit #{index}: field 'name' must be a non-empty string, "
            f"got {name!r}"
        )
    for key in record:
        if key not in UNIT_FIELDS:
            raise PipelineSpecError(
                f"{_where(pipeline, name, key)}: unknown field."
                f"{did_you_mean(str(key), UNIT_FIELDS)}"
                f" Allowed fields: {', '.join(UNIT_FIELDS)}"
            )
    raw_inputs = record.get("input_params")
    if isinstance(raw_inputs, Mapping):  # argument -> param form: only the values are params
        inputs = tuple(_str_map(raw_inputs, _where(pipeline, name, "input_params")).values())
    else:
        inputs = _str_list(raw_inputs, _where(pipeline, name, "input_params"))
    per_step = record.get("per_step", False)
    if per_step is None:
        per_step = False
    if not isinstance(per_step, bool):
        raise PipelineSpecError(
            f"{_where(pipeline, name, 'per_step')}: expected true or false, got {per_step!r}"
        )
    return Unit(
        name=name,
        input_params=inputs,
        input_params_posi=_str_map(
            record.get("input_params_posi"), _where(pipeline, name, "input_params_posi")
        ),
        input_params_nega=_str_map(
            record.get("input_params_nega"), _where(pipeline, name, "input_params_nega")
        ),
        output_params=_str_list(
            record.get("output_params"), _where(pipeline, name, "output_params")
        ),
        onload_model_names=_str_list(
            record.get("onload_model_names"), _where(pipeline, name, "onload_model_names")
        ),
        per_step=per_step,
    )


def pipeline_from_dict(data: Any) -> Pipeline:
    """Validate a PIPELINE.json document and build a Pipeline."""
    if not isinstance(data, Mapping):
        raise PipelineSpecError(
            f"pipeline: expected a JSON object with fields {', '.join(PIPELINE_FIELDS)}, "
            f"got {type(data).__name__}"
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise PipelineSpecError(f"pipeline: field 'name' must be a non-empty string, got {name!r}")
    for key in data:
        if key not in PIPELINE_FIELDS:
            raise PipelineSpecError(
                f"{_where(name, None, key)}: unknown field."
                f"{did_you_mean(str(key), PIPELINE_FIELDS)}"
                f" Allowed fields: {', '.join(PIPELINE_FIELDS)}"
            )
    units = data.get("units")
    if units is None:
        units = []
    if not isinstance(units, list | tuple):
        raise PipelineSpecError(
            f"{_where(name, None, 'units')}: expected a list of unit objects, "
            f"got {type(units).__name__}"
        )
    return Pipeline(
        name=name,
        units=tuple(unit_from_dict(record, name, i) for i, record in enumerate(units)),
        model_fn_params=_str_list(
            data.get("model_fn_params"), _where(name, None, "model_fn_params")
        ),
        loss_params=_str_list(data.get("loss_params"), _where(name, None, "loss_params")),
        in_iteration_models=_str_list(
            data.get("in_iteration_models"), _where(name, None, "in_iteration_models")
        ),
        step_params=_str_list(data.get("step_params"), _where(name, None, "step_params")),
    )


def parse_trainable(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Turn 'a,b' or ['a', 'b'] into a tuple of unique model names; empty means nothing trains."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        item = item.strip()
        if item and item not in names:
            names.append(item)
    return tuple(names)
