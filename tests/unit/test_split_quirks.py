"""Bare-string unit fields (`("noise")` for `("noise",)`): split exactly as DiffSynth-Studio does.

DiffSynth-Studio iterates `input_params` / `output_params` in `fetch_*_params` (so a string gives
its characters) and tests `model_name in unit.onload_model_names` (a substring test on a string).
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitstage.splitter import (
    PIPELINE_INPUT,
    Pipeline,
    Unit,
    UnknownModelError,
    pipeline_from_dict,
    plan_split,
)
from splitstage.splitter import plan as plan_module
from tests.helpers import seed_oracle


def oracle(units, trainable):
    """The seed's split on DiffSynth PipelineUnits holding the very same declared fields."""
    v1, v2 = seed_oracle.split_pipeline_units(
        [seed_oracle.as_diffsynth(u) for u in units], list(trainable)
    )
    return [u.name for u in v1], [u.name for u in v2]


def split_of(plan):
    return list(plan.v1), list(plan.v2)


# output_params -----------------------------------------------------------------------------


def noise_pipeline(reader_inputs=("noise",)):
    return Pipeline(
        "p",
        (
            Unit("NoiseInitializer", ("seed",), output_params="noise", onload_model_names=("m",)),
            Unit("Reader", reader_inputs, output_params=("x",)),
        ),
        in_iteration_models=("dit",),
    )


def test_string_output_params_write_characters_so_the_reader_of_the_name_is_not_followed():
    pipe = noise_pipeline()
    plan = plan_split(pipe, ["m"])
    assert split_of(plan) == (["NoiseInitializer"], ["Reader"])
    assert split_of(plan) == oracle(pipe.units, ["m"])
    # Stage 1 runs Reader, whose 'noise' no V2 unit writes (in DiffSynth's reading).
    assert plan.boundary_sources == {"seed": PIPELINE_INPUT}


def test_string_output_params_feed_a_reader_of_one_character():
    pipe = noise_pipeline(reader_inputs=("n",))  # DiffSynth sees NoiseInitializer write 'n'
    plan = plan_split(pipe, ["m"])
    assert split_of(plan) == (["NoiseInitializer", "Reader"], [])
    assert plan.reasons["Reader"] == "reads 'n' produced by V1 unit 'NoiseInitializer'"
    assert split_of(plan) == oracle(pipe.units, ["m"])


def test_string_output_params_with_repeated_characters_build_diffsynths_chains():
    # "latents" writes 't' twice: DiffSynth's chain for 't' is [a, a, c]; a first reads 't' in
    # V1, so the rest of the chain from a's first place (a, c) joins V1.
    pipe = Pipeline(
        "p",
        (
            Unit("a", ("t",), output_params="latents", onload_model_names=("m",)),
            Unit("b", ("x",), output_params=("y",)),
            Unit("c", ("q",), output_params=("t",)),
        ),
        in_iteration_models=("m",),
    )
    plan = plan_split(pipe, ["m"])
    assert split_of(plan) == oracle(pipe.units, ["m"]) == (["a", "c"], ["b"])
    assert plan.reasons["c"] == (
        "updating chain of 't': rewrites it after V1 unit 'a' first reads it"
    )


def test_string_output_params_warning_says_what_diffsynth_does_and_what_the_fix_changes():
    plan = plan_split(noise_pipeline(), ["m"])
    assert plan.warnings == (
        "unit 'NoiseInitializer': output_params is the bare string 'noise', not a list of names "
        "(a one-element tuple missing its comma?); DiffSynth-Studio iterates its characters, so "
        "the unit writes 'n', 'o', 'i', 's', 'e', not 'noise'; this split does the same "
        "(DiffSynth-Studio parity). Read as ('noise',), for trainable 'm' it would: make "
        "'Reader' V1 (now V2, cached)",
    )


# onload_model_names ------------------------------------------------------------------------


