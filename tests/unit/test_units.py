"""Unit and pipeline records: DiffSynth field semantics and errors that name the field."""

import pytest

from splitstage.splitter import (
    PipelineSpecError,
    Unit,
    parse_trainable,
    pipeline_from_dict,
    unit_from_dict,
)


def test_inputs_are_input_params_plus_posi_nega_values_sorted_unique():
    unit = Unit(
        "u",
        ("b", "a"),
        input_params_posi={"prompt": "prompt"},
        input_params_nega={"prompt": "negative_prompt", "other": "a"},
    )
    assert unit.fetch_input_params() == ["a", "b", "negative_prompt", "prompt"]


def test_null_and_missing_fields_mean_empty():
    unit = unit_from_dict({"name": "u", "input_params": None, "onload_model_names": None})
    assert unit.fetch_input_params() == []
    assert unit.fetch_output_params() == []
    assert unit.onload_model_names == ()
    assert unit.per_step is False


def test_input_params_may_be_an_argument_to_param_map():
    unit = unit_from_dict({"name": "u", "input_params": {"image": "input_image"}})
    assert unit.fetch_input_params() == ["input_image"]


@pytest.mark.parametrize("field", ["input_params", "output_params", "onload_model_names"])
def test_a_bare_string_field_is_kept_as_declared_like_diffsynth(field):
    # DiffSynth-Studio pipelines declare ("noise") for ("noise",); the string is accepted as is.
    unit = unit_from_dict({"name": "u", field: "noise"})
    assert getattr(unit, field) == "noise"
    assert unit.string_fields == (field,)
    assert unit.to_dict()[field] == "noise"
    assert unit.as_intended() == unit_from_dict({"name": "u", field: ["noise"]})


def test_a_bare_string_reads_as_its_characters_but_names_one_model():
    unit = Unit("u", "noise", output_params="latents", onload_model_names="video_vae_encoder")
    assert unit.fetch_input_params() == ["e", "i", "n", "o", "s"]
    assert unit.fetch_output_params() == ["l", "a", "t", "e", "n", "t", "s"]
    assert unit.uses_model("vae") and not unit.uses_model("dit")
    assert unit.models == ("video_vae_encoder",)
    assert Unit("u", onload_model_names="").models == ()
    assert Unit("u", ("a",)).string_fields == ()


def test_round_trip_through_dict():
    record = {
        "name": "p",
        "units": [
            {
                "name": "u",
                "input_params": ["a"],
                "input_params_posi": {"prompt": "prompt"},
                "input_params_nega": {},
                "output_params": ["b"],
                "onload_model_names": ["m"],
                "per_step": True,
            }
        ],
        "model_fn_params": ["b"],
        "loss_params": [],
        "in_iteration_models": ["m"],
        "step_params": ["timestep"],
    }
    assert pipeline_from_dict(record).to_dict() == record


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"name": "u", "inputs": ["a"]}, "unit 'u', field 'inputs': unknown field"),
        ({"name": "u", "input_param": ["a"]}, "Did you mean 'input_params'?"),
        ({"name": "u", "output_params": 5}, "field 'output_params': expected a list"),
        ({"name": "u", "output_params": [1]}, "every entry must be a non-empty string"),
        ({"name": "u", "input_params_posi": ["prompt"]}, "field 'input_params_posi': expected an"),
        ({"name": "u", "input_params_nega": {"p": 3}}, "must map a string argument"),
        ({"name": "u", "onload_model_names": {"vae": 1}}, "field 'onload_model_names'"),
        ({"name": "u", "per_step": "yes"}, "field 'per_step': expected true or false"),
        ({"name": ""}, "unit #0: field 'name' must be a non-empty string"),
        (["u"], "unit #0: expected an object"),
    ],
)
def test_malformed_unit_records_name_the_field(record, expected):
    with pytest.raises(PipelineSpecError, match=expected.replace("'", "'").replace("(", r"\(")):
        pipeline_from_dict({"name": "pipe", "units": [record]})


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ([], "expected a JSON object"),
        ({"units": []}, "field 'name' must be a non-empty string"),
        ({"name": "p", "unit": []}, "Did you mean 'units'?"),
        ({"name": "p", "units": {}}, "field 'units': expected a list"),
        ({"name": "p", "loss_params": "x"}, "field 'loss_params': expected a list"),
    ],
)
def test_malformed_pipeline_documents_name_the_field(document, expected):
    with pytest.raises(PipelineSpecError, match=expected):
        pipeline_from_dict(document)


def test_parse_trainable():
    assert parse_trainable("dit, text_encoder,,dit") == ("dit", "text_encoder")
    assert parse_trainable("") == ()
    assert parse_trainable(None) == ()
    assert parse_trainable(["vae"]) == ("vae",)
