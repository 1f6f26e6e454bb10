"""Reading objects shaped like DiffSynth-Studio pipelines (no diffsynth import)."""

import pytest

from splitstage.pipelines.diffsynth.adapter import pipeline_from_diffsynth
from splitstage.splitter import PipelineSpecError, plan_split
from tests.helpers import seed_oracle


class PipelineUnit:
    """Same constructor and fields as DiffSynth-Studio's PipelineUnit."""

    def __init__(
        self,
        seperate_cfg=False,
        take_over=False,
        input_params=None,
        output_params=None,
        input_params_posi=None,
        input_params_nega=None,
        onload_model_names=None,
    ):
        self.seperate_cfg = seperate_cfg
        self.take_over = take_over
        self.input_params = input_params
        self.output_params = output_params
        self.input_params_posi = input_params_posi
        self.input_params_nega = input_params_nega
        self.onload_model_names = onload_model_names

    def fetch_input_params(self):
        params = list(self.input_params or ())
        params += list((self.input_params_posi or {}).values())
        params += list((self.input_params_nega or {}).values())
        return sorted(set(params))

    def fetch_output_params(self):
        return list(self.output_params or ())


class QwenImageUnit_ShapeChecker(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("height", "width"), output_params=("height", "width"))


class QwenImageUnit_NoiseInitializer(PipelineUnit):
    def __init__(self):
        super().__init__(
            input_params=("height", "width", "seed", "rand_device"), output_params=("noise",)
        )


class QwenImageUnit_InputImageEmbedder(PipelineUnit):
    def __init__(self):
        super().__init__(
            input_params=("input_image", "noise", "tiled", "tile_size", "tile_stride"),
            output_params=("latents", "input_latents"),
            onload_model_names=("vae",),
        )


class QwenImageUnit_PromptEmbedder(PipelineUnit):
    def __init__(self):
        super().__init__(
            seperate_cfg=True,
            input_params_posi={"prompt": "prompt"},
            input_params_nega={"prompt": "negative_prompt"},
            input_params=("edit_image",),
            output_params=("prompt_emb", "prompt_emb_mask"),
            onload_model_names=("text_encoder",),
        )


def model_fn_qwen_image(
    dit=None, latents=None, timestep=None, prompt_emb=None, prompt_emb_mask=None, **kwargs
):
    return latents


class QwenImagePipeline:
    def __init__(self):
        self.units = [
            QwenImageUnit_ShapeChecker(),
            QwenImageUnit_NoiseInitializer(),
            QwenImageUnit_InputImageEmbedder(),
            QwenImageUnit_PromptEmbedder(),
        ]
        self.in_iteration_models = ("dit",)
        self.model_fn = model_fn_qwen_image


def test_units_fields_and_model_fn_are_read():
    pipe = pipeline_from_diffsynth(QwenImagePipeline())
    assert pipe.name == "QwenImagePipeline"
    assert [u.name for u in pipe.units][0] == "QwenImageUnit_ShapeChecker"
    assert pipe.units[3].input_params_nega == {"prompt": "negative_prompt"}
    assert pipe.model_fn_params == ("latents", "timestep", "prompt_emb", "prompt_emb_mask")
    assert pipe.in_iteration_models == ("dit",)


@pytest.mark.parametrize("trainable", [["dit"], ["text_encoder"], ["vae"], ["vae", "dit"]])
def test_split_of_an_adapted_pipeline_equals_diffsynths(trainable):
    source = QwenImagePipeline()
    plan = plan_split(pipeline_from_diffsynth(source), trainable)
    v1, v2 = seed_oracle.split_pipeline_units(source.units, trainable)
    assert list(plan.v1) == [type(u).__name__ for u in v1]
    assert list(plan.v2) == [type(u).__name__ for u in v2]


def test_lora_on_dit_caches_prompt_and_latents_but_not_step_params():
    plan = plan_split(pipeline_from_diffsynth(QwenImagePipeline()), ["dit"])
    assert plan.v1 == ()
    assert set(plan.boundary_params) == {"prompt_emb", "prompt_emb_mask", "input_latents"}
    assert plan.models == {"stage1": ("vae", "text_encoder"), "stage2": ("dit",)}


def test_repeated_unit_classes_get_numbered_names():
    source = QwenImagePipeline()
    source.units.append(QwenImageUnit_ShapeChecker())
    pipe = pipeline_from_diffsynth(source)
    assert pipe.units[-1].name == "QwenImageUnit_ShapeChecker#2"


def test_objects_without_units_are_refused():
    with pytest.raises(PipelineSpecError, match="has no `units` list"):
        pipeline_from_diffsynth(object())


def test_malformed_unit_fields_name_the_unit():
    source = QwenImagePipeline()
    source.units[1].output_params = 5
    with pytest.raises(PipelineSpecError, match="QwenImageUnit_NoiseInitializer', field 'output_"):
        pipeline_from_diffsynth(source)


def test_unit_values_the_cache_cannot_hold_are_refused_by_name():
    """A value with tensors nested in lists or dicts (Z-Image Omni-Base's prompt segments) is one
    line naming the unit and param; one sample's list of tensors is stacked; JSON passes."""
    import torch

    from splitstage.pipelines.diffsynth.pipeline_units import encode
    from splitstage.pipelines.runtime import UnitRunError

    lists = frozenset({"prompt_embeds"})
    stacked = encode("prompt_embeds", [torch.ones(2, 3)], "Embedder", lists)
    assert stacked.shape == (1, 2, 3)
    assert encode("size", {"h": [32, 32]}, "Shape", lists) == {"h": [32, 32]}
    nested = [[torch.ones(2, 3), torch.ones(4, 3)]]
    for value in (nested, {"a": torch.ones(1)}, ("x", [torch.ones(1)])):
        with pytest.raises(UnitRunError, match="unit 'Embedder' wrote 'prompt_embeds' as tensors"):
            encode("prompt_embeds", value, "Embedder", lists)
