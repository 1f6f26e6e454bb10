"""Pipeline-parallel stage assignment by module FQNs (torchtitan's `module_fqns_per_model_part`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from splitstage.splitter.errors import StageAssignmentError, did_you_mean

_LAYER = re.compile(r"^(?P<prefix>.+)\.(?P<index>\d+)$")


@dataclass(frozen=True)
class ModuleLayout:
    """A model's top-level modules: those before the repeated layers, the layers, those after."""

    inputs: tuple[str, ...]
    layers: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module FQN in execution order."""
        return self.inputs + self.layers + self.outputs


def layout_from_fqns(fqns: Sequence[str]) -> ModuleLayout:
    """Find the repeated layers in an ordered FQN list: the longest region of block runs
    (`blocks.0 .. blocks.N-1`) that follow each other directly, e.g. FLUX's
    `transformer_blocks.*` then `single_transformer_blocks.*`, as one sequence of layers."""
    fqns = list(fqns)
    _check_unique(fqns, "module list")
    regions = _regions(_runs(fqns))
    if not regions:
        raise StageAssignmentError(
            "module list: found no repeated layers named '<prefix>.0', '<prefix>.1', ...; "
            "list the layers in order (e.g. blocks.0,blocks.1) or give the stages explicitly"
        )
    start, end = max(regions, key=lambda region: region[1] - region[0])  # the first longest
    return ModuleLayout(tuple(fqns[:start]), tuple(fqns[start:end]), tuple(fqns[end:]))


def _runs(fqns: Sequence[str]) -> list[tuple[int, int]]:
    """Every run `<prefix>.0, <prefix>.1, ...` in the list, as (start, end) positions in order."""
    runs: list[tuple[int, int]] = []
    start = 0
    while start < len(fqns):
        match = _LAYER.match(fqns[start])
        if not match or int(match["index"]) != 0:
            start += 1
            continue
        end = start + 1
        while end < len(fqns) and fqns[end] == f"{match['prefix']}.{end - start}":
            end += 1
        runs.append((start, end))
        start = end
    return runs


def _regions(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge runs that follow each other directly (no module between them) into one region."""
    regions: list[tuple[int, int]] = []
    for start, end in runs:
        if regions and regions[-1][1] == start:
            regions[-1] = (regions[-1][0], end)
        else:
            regions.append((start, end))
    return regions


def layout_from_count(
    num_layers: int,
    layer_prefix: str = "blocks",
    input_modules: Sequence[str] = (),
    output_modules: Sequence[str] = (),
) -> ModuleLayout:
    """Build a layout from a layer count, e.g. 28 x `blocks.N` between patch_embed and proj_out."""
    if num_layers < 1:
        raise StageAssignmentError(f"num_layers must be at least 1, got {num_layers}")
    layers = tuple(f"{layer_prefix}.{i}" for i in range(num_layers))
    return ModuleLayout(tuple(input_modules), layers, tuple(output_modules))