def vae_pipeline(onload):
    return Pipeline(
        "p",
        (
            Unit("VideoEncoder", ("video",), output_params=("latents",), onload_model_names=onload),
            Unit("Prompt", ("prompt",), output_params=("emb",), onload_model_names=("te",)),
        ),
        model_fn_params=("latents", "emb"),
        in_iteration_models=("dit",),
    )


@pytest.mark.parametrize(
    ("trainable", "v1"),
    [
        (["vae"], ["VideoEncoder"]),  # substring of "video_vae_encoder": DiffSynth matches it
        (["video"], ["VideoEncoder"]),
        (["e"], ["VideoEncoder"]),
        (["video_vae_encoder"], ["VideoEncoder"]),
        (["dit"], []),
        (["te"], ["Prompt"]),  # "te" is not in "video_vae_encoder"
    ],
)
def test_string_onload_model_names_is_a_substring_test(trainable, v1):
    pipe = vae_pipeline("video_vae_encoder")
    plan = plan_split(pipe, trainable)
    assert list(plan.v1) == v1
    assert split_of(plan) == oracle(pipe.units, trainable)


def test_tuple_onload_model_names_is_an_exact_membership_test():
    pipe = vae_pipeline(("video_vae_encoder",))
    assert oracle(pipe.units, ["vae"]) == ([], ["VideoEncoder", "Prompt"])
    with pytest.raises(UnknownModelError, match="trainable model 'vae' is used by no unit"):
        plan_split(pipe, ["vae"])  # no model called 'vae' at all: splitstage refuses it


def test_substring_trainable_is_known_but_a_typo_is_still_refused():
    pipe = vae_pipeline("video_vae_encoder")
    plan_split(pipe, ["vae"])
    with pytest.raises(UnknownModelError, match="Did you mean 'video_vae_encoder'?"):
        plan_split(pipe, ["video_vae_encodr"])


def test_string_onload_model_names_names_one_model_for_loading_and_offload():
    plan = plan_split(vae_pipeline("video_vae_encoder"), ["vae"])
    assert plan.models == {"stage1": ("te",), "stage2": ("video_vae_encoder", "dit", "vae")}
    assert plan.offload["stage1"] == ("dit", "video_vae_encoder")
    assert plan.unit_models["VideoEncoder"] == ("video_vae_encoder",)
    assert plan.reasons["VideoEncoder"] == (
        "uses trainable model 'vae' (a substring of its onload_model_names string "
        "'video_vae_encoder', which DiffSynth-Studio's `in` test matches)"
    )


def test_string_onload_model_names_warning_names_the_substring_and_the_difference():
    plan = plan_split(vae_pipeline("video_vae_encoder"), ["vae"])
    assert plan.warnings == (
        "unit 'VideoEncoder': onload_model_names is the bare string 'video_vae_encoder', not a "
        "list of names (a one-element tuple missing its comma?); DiffSynth-Studio tests `model in "
        "onload_model_names`, a substring test on a string: trainable 'vae' matches as a "
        "substring of 'video_vae_encoder', so the unit uses a trainable model; this split does "
        "the same (DiffSynth-Studio parity). Read as ('video_vae_encoder',), for trainable 'vae' "
        "it would: make 'VideoEncoder' V2 (now V1); cache 'latents' (from unit 'VideoEncoder'); "
        "stop caching 'video'",
    )


def test_string_onload_warning_when_nothing_changes_lists_models_that_would_match():
    pipe = Pipeline(
        "p",
        (Unit("enc", ("x",), output_params=("y",), onload_model_names="vae_encoder"),),
        in_iteration_models=("dit", "vae"),
    )
    (warning,) = plan_split(pipe, ["dit"]).warnings
    assert "no trainable model is a substring of it (training 'vae' would match it too)" in warning
    assert warning.endswith(
        "Read as ('vae_encoder',), the split and the cache for trainable 'dit' are the same"
    )


# input_params ------------------------------------------------------------------------------


