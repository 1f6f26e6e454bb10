"""Units and pipelines: DiffSynth-Studio's PipelineUnit fields plus `per_step`, validated.

A name field (`input_params`, `output_params`, `onload_model_names`) may be a bare string, as
DiffSynth-Studio pipelines declare when a one-element tuple lost its comma (`("noise")`). Such a
string is kept as declared and read exactly as DiffSynth-Studio reads it: iterating it (to build
a unit's inputs and outputs) yields its characters, and `model in onload_model_names` (the
trainable-model test) is a substring test. The plan warns about every such field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from splitstage.splitter.errors import PipelineSpecError, did_you_mean

# Unit fields DiffSynth-Studio iterates or `in`-tests, so a bare string there has a meaning.
STRING_FIELDS = ("input_params", "output_params", "onload_model_names")
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
    """One pipeline step: the params it reads and writes and the models it calls.

    `input_params`, `output_params` and `onload_model_names` are tuples of names, or a bare string
    kept as declared and read as DiffSynth-Studio reads it (see the module docstring).
    """

    name: str
    input_params: tuple[str, ...] | str = ()
    input_params_posi: Mapping[str, str] = field(default_factory=dict)
    input_params_nega: Mapping[str, str] = field(default_factory=dict)
    output_params: tuple[str, ...] | str = ()
    onload_model_names: tuple[str, ...] | str = ()
    per_step: bool = False
    inputs: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # The STRING_FIELDS declared as a bare string (usually empty).
    string_fields: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        params = set(self.input_params)  # a bare string adds its characters, as DiffSynth's loop
        params.update(self.input_params_posi.values())
        params.update(self.input_params_nega.values())
        object.__setattr__(self, "inputs", tuple(sorted(params)))
        strings = ()
        if (
            isinstance(self.input_params, str)
            or isinstance(self.output_params, str)
            or isinstance(self.onload_model_names, str)
        ):
            strings = tuple(f for f in STRING_FIELDS if isinstance(getattr(self, f), str))
        object.__setattr__(self, "string_fields", strings)

    @property
    def models(self) -> tuple[str, ...]:
        """The models this unit calls; a bare-string `onload_model_names` names one model."""
        names = self.onload_model_names
        if isinstance(names, str):
            return (names,) if names else ()
        return names

    def uses_model(self, model: str) -> bool:
        """DiffSynth-Studio's trainable test `model in onload_model_names` (substring on a str)."""
        return model in self.onload_model_names

    def as_intended(self, fields: Iterable[str] | None = None) -> Unit:
        """This unit with bare-string `fields` (default: all) read as one name: "x" -> ("x",)."""
        fields = self.string_fields if fields is None else fields
        changes = {}
        for name in fields:
            value = getattr(self, name)
            if isinstance(value, str):
                changes[name] = (value,) if value else ()
        return replace(self, **changes) if changes else self

    def fetch_input_params(self) -> list[str]:
        """All params read: `input_params` plus posi/nega values, sorted, unique (as DiffSynth)."""
        return list(self.inputs)

    def fetch_output_params(self) -> list[str]:
        """Params written, in declared order (as DiffSynth)."""
        return list(self.output_params)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record in the PIPELINE.json unit format (a bare string stays a string)."""
        return {
            "name": self.name,
            "input_params": _names_out(self.input_params),
            "input_params_posi": dict(self.input_params_posi),
            "input_params_nega": dict(self.input_params_nega),
            "output_params": _names_out(self.output_params),
            "onload_model_names": _names_out(self.onload_model_names),
            "per_step": self.per_step,
        }


def _names_out(value: tuple[str, ...] | str) -> list[str] | str:
    return value if isinstance(value, str) else list(value)


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
            names.update(unit.models)
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


def _unit_names(value: Any, where: str) -> tuple[str, ...] | str:
    """A unit's name field: a list of names, or a bare string kept as declared (DiffSynth quirk)."""
    if isinstance(value, str):
        return value
    return _str_list(value, where)


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
        inputs = _unit_names(raw_inputs, _where(pipeline, name, "input_params"))
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
        output_params=_unit_names(
            record.get("output_params"), _where(pipeline, name, "output_params")
        ),
        onload_model_names=_unit_names(
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
