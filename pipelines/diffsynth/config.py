"""The `[pipeline]` group of the diffsynth family (torch-free: diffsynth is imported to run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import model_validator

from splitstage.config.base_group import Group
from splitstage.config.pipeline_group import PipelineConfig, setting
from splitstage.pipelines.lora_targets import QWEN_IMAGE_LORA_TARGETS

# Pipeline class -> (its diffsynth module, DiffSynth's usual LoRA targets, training inputs its
# example train.py sets besides the data: the constants of `get_pipeline_inputs`).
PIPELINES: dict[str, tuple[str, tuple[str, ...], dict[str, Any]]] = {
    "ZImagePipeline": (
        "diffsynth.pipelines.z_image",
        ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"),
        {"embedded_guidance": 1.0},
    ),
    "WanVideoPipeline": (
        "diffsynth.pipelines.wan_video",
        ("q", "k", "v", "o", "ffn.0", "ffn.2"),
        {"tiled": False, "cfg_merge": False, "vace_scale": 1},
    ),
    "QwenImagePipeline": (
        "diffsynth.pipelines.qwen_image",
        QWEN_IMAGE_LORA_TARGETS,
        {"edit_image_auto_resize": True, "zero_cond_t": False},
    ),
}
# Pipeline classes whose units encode reference images ('edit_image': Qwen-Image-Edit), and the
# most a row may give (splitstage's bound: the units take a list of any length).
EDIT_PIPELINES = {"QwenImagePipeline": 3}
# Pipeline class -> the slots its training units cannot run without, and what each does there.
REQUIRED_SLOTS: dict[str, dict[str, str]] = {
    "ZImagePipeline": {
        "dit": "the model trained",
        "text_encoder": "it encodes the prompts",
        "vae_encoder": "it encodes the training images",
    },
    "WanVideoPipeline": {
        "dit": "the model trained",
        "text_encoder": "it encodes the prompts",
        "vae": "it encodes the training clips",
    },
    "QwenImagePipeline": {
        "dit": "the model trained",
        "text_encoder": "it encodes the prompts",
        "vae": "it encodes the training images",
    },
}
# DiffSynth's train.py sizes images with max_pixels to multiples of 16 (its data operators'
# height_division_factor and width_division_factor), whatever the pipeline's own factor.
DYNAMIC_DIVISION = 16
INSTALL_HINT = (
    "pip install 'splitstage[diffsynth]' (on a GPU also the torchvision build matching your torch; "
    "see docs/families/diffsynth.md)"
)


class RegisteredModel(Group):
    """A model file DiffSynth does not know yet, added to its MODEL_CONFIGS while loading."""

    path: str
    model_name: str
    model_class: str
    extra_kwargs: dict[str, Any] = {}


class DiffSynthPipelineConfig(PipelineConfig):
    """A DiffSynth-Studio pipeline class built from local model files, trained split."""

    family_class: ClassVar[str] = "splitstage.pipelines.diffsynth.family:DiffSynthFamily"
    models_in_config: ClassVar[bool] = False  # models are the pipeline's slots (dit, vae, ...)
    video_rows: ClassVar[str] = "'diffsynth' with pipeline_class = 'WanVideoPipeline'"
    name: Literal["diffsynth"] = "diffsynth"

    pipeline_class: str = setting(
        ...,
        stage1=True,
        description=f"DiffSynth pipeline class: {', '.join(PIPELINES)}.",
    )
    model_paths: list[str] = setting(
        ...,
        stage1=False,  # the files' content enters the cache key, not where they are
        min_length=1,
        description="Local model files (safetensors) for `from_pretrained(model_configs=...)`.",
    )
    tokenizer_path: str = setting(
        ..., stage1=False, description="Local tokenizer folder (`tokenizer_config`)."
    )
    processor_path: str | None = setting(
        None,
        stage1=False,  # the files' content enters the cache key (fingerprint_source)
        description="QwenImagePipeline: local Qwen2.5-VL processor folder (DiffSynth's "
        "`--processor_path`), needed for rows with `edit_image` (Qwen-Image-Edit).",
    )
    edit_image_list: bool = setting(
        False,
        stage1=True,
        description="Hand a row's one reference image to the units as a list of one: "
        "DiffSynth's multi-image ('Picture 1:') template, what a JSON list of one path gives in "
        "its train.py (Qwen-Image-Edit-2509 / 2511 metadata); rows with several are lists anyway.",
    )
    zero_cond_t: bool = setting(
        False,
        stage1=False,  # read by model_fn alone: stage 2 sets it every step (training_loss)
        description="QwenImagePipeline: DiffSynth's --zero_cond_t, which Qwen-Image-Edit-2511 "
        "needs (its reference tokens modulated at timestep 0); leave it off for Qwen-Image, "
        "Qwen-Image-Edit and Edit-2509.",
    )
    register_models: list[RegisteredModel] = setting(
        [],
        stage1=False,
        description="Model files DiffSynth's MODEL_CONFIGS lacks (their key hash is computed).",
    )
    torch_dtype: Literal["bf16", "fp32"] = setting(
        "bf16", stage1=True, description="The pipeline's torch_dtype (DiffSynth trains in bf16)."
    )
    height: int | None = setting(
        512,
        stage1=True,
        ge=16,
        description="Images and video frames are resized to this (unset with max_pixels).",
    )
    width: int | None = setting(
        512,
        stage1=True,
        ge=16,
        description="Images and video frames are resized to this (unset with max_pixels).",
    )
    max_pixels: int | None = setting(
        None,
        stage1=True,
        ge=DYNAMIC_DIVISION**2,
        description="DiffSynth's --max_pixels (train.py's dynamic resolution, with height and "
        "width unset): each image and video frame keeps its aspect ratio, scaled down to at most "
        "this many pixels, its sides cut to multiples of 16 (its ImageCropAndResize).",
    )
    max_timestep_boundary: float = setting(
        1.0, stage1=False, gt=0, le=1, description="FlowMatchSFTLoss: highest timestep share."
    )
    min_timestep_boundary: float = setting(
        0.0, stage1=False, ge=0, lt=1, description="FlowMatchSFTLoss: lowest timestep share."
    )

    def takes_video(self) -> bool:
        """Video pipelines (Wan) take video rows as clips; the image pipelines take images."""
        return "video" in self.pipeline_class.lower()

    @model_validator(mode="before")
    @classmethod
    def _frames_in_data_video(cls, values: Any) -> Any:
        if isinstance(values, dict) and "num_frames" in values:
            raise ValueError(
                "num_frames: a clip's frames are set in [data.video] (num_frames, frame_stride "
                "or fps, start), one setting for every video family; move it there and remove "
                "pipeline.num_frames"
            )
        return values

    @model_validator(mode="before")
    @classmethod
    def _fixed_or_dynamic_size(cls, values: Any) -> Any:
        """max_pixels sizes each image by itself (train.py's rule: dynamic when height or width
        is unset): a height or width beside it would be ignored there, so it is refused here."""
        if not isinstance(values, dict) or values.get("max_pixels") is None:
            return values
        for size in ("height", "width"):
            if values.get(size) is not None:
                raise ValueError(
                    f"{size}: pipeline.max_pixels sizes each image by its own aspect ratio "
                    f"(DiffSynth's dynamic resolution), which ignores {size}; remove "
                    f"pipeline.{size}, or remove pipeline.max_pixels for a fixed size"
                )
        return {**values, "height": None, "width": None}

    @model_validator(mode="after")
    def _known_class_and_files(self) -> DiffSynthPipelineConfig:
        if self.pipeline_class not in PIPELINES:
            raise ValueError(
                f"pipeline_class: {self.pipeline_class!r} is not a DiffSynth pipeline splitstage "
                f"runs; use one of {', '.join(PIPELINES)}"
            )
        for index, path in enumerate(self.model_paths):
            if not Path(path).is_file():
                raise ValueError(f"model_paths[{index}]: file {path} does not exist; fix the path")
        if not Path(self.tokenizer_path).is_dir():
            raise ValueError(
                f"tokenizer_path: folder {self.tokenizer_path} does not exist; give the local "
                "tokenizer folder (nothing is downloaded)"
            )
        if self.edit_image_list and self.pipeline_class not in EDIT_PIPELINES:
            raise ValueError(
                f"edit_image_list: {self.pipeline_class} encodes no reference images; remove "
                f"edit_image_list (it is for {', '.join(EDIT_PIPELINES)})"
            )
        if self.zero_cond_t and "zero_cond_t" not in PIPELINES[self.pipeline_class][2]:
            raise ValueError(
                f"zero_cond_t: {self.pipeline_class} has no zero_cond_t (it is Qwen-Image-Edit-"
                "2511's, in QwenImagePipeline); remove zero_cond_t"
            )
        if self.processor_path is not None:
            if self.pipeline_class not in EDIT_PIPELINES:
                raise ValueError(
                    f"processor_path: {self.pipeline_class} encodes no reference images; "
                    f"remove processor_path (it is for {', '.join(EDIT_PIPELINES)})"
                )
            if not Path(self.processor_path).is_dir():
                raise ValueError(
                    f"processor_path: folder {self.processor_path} does not exist; give the local "
                    "Qwen2.5-VL processor folder (nothing is downloaded)"
                )
        if self.max_pixels is None:
            for size in ("height", "width"):
                if getattr(self, size) is None:
                    raise ValueError(
                        f"{size}: set pipeline.height and pipeline.width (a fixed size), or "
                        "pipeline.max_pixels (DiffSynth's dynamic resolution)"
                    )
        if self.min_timestep_boundary >= self.max_timestep_boundary:
            raise ValueError("min_timestep_boundary must be below max_timestep_boundary")
        return self
