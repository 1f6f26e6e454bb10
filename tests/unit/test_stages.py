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
    if stages > 1 and max(first, last) > (8 + first + last) // stages:  # torchtitan's refusal
        with pytest.raises(StageAssignmentError, match="exceeds the minimum layers per stage"):
            assign_stages(
                layout, stages, first_stage_less_layers=first, last_stage_less_layers=last
            )
        return
    parts = assign_stages(
        layout, stages, first_stage_less_layers=first, last_stage_less_layers=last
    )
    assert len(parts) == stages
    assert flat(parts) == list(layout.modules)
    assert validate_stages(parts, layout.modules) == parts


def torchtitan_generate(num_stages, num_layers, input_weight, output_weight):
    """torchtitan's generate_llm_fqn_per_model_part, transcribed (ValueError where it raises)."""
    if num_stages == 1:
        return [["tok_embeddings", *[f"layers.{i}" for i in range(num_layers)], "norm", "output"]]
    effective = num_layers + input_weight + output_weight
    if num_stages > effective:
        raise ValueError(f"Number of stages ({num_stages}) cannot be greater than effective layers")
    per_stage, extra = divmod(effective, num_stages)
    if input_weight > per_stage:
        raise ValueError(
            f"input_weight ({input_weight}) exceeds minimum layers per stage ({per_stage})."
        )
    if output_weight > per_stage:
        raise ValueError(
            f"output_weight ({output_weight}) exceeds minimum layers per stage ({per_stage})."
        )
    parts, layer = [], 0
    for stage in range(num_stages):
        size = per_stage + (1 if stage < extra else 0)
        size -= input_weight if stage == 0 else output_weight if stage == num_stages - 1 else 0
        part = ["tok_embeddings"] if stage == 0 else []
        for _ in range(size):
            if layer < num_layers:
                part.append(f"layers.{layer}")
                layer += 1
        parts.append(part + (["norm", "output"] if stage == num_stages - 1 else []))
    return parts


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("layers", [1, 2, 4, 6])
@pytest.mark.parametrize(("first", "last"), [(0, 0), (1, 1), (2, 1), (1, 2), (3, 0), (2, 3)])
def test_refuses_and_assigns_exactly_like_torchtitan(stages, layers, first, last):
    layout = layout_from_count(layers, "layers", ["tok_embeddings"], ["norm", "output"])
    try:
        expected = torchtitan_generate(stages, layers, first, last)
    except ValueError as error:
        with pytest.raises(StageAssignmentError) as refused:
            assign_stages(
                layout, stages, first_stage_less_layers=first, last_stage_less_layers=last
            )
        if "exceeds minimum layers per stage" in str(error):
            assert str(error) in str(refused.value)
        return
    parts = assign_stages(
        layout, stages, first_stage_less_layers=first, last_stage_less_layers=last
    )
    assert parts == expected


def test_first_stage_heavier_than_a_stage_is_refused_with_torchtitans_words():
    # 4 layers + 2 + 1 over 4 stages: at least 1 layer per stage, so the first stage would hold
    # only the embeddings. torchtitan: "input_weight (2) exceeds minimum layers per stage (1)."
    layout = layout_from_count(4, "blocks", ["embed"], ["head"])
    with pytest.raises(StageAssignmentError) as refused:
        assign_stages(layout, 4, first_stage_less_layers=2)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("first_stage_less_layers=2 exceeds the minimum layers per stage (1)")
    assert '"input_weight (2) exceeds minimum layers per stage (1)."' in message
    assert "Lower first_stage_less_layers to at most 1, or use fewer stages (at most 3)" in message
    assign_stages(layout, 4, first_stage_less_layers=1)  # the suggested fixes work
    assign_stages(layout, 3, first_stage_less_layers=2)


def test_last_stage_and_both_stages_heavier_are_refused():
    layout = layout_from_count(4, "blocks", ["embed"], ["head"])
    with pytest.raises(StageAssignmentError) as refused:
        assign_stages(layout, 4, last_stage_less_layers=2)
    assert '"output_weight (2) exceeds minimum layers per stage (1)."' in str(refused.value)
    assert "Lower last_stage_less_layers to at most 1" in str(refused.value)
    layout = layout_from_count(2, "blocks", ["embed"], ["head"])
    with pytest.raises(StageAssignmentError) as refused:
        assign_stages(layout, 3, first_stage_less_layers=3, last_stage_less_layers=3)
    message = str(refused.value)
    assert "first_stage_less_layers=3 and last_stage_less_layers=3 exceed" in message
    assert "Lower first_stage_less_layers and last_stage_less_layers to at most 2" in message
    assign_stages(layout, 3, first_stage_less_layers=2, last_stage_less_layers=2)


def test_suggested_lower_value_accounts_for_the_smaller_total():
    # 5 layers + 4 first over 4 stages: minimum 2, but first=2 gives 7 // 4 = 1; so at most 1.
    layout = layout_from_count(5, "blocks", ["embed"], ["head"])
    with pytest.raises(StageAssignmentError, match="first_stage_less_layers to at most 1,"):
        assign_stages(layout, 4, first_stage_less_layers=4, last_stage_less_layers=0)
    assign_stages(layout, 4, first_stage_less_layers=1, last_stage_less_layers=0)
    with pytest.raises(StageAssignmentError):
        assign_stages(layout, 4, first_stage_less_layers=2, last_stage_less_layers=0)


def test_torchtitan_check_applies_to_derived_stage_counts():
    layout = layout_from_count(4, "blocks", ["embed"], ["head"])
    with pytest.raises(StageAssignmentError, match="raise layers_per_stage"):
        assign_stages(layout, None, layers_per_stage=1, first_stage_less_layers=2)


def test_cli_stages_refuses_heavy_first_stage_in_one_line(capsys):
    from splitstage.cli import main

    args = ["stages", "--num-layers", "4", "--num-stages", "4", "--first-stage-less-layers", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "input_weight (2) exceeds minimum layers per stage (1)." in err


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
