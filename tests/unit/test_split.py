"""The V1/V2 split against the seed's definitions, DiffSynth-shaped pipelines and the oracle."""

import pytest

from splitstage.splitter import (
    PIPELINE_INPUT,
    Pipeline,
    PipelineSpecError,
    Unit,
    UnknownModelError,
    plan_split,
    split_units,
)
from tests.helpers import seed_oracle
from tests.helpers.splitter_cases import demo_like, qwen_image_like


def names(units):
    return [u.name for u in units]


def oracle(pipeline, trainable):
    v1, v2 = seed_oracle.split_pipeline_units(list(pipeline.units), list(trainable))
    return names(v1), names(v2)


def test_forward_closure_follows_most_recent_producer():
    pipe = Pipeline(
        "p",
        (
            Unit("a", ("x",), output_params=("y",), onload_model_names=("m",)),
            Unit("b", ("y",), output_params=("z",)),
            Unit("c", ("z",), output_params=("w",)),
            Unit("d", ("x",), output_params=("v",)),
        ),
    )
    plan = plan_split(pipe, ["m"])
    assert plan.v1 == ("a", "b", "c")
    assert plan.v2 == ("d",)
    assert plan.reasons["b"] == "reads 'y' produced by V1 unit 'a'"
    assert plan.reasons["c"] == "reads 'z' produced by V1 unit 'b'"
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["m"])


def test_edge_comes_only_from_the_most_recent_producer():
    # b rewrites y after a: c reads b's y, so c does not follow a.
    pipe = Pipeline(
        "p",
        (
            Unit("a", output_params=("y",), onload_model_names=("m",)),
            Unit("b", output_params=("y",)),
            Unit("c", ("y",), output_params=("z",)),
        ),
    )
    plan = plan_split(pipe, "m")
    assert plan.v1 == ("a",)
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["m"])


def test_updating_chain_pulls_later_rewriters_into_v1():
    # u1 reads p and rewrites it; u3 rewrites p later without reading it (no edge), so only
    # the updating-chain rule (C2) puts u3 in V1.
    pipe = Pipeline(
        "p",
        (
            Unit("u0", output_params=("p",)),
            Unit("u1", ("p",), output_params=("p",), onload_model_names=("m",)),
            Unit("u2", ("q",), output_params=("r",)),
            Unit("u3", ("q",), output_params=("p",)),
        ),
    )
    plan = plan_split(pipe, ["m"])
    assert plan.v1 == ("u1", "u3")
    assert plan.reasons["u3"] == (
        "updating chain of 'p': rewrites it after V1 unit 'u1' first reads it"
    )
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["m"])


def test_pure_reader_as_first_consumer_adds_no_chain_units_like_diffsynth():
    # The seed's `updating_units` only acts when the first V1 consumer is itself in the chain.
    pipe = Pipeline(
        "p",
        (
            Unit("a", output_params=("p",)),
            Unit("b", ("p",), onload_model_names=("m",)),
            Unit("c", ("p",), output_params=("p",), onload_model_names=("m",)),
            Unit("d", output_params=("p",)),
        ),
    )
    plan = plan_split(pipe, ["m"])
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["m"])
    assert plan.v1 == ("b", "c")


def test_posi_and_nega_values_are_inputs_keys_are_not():
    pipe = Pipeline(
        "p",
        (
            Unit("enc", output_params=("neg_text",), onload_model_names=("m",)),
            Unit("posi", input_params_posi={"neg_text": "prompt"}, output_params=("a",)),
            Unit("nega", input_params_nega={"prompt": "neg_text"}, output_params=("b",)),
        ),
    )
    plan = plan_split(pipe, ["m"])
    assert plan.v1 == ("enc", "nega")
    assert plan.v2 == ("posi",)
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["m"])


def test_per_step_unit_seeds_v1_and_keeps_text_encoder_in_stage_one():
    plan = plan_split(demo_like(), ["dit"])
    assert plan.v1 == ("CaptionDropout",)
    assert plan.v2 == ("ShapeCheck", "PromptEmbedder", "ImageEncoder")
    assert "per-step" in plan.reasons["CaptionDropout"]
    assert plan.models == {"stage1": ("text_encoder", "vae"), "stage2": ("dit",)}
    assert plan.offload == {"stage1": ("dit",), "stage2": ("text_encoder", "vae")}
    assert set(plan.boundary_params) == {
        "prompt_emb",
        "prompt_mask",
        "empty_prompt_emb",
        "empty_prompt_mask",
        "input_latents",
    }
    assert plan.boundary_sources["input_latents"] == "ImageEncoder"


