"""Pipeline-parallel stage assignment by module FQNs (torchtitan's module_fqns_per_model_part)."""

import pytest
from splitstage.splitter import (
    StageAssignmentError,
    assign_stages,
    layout_from_count,
    layout_from_fqns,
    validate_stages,
)

DIT = ["patch_embed", "time_embed", *[f"blocks.{i}" for i in range(8)], "norm", "proj_out"]


def flat(parts):
    return [fqn for part in parts for fqn in part]


def test_layout_finds_the_repeated_layers():
    layout = layout_from_fqns(DIT)
    assert layout.inputs == ("patch_embed", "time_embed")
    assert layout.layers[0] == "blocks.0" and layout.layers[-1] == "blocks.7"
    assert layout.outputs == ("norm", "proj_out")


def test_first_and_last_stage_get_fewer_layers():
    parts = assign_stages(layout_from_fqns(DIT), 3)
    assert parts == [
        ["patch_embed", "time_embed", "blocks.0", "blocks.1", "blocks.2"],
        ["blocks.3", "blocks.4", "blocks.5"],
        ["blocks.6", "blocks.7", "norm", "proj_out"],
    ]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 7, 10])
@pytest.mark.parametrize(("first", "last"), [(0, 0), (1, 1), (2, 0), (0, 1)])
def test_every_module_once_in_order(stages, first, last):
    layout = layout_from_count(8, "blocks", ["patch_embed"], ["norm", "proj_out"])
    if stages > 8 + first + last:
        with pytest.raises(StageAssignmentError, match="cannot be filled"):
            assign_stages(
                layout, stages, first_stage_less_layers=first, last_stage_less_layers=last
            )
        return
    try:
        parts = assign_stages(
            layout, stages, first_stage_less_layers=first, last_stage_less_layers=last
        )
    except StageAssignmentError as error:
        assert "fewer than zero layers" in str(error)
        return
    assert len(parts) == stages
    assert flat(parts) == list(layout.modules)
    assert validate_stages(parts, layout.modules) == parts


def test_layers_per_stage_derives_the_stage_count():
    layout = layout_from_count(6, "blocks", ["embed"], ["head"])
    parts = assign_stages(layout, None, layers_per_stage=2)  # 6 + 1 + 1 = 8 -> 4 stages
    assert len(parts) == 4
    assert parts[0] == ["embed", "blocks.0"]
    assert parts[-1] == ["blocks.5", "head"]
    assert assign_stages(layout, 2, layers_per_stage=2) == parts  # 4 virtual stages, 2 per rank
    with pytest.raises(StageAssignmentError, match="not a multiple of num_stages=3"):
        assign_stages(layout, 3, layers_per_stage=2)


def test_too_many_stages_is_refused():
    with pytest.raises(StageAssignmentError, match="use at most 4 stages"):
        assign_stages(layout_from_count(2), 5)


def test_empty_parts_are_allowed_in_user_lists():
    parts = [[], DIT[:5], [], DIT[5:]]
    assert validate_stages(parts, DIT) == parts


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([DIT[:3], DIT[2:]], "module 'blocks.0' is already in stage 0"),
        ([DIT[:3], DIT[4:]], "modules blocks.1 are in no stage"),
        ([DIT[3:], DIT[:3]], "comes before"),
        ([["patch_embd"], DIT[1:]], "Did you mean 'patch_embed'?"),
        (["patch_embed"], "stage 0: expected a list of module FQNs"),
    ],
)
def test_invalid_user_lists_are_explained(parts, message):
    with pytest.raises(StageAssignmentError, match=message):
        validate_stages(parts, DIT)


def test_module_list_without_layers_is_refused():
    with pytest.raises(StageAssignmentError, match="found no repeated layers"):
        layout_from_fqns(["embed", "head"])
    with pytest.raises(StageAssignmentError, match="listed twice"):
        layout_from_fqns(["embed", "blocks.0", "embed"])
