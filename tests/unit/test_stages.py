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


FLUX_INPUTS = ["pos_embed", "time_text_embed", "context_embedder", "x_embedder"]
FLUX_DOUBLE = [f"transformer_blocks.{i}" for i in range(19)]
FLUX_SINGLE = [f"single_transformer_blocks.{i}" for i in range(38)]
FLUX = [*FLUX_INPUTS, *FLUX_DOUBLE, *FLUX_SINGLE, "norm_out", "proj_out"]
SD3 = [
    "pos_embed",
    "time_text_embed",
    "context_embedder",
    *[f"transformer_blocks.{i}" for i in range(24)],
    "norm_out",
    "proj_out",
]


def test_adjacent_runs_are_one_sequence_of_layers():
    layout = layout_from_fqns(FLUX)
    assert layout.inputs == tuple(FLUX_INPUTS)
    assert layout.layers == tuple(FLUX_DOUBLE + FLUX_SINGLE)
    assert layout.outputs == ("norm_out", "proj_out")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_two_run_layout_splits_anywhere_in_either_run(stages):
    layout = layout_from_fqns(FLUX)
    parts = assign_stages(layout, stages)
    assert len(parts) == stages
    assert flat(parts) == FLUX  # every module exactly once, each stage contiguous, in order
    assert validate_stages(parts, layout.modules) == parts
    sizes = [sum(fqn in layout.layers for fqn in part) for part in parts]
    assert sum(sizes) == 57 and max(sizes) - min(sizes) <= 2  # balanced across both runs
    assert parts[0][: len(FLUX_INPUTS)] == FLUX_INPUTS and parts[-1][-2:] == [
        "norm_out",
        "proj_out",
    ]


def test_a_stage_may_hold_the_end_of_one_run_and_the_start_of_the_next():
    parts = assign_stages(layout_from_fqns(FLUX), 3)  # 57 + 1 + 1 = 59 -> 20, 20, 19
    assert parts[0] == FLUX_INPUTS + FLUX_DOUBLE[:19]
    assert parts[1] == FLUX_SINGLE[:20]
    assert parts[2] == FLUX_SINGLE[20:] + ["norm_out", "proj_out"]
    parts = assign_stages(layout_from_fqns(FLUX), 2)  # 59 -> 30, 29
    assert parts[0] == FLUX_INPUTS + FLUX_DOUBLE + FLUX_SINGLE[:10]
    assert parts[1] == FLUX_SINGLE[10:] + ["norm_out", "proj_out"]


def test_user_stages_across_the_two_runs_are_accepted():
    layout = layout_from_fqns(FLUX)
    parts = [FLUX[:10], FLUX[10 : 4 + 19 + 6], FLUX[4 + 19 + 6 :]]
    assert parts[1][-7:] == ["transformer_blocks.18", *FLUX_SINGLE[:6]]
    assert validate_stages(parts, layout.modules) == parts


def test_single_run_layout_is_unchanged():
    layout = layout_from_fqns(SD3)
    assert layout.inputs == ("pos_embed", "time_text_embed", "context_embedder")
    assert layout.layers == tuple(f"transformer_blocks.{i}" for i in range(24))
    assert layout.outputs == ("norm_out", "proj_out")
    assert assign_stages(layout, 4) == assign_stages(
        layout_from_count(24, "transformer_blocks", layout.inputs, layout.outputs), 4
    )


def test_one_block_runs_are_merged_too():
    fqns = ["x_embedder", "transformer_blocks.0", "single_transformer_blocks.0", "proj_out"]
    layout = layout_from_fqns(fqns)
    assert layout.layers == ("transformer_blocks.0", "single_transformer_blocks.0")


def test_runs_separated_by_a_module_keep_the_longest_region():
    down = [f"down.{i}" for i in range(3)]
    up = [f"up.{i}" for i in range(4)]
    layout = layout_from_fqns(["conv_in", *down, "mid", *up, "conv_out"])
    assert layout.inputs == ("conv_in", *down, "mid")
    assert layout.layers == tuple(up)
    assert layout.outputs == ("conv_out",)
    # An adjacent pair outweighs a longer single run elsewhere.
    a, b, c = ([f"{p}.{i}" for i in range(n)] for p, n in (("a", 3), ("b", 3), ("c", 5)))
    layout = layout_from_fqns(["embed", *c, "mid", *a, *b, "head"])
    assert layout.inputs == ("embed", *c, "mid")
    assert layout.layers == tuple(a + b)
    assert layout.outputs == ("head",)


def test_equal_regions_keep_the_first():
    layout = layout_from_fqns(["embed", "a.0", "a.1", "mid", "b.0", "b.1", "head"])
    assert layout.layers == ("a.0", "a.1")
    assert layout.outputs == ("mid", "b.0", "b.1", "head")