def test_string_input_params_read_characters():
    units = (
        Unit("NoiseInitializer", output_params=("noise",), onload_model_names=("m",)),
        Unit("Embedder", "noise", output_params=("latents",)),  # reads 'n', 'o', 'i', 's', 'e'
        Unit("Letter", output_params=("o",), onload_model_names=("m2",)),
        Unit("Late", "io", output_params=("z",)),
    )
    pipe = Pipeline("p", units, in_iteration_models=("m", "m2"))
    for trainable, v1 in ((["m"], ["NoiseInitializer"]), (["m2"], ["Letter", "Late"])):
        plan = plan_split(pipe, trainable)
        assert list(plan.v1) == v1
        assert split_of(plan) == oracle(units, trainable)
    plan = plan_split(pipe, ["m"])
    assert "the unit reads 'n', 'o', 'i', 's', 'e', not 'noise'" in plan.warnings[0]
    assert plan.warnings[0].endswith(
        "Read as ('noise',), for trainable 'm' it would: make 'Embedder' V1 (now V2, cached)"
    )


def test_string_input_params_take_part_in_updating_chains_as_characters():
    # Reader first consumes 'a' (one of "ab"'s characters) in V1; Rewriter rewrites 'a' later.
    units = (
        Unit("Reader", "ab", output_params=("a",), onload_model_names=("m",)),
        Unit("Rewriter", ("q",), output_params=("a",)),
    )
    plan = plan_split(Pipeline("p", units, in_iteration_models=("m",)), ["m"])
    assert split_of(plan) == oracle(units, ["m"]) == (["Reader", "Rewriter"], [])


def test_empty_string_fields_mean_no_names_like_diffsynth():
    units = (Unit("a", "", output_params="", onload_model_names=""),)
    plan = plan_split(Pipeline("p", units, in_iteration_models=("m",)), ["m"])
    assert split_of(plan) == oracle(units, ["m"]) == ([], ["a"])
    assert len(plan.warnings) == 3
    assert all("reads it as no names" in w for w in plan.warnings)


def test_many_string_fields_get_one_combined_comparison(monkeypatch):
    monkeypatch.setattr(plan_module, "MAX_FIELD_COMPARISONS", 1)
    pipe = Pipeline(
        "p",
        (
            Unit("a", output_params="noise", onload_model_names=("m",)),
            Unit("b", ("noise",), output_params=("x",)),
            Unit("c", "x", output_params=("y",)),  # "x" iterates to 'x': the same name
        ),
        in_iteration_models=("m",),
    )
    warnings = plan_split(pipe, ["m"]).warnings
    assert len(warnings) == 3
    assert all("See the combined warning" in w for w in warnings[:2])
    assert warnings[2].startswith(
        "2 unit fields are bare strings; read each as one name, for trainable 'm' they would: "
        "make 'b', 'c' V1 (now V2, cached)"
    )


def test_tuple_fields_get_no_string_warnings():
    pipe = noise_pipeline()
    fixed = Pipeline("p", tuple(u.as_intended() for u in pipe.units), in_iteration_models=("dit",))
    plan = plan_split(fixed, ["m"])
    assert plan.warnings == ()
    assert split_of(plan) == (["NoiseInitializer", "Reader"], [])


# Property: plans with string fields equal the oracle ---------------------------------------

PARAMS = ["a", "b", "c", "ab", "ba", "abc"]
MODELS = ["m", "0", "m0", "mm", "0m"]
params = st.one_of(
    st.lists(st.sampled_from(PARAMS), max_size=3).map(tuple), st.text(alphabet="abc", max_size=4)
)
models = st.one_of(
    st.lists(st.sampled_from(MODELS), max_size=2).map(tuple), st.text(alphabet="m0", max_size=3)
)
arg_maps = st.dictionaries(st.sampled_from(["x", "y"]), st.sampled_from(PARAMS), max_size=2)