def test_training_the_text_encoder_moves_prompt_embedding_to_v1():
    plan = plan_split(demo_like(), ["dit", "text_encoder"])
    assert plan.v1 == ("PromptEmbedder", "CaptionDropout")
    assert plan.reasons["PromptEmbedder"] == "uses trainable model 'text_encoder'"
    assert plan.boundary_sources["prompt"] == PIPELINE_INPUT
    assert "prompt_emb" not in plan.boundary_params
    assert plan.models["stage2"] == ("text_encoder", "dit")


def test_model_used_in_both_stages_is_loaded_by_both():
    pipe = Pipeline(
        "p",
        (
            Unit("encode", ("image",), output_params=("lat",), onload_model_names=("vae",)),
            Unit("adapt", ("lat",), output_params=("cond",), onload_model_names=("adapter",)),
            Unit("decode", ("cond",), output_params=("pix",), onload_model_names=("vae",)),
        ),
        model_fn_params=("pix",),
    )
    plan = plan_split(pipe, ["adapter"])
    assert plan.v1 == ("adapt", "decode")
    assert "vae" in plan.models["stage1"] and "vae" in plan.models["stage2"]
    assert plan.boundary_params == ("lat",)


def test_empty_trainable_set_puts_everything_in_v2():
    pipe = qwen_image_like()
    for trainable in ("", [], None, " , "):
        plan = plan_split(pipe, trainable)
        assert plan.v1 == ()
        assert plan.v2 == tuple(u.name for u in pipe.units)
        assert plan.boundary_params == pipe.model_fn_params + pipe.loss_params
        assert plan.models["stage2"] == ("dit",)


def test_qwen_image_lora_on_dit_caches_everything():
    pipe = qwen_image_like()
    plan = plan_split(pipe, ["dit"])
    assert plan.v1 == ()
    assert plan.models["stage1"] == ("vae", "text_encoder")
    assert plan.offload["stage1"] == ("dit",)
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["dit"])


def test_qwen_image_training_text_encoder_warns_about_rewritten_edit_image():
    pipe = qwen_image_like()
    plan = plan_split(pipe, ["dit", "text_encoder"])
    assert plan.v1 == ("PromptEmbedder",)
    assert (list(plan.v1), list(plan.v2)) == oracle(pipe, ["dit", "text_encoder"])
    assert len(plan.warnings) == 1
    assert "'PromptEmbedder' reads 'edit_image'" in plan.warnings[0]
    assert "'EditImageEmbedder' rewrites it later" in plan.warnings[0]


def test_reasons_lead_back_to_a_trainable_model_or_per_step():
    pipe = Pipeline(
        "p",
        (
            Unit("a", output_params=("x",), onload_model_names=("m",)),
            Unit("b", ("x",), output_params=("y",)),
            Unit("c", ("y",), output_params=("z",)),
        ),
    )
    plan = plan_split(pipe, ["m"])
    unit = "c"
    for _ in range(5):
        reason = plan.reasons[unit]
        if reason.startswith("uses trainable model"):
            break
        unit = reason.split("V1 unit '")[1].split("'")[0]
    assert unit == "a"


def test_split_units_returns_indices_in_pipeline_order():
    result = split_units(list(qwen_image_like().units), ["text_encoder", "vae"])
    assert list(result.v1) == sorted(result.v1)
    assert sorted(result.v1 + result.v2) == list(range(5))


def test_duplicate_unit_names_are_refused():
    with pytest.raises(PipelineSpecError, match="unit name 'a' is used by units #0 and #1"):
        Pipeline("p", (Unit("a"), Unit("a")))


def test_unknown_trainable_model_suggests_the_closest_name():
    with pytest.raises(UnknownModelError) as info:
        plan_split(qwen_image_like(), ["ditt"])
    message = str(info.value)
    assert "trainable model 'ditt'" in message
    assert "Did you mean 'dit'?" in message
    assert "Known models: dit, text_encoder, vae" in message


def test_in_iteration_model_counts_as_known():
    plan = plan_split(qwen_image_like(), ["dit"])
    assert plan.trainable == ("dit",)