def assign_stages(
    layout: ModuleLayout,
    num_stages: int | None = None,
    *,
    layers_per_stage: int | None = None,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
) -> list[list[str]]:
    """Split the layout into per-stage FQN lists, lighter first/last stages for embed/head work.

    The first stage counts as `first_stage_less_layers` layers heavier (its input modules) and the
    last as `last_stage_less_layers` heavier (its output modules); virtual layers are then spread
    evenly, earlier stages taking the remainder. With `layers_per_stage`, the number of stages is
    derived and must be a multiple of `num_stages` (the pipeline degree) when both are given.
    As torchtitan's `generate_llm_fqn_per_model_part` does, more than one stage is refused when
    `first_stage_less_layers` or `last_stage_less_layers` exceeds the minimum layers per stage,
    (layers + first + last) // stages; equal is allowed (that stage may hold no layer).
    """
    if first_stage_less_layers < 0 or last_stage_less_layers < 0:
        raise StageAssignmentError(
            "first_stage_less_layers and last_stage_less_layers must be >= 0, got "
            f"{first_stage_less_layers} and {last_stage_less_layers}"
        )
    effective = len(layout.layers) + first_stage_less_layers + last_stage_less_layers
    if layers_per_stage is not None:
        if layers_per_stage < 1:
            raise StageAssignmentError(f"layers_per_stage must be >= 1, got {layers_per_stage}")
        derived = math.ceil(effective / layers_per_stage)
        if num_stages is not None and derived % num_stages:
            raise StageAssignmentError(
                f"layers_per_stage={layers_per_stage} gives {derived} stages for "
                f"{len(layout.layers)} layers (+{first_stage_less_layers} first, "
                f"+{last_stage_less_layers} last), not a multiple of num_stages={num_stages}; "
                "change layers_per_stage or num_stages"
            )
        num_stages = derived
    if num_stages is None or num_stages < 1:
        raise StageAssignmentError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > effective:
        raise StageAssignmentError(
            f"{num_stages} stages cannot be filled by {len(layout.layers)} layers "
            f"(+{first_stage_less_layers} first, +{last_stage_less_layers} last); use at most "
            f"{effective} stages"
        )
    if num_stages > 1:  # torchtitan gives a single stage everything, unchecked
        _check_less_layers(
            len(layout.layers),
            num_stages,
            first_stage_less_layers,
            last_stage_less_layers,
            layers_per_stage,
        )
    if layers_per_stage is not None:
        sizes = [layers_per_stage] * num_stages
        sizes[-1] = effective - layers_per_stage * (num_stages - 1)
    else:
        base, extra = divmod(effective, num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    sizes[0] -= first_stage_less_layers
    sizes[-1] -= last_stage_less_layers
    if min(sizes) < 0:
        raise StageAssignmentError(
            f"{num_stages} stages leave a stage with fewer than zero layers (sizes {sizes}); "
            "lower first_stage_less_layers/last_stage_less_layers or use fewer stages"
        )
    parts: list[list[str]] = []
    cursor = 0
    for i, size in enumerate(sizes):
        part = list(layout.inputs) if i == 0 else []
        part += layout.layers[cursor : cursor + size]
        cursor += size
        if i == num_stages - 1:
            part += layout.outputs
        parts.append(part)
    return parts


def _weights_fit(
    num_layers: int, num_stages: int, first: int, last: int, layers_per_stage: int | None
) -> bool:
    """torchtitan's balance check: neither stage weight above (layers+first+last) // stages."""
    effective = num_layers + first + last
    if layers_per_stage is not None:
        num_stages = math.ceil(effective / layers_per_stage)
    if num_stages <= 1:
        return True
    minimum = effective // num_stages
    return first <= minimum and last <= minimum


def _largest_fit(fits, start: int) -> int | None:
    """The largest value in [0, start] that `fits`, searching down (None if none, or too far)."""
    for value in range(start, max(-1, start - 10_000), -1):
        if fits(value):
            return value
    return None


def _check_less_layers(
    num_layers: int,
    num_stages: int,
    first: int,
    last: int,
    layers_per_stage: int | None = None,
) -> None:
    """Refuse what torchtitan's `generate_llm_fqn_per_model_part` refuses: a first or last stage
    weight (its `input_weight`, `output_weight`) above the minimum layers per stage,
    (layers + first + last) // stages, which leaves that stage little more than its embed/head."""
    minimum = (num_layers + first + last) // num_stages
    over = [
        (option, weight, value)
        for option, weight, value in (
            ("first_stage_less_layers", "input_weight", first),
            ("last_stage_less_layers", "output_weight", last),
        )
        if value > minimum
    ]
    if not over:
        return
    # The largest value(s) that pass, the other option unchanged (or both lowered together).
    if len(over) == 2:
        fix = _largest_fit(
            lambda b: _weights_fit(num_layers, num_stages, b, b, layers_per_stage),
            min(max(first, last) - 1, num_layers),
        )
    elif over[0][2] == first:
        fix = _largest_fit(
            lambda f: _weights_fit(num_layers, num_stages, f, last, layers_per_stage),
            min(first - 1, num_layers + last),
        )
    else:
        fix = _largest_fit(
            lambda b: _weights_fit(num_layers, num_stages, first, b, layers_per_stage),
            min(last - 1, num_layers + first),
        )
    fits = (num_layers + first + last) // max(value for _, _, value in over)
    said = " and ".join(f"{option}={value}" for option, _, value in over)
    torchtitan = " ".join(
        f"{weight} ({value}) exceeds minimum layers per stage ({minimum})."
        for _, weight, value in over
    )
    lower = " and ".join(option for option, _, _ in over)
    if fix is not None:
        lower += f" to at most {fix}"
    raise StageAssignmentError(
        f"{said} {'exceed' if len(over) > 1 else 'exceeds'} the minimum layers per stage "
        f"({minimum}) of {num_stages} stages over {num_layers} layers (+{first} first, "
        f"+{last} last), as torchtitan's generate_llm_fqn_per_model_part refuses: "
        f'"{torchtitan}" Lower {lower}, or use fewer stages (at most {fits}'
        f"{'; raise layers_per_stage' if layers_per_stage is not None else ''})"
    )


def validate_stages(parts: Sequence[Sequence[str]], modules: Sequence[str]) -> list[list[str]]:
    """Check user-given stages: every module exactly once, in model order; empty stages allowed."""
    if isinstance(parts, str) or not isinstance(parts, Sequence):
        raise StageAssignmentError("stages: expected a list of lists of module FQNs")
    order = {fqn: i for i, fqn in enumerate(modules)}
    seen: dict[str, int] = {}
    previous = -1
    for stage, part in enumerate(parts):
        if isinstance(part, str) or not isinstance(part, Sequence):
            raise StageAssignmentError(
                f"stage {stage}: expected a list of module FQNs, got {type(part).__name__} {part!r}"
            )
        for fqn in part:
            if not isinstance(fqn, str):
                raise StageAssignmentError(
                    f"stage {stage}: expected module FQNs as strings, got "
                    f"{type(fqn).__name__} {fqn!r}; give each stage as a flat list of FQNs"
                )
            if fqn not in order:
                raise StageAssignmentError(
                    f"stage {stage}: unknown module '{fqn}'.{did_you_mean(str(fqn), order)}"
                )
            if fqn in seen:
                raise StageAssignmentError(
                    f"stage {stage}: module '{fqn}' is already in stage {seen[fqn]}; "
                    "list each module in exactly one stage"
                )
            if order[fqn] < previous:
                raise StageAssignmentError(
                    f"stage {stage}: module '{fqn}' comes before '{modules[previous]}' in the "
                    "model; list modules in model order"
                )
            seen[fqn] = stage
            previous = order[fqn]
    missing = [fqn for fqn in modules if fqn not in seen]
    if missing:
        raise StageAssignmentError(
            f"stages: modules {', '.join(missing)} are in no stage; add each to one stage"
        )
    return [list(part) for part in parts]


def _check_unique(fqns: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for fqn in fqns:
        if not isinstance(fqn, str) or not fqn:
            raise StageAssignmentError(f"{what}: every FQN must be a non-empty string, got {fqn!r}")
        if fqn in seen:
            raise StageAssignmentError(f"{what}: module '{fqn}' is listed twice")
        seen.add(fqn)