@st.composite
def string_pipelines(draw):
    count = draw(st.integers(min_value=0, max_value=14))
    units = tuple(
        Unit(
            f"u{i}",
            draw(params),
            input_params_posi=draw(arg_maps),
            input_params_nega=draw(arg_maps),
            output_params=draw(params),
            onload_model_names=draw(models),
        )
        for i in range(count)
    )
    return Pipeline("random", units, in_iteration_models=tuple(MODELS))


@settings(max_examples=400, deadline=None)
@given(string_pipelines(), st.lists(st.sampled_from(MODELS), max_size=3, unique=True))
def test_plans_with_string_fields_equal_the_oracle(pipe, trainable):
    plan = plan_split(pipe, trainable)
    assert split_of(plan) == oracle(pipe.units, trainable)
    assert len(plan.warnings) >= sum(len(u.string_fields) for u in pipe.units)


@settings(max_examples=100, deadline=None)
@given(string_pipelines(), st.lists(st.sampled_from(MODELS), max_size=3, unique=True))
def test_round_trip_through_json_keeps_the_split(pipe, trainable):
    again = pipeline_from_dict(json.loads(json.dumps(pipe.to_dict())))
    assert again.to_dict() == pipe.to_dict()
    assert split_of(plan_split(again, trainable)) == split_of(plan_split(pipe, trainable))


# The CLI reads PIPELINE.json through pipeline_from_dict ------------------------------------


def test_cli_plan_accepts_json_string_fields_and_prints_the_warning(tmp_path, capsys):
    from splitstage.cli import main

    path = tmp_path / "pipeline.json"
    path.write_text(
        json.dumps(
            {
                "name": "p",
                "units": [
                    {"name": "NoiseInitializer", "input_params": "seed", "output_params": "noise"},
                    {
                        "name": "VideoEncoder",
                        "input_params": ["video", "noise"],
                        "output_params": ["latents"],
                        "onload_model_names": "video_vae_encoder",
                    },
                ],
                "model_fn_params": ["latents"],
                "in_iteration_models": ["dit"],
            }
        )
    )
    assert main(["plan", str(path), "--trainable", "vae"]) == 0
    out = capsys.readouterr().out
    assert "VideoEncoder      V1 (stage 2, every step)" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3
    assert "input_params is the bare string 'seed'" in warnings[0]
    assert "the unit writes 'n', 'o', 'i', 's', 'e', not 'noise'" in warnings[1]
    assert "trainable 'vae' matches as a substring of 'video_vae_encoder'" in warnings[2]
    assert main(["plan", str(path), "--trainable", "vae", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["v1"] == ["VideoEncoder"] and len(out["warnings"]) == 3


def test_diffsynth_objects_with_string_fields_split_like_diffsynth():
    from splitstage.pipelines.diffsynth.adapter import pipeline_from_diffsynth

    class WanLikePipeline:
        units = [
            seed_oracle.PipelineUnit(input_params=("seed",), output_params=("noise")),
            seed_oracle.PipelineUnit(
                input_params=("input_video", "noise"),
                output_params=("latents", "input_latents"),
                onload_model_names=("video_vae_encoder"),
            ),
            seed_oracle.PipelineUnit(
                input_params=("prompt",), output_params=("context",), onload_model_names=("vae")
            ),
        ]
        in_iteration_models = ("dit",)

    pipe = pipeline_from_diffsynth(WanLikePipeline())
    for trainable in (["vae"], ["dit"], ["video_vae_encoder"], ["encoder", "dit"]):
        plan = plan_split(pipe, trainable)
        v1, v2 = seed_oracle.split_pipeline_units(WanLikePipeline.units, trainable)
        names = [u.name for u in pipe.units]
        by_object = {id(u): name for u, name in zip(WanLikePipeline.units, names)}
        assert list(plan.v1) == [by_object[id(u)] for u in v1]
        assert list(plan.v2) == [by_object[id(u)] for u in v2]
        assert len(plan.warnings) >= 2
