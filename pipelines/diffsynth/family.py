"""The diffsynth family: a DiffSynth-Studio pipeline object, executed on the seam.

Its units are the pipeline's own `.units`, run through DiffSynth's `pipe.unit_runner` (see
`pipeline_units.py`); the plan is `adapter.pipeline_from_diffsynth` of the same object, so it
equals DiffSynth's `split_pipeline_units`. The training loss is DiffSynth's `FlowMatchSFTLoss`
called on the pipeline with the in-iteration models of this step, its global-RNG draws (timestep,
noise) seeded from the sample's draws. DiffSynth trains one sample per step: train.batch_size
must be 1 (use train.gradient_accumulation_steps for more samples per update).

train.task = "direct_distill" trains with DiffSynth's DirectDistillLoss: each row carries the
teacher's `seed` and `num_inference_steps` (DiffSynth's metadata columns), so the starting noise
(the noise unit, from the row's seed) is a function of the row: no unit becomes per-step, the
noise and the image's latents are cached in stage 1, the few-step loop runs in stage 2.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.data.clips import clip_frames
from splitstage.data.dataset import Row, decode_image, read_image_bytes, reference_row
from splitstage.data.images import center_crop_resize
from splitstage.data.references import ReferenceImages, check_reference_rows
from splitstage.data.row_table import RowTable
from splitstage.data.videos import video_key_settings
from splitstage.pipelines.diffsynth.adapter import DEFAULT_STEP_PARAMS, pipeline_from_diffsynth
from splitstage.pipelines.diffsynth.config import (
    DYNAMIC_DIVISION,
    EDIT_PIPELINES,
    PIPELINES,
    REQUIRED_SLOTS,
)
from splitstage.pipelines.diffsynth.loader import (
    DTYPES,
    SlotSource,
    diffsynth_module,
    load_slot,
    meta_model,
    meta_pipeline,
    skeleton,
    stand_ins,
    training_mode,
)
from splitstage.pipelines.diffsynth.pipeline_units import DiffSynthUnits, loss_inputs
from splitstage.pipelines.diffsynth.tokenizer_check import check_tokenizer
from splitstage.pipelines.distill_rows import distill_values
from splitstage.pipelines.family import ExportRequest, Family, TrainingStep, reference_takers
from splitstage.pipelines.model_buffers import keep_buffers, restore_buffers
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Pipeline

RESIZE = "diffsynth"  # DiffSynth's ImageCropAndResize: bilinear, both sides rounded
BASE_INPUTS = {  # rand_device: the pipeline's device (pipeline_units.ON_PIPE_DEVICE)
    "cfg_scale": 1,
    "use_gradient_checkpointing": False,
    "use_gradient_checkpointing_offload": False,
}
# train.task -> (DiffSynth's loss in diffsynth.diffusion.loss, the params it reads from the
# inputs, the params it makes fresh each step).
LOSSES = {
    "sft": ("FlowMatchSFTLoss", ("input_latents",), DEFAULT_STEP_PARAMS),
    "direct_distill": (
        "DirectDistillLoss",
        ("input_latents", "latents", "num_inference_steps"),
        ("timestep", "progress_id"),
    ),
}


def call_through(module: nn.Module, fn) -> Any:
    """Run `fn` as `module`'s forward, so DDP / FSDP hooks on the root fire (model_fn calls
    the denoiser's submodules directly)."""
    module.forward = fn
    try:
        return module()
    finally:
        del module.forward


class DiffSynthFamily(Family):
    """A DiffSynth pipeline class built from local model files; its units, model_fn and loss."""

    fake_steps = False  # its units call DiffSynth's pipeline object, which loads its models
    no_fake_steps_because = "its units call DiffSynth's pipeline object, which loads its models"

    name = "diffsynth"
    default_lora_targets = ()
    tasks = tuple(LOSSES)
    # Rows' 'edit_image' go to the edit units of the pipeline classes in EDIT_PIPELINES
    # (Qwen-Image-Edit); check_references decides per pipeline class and rows.
    reference_images = ReferenceImages(required=True, most=max(EDIT_PIPELINES.values()))

    def __init__(self, config):
        super().__init__(config)
        self.group = config.pipeline
        self.skeleton = skeleton(self.group)
        names = {n for u in self.skeleton.units for n in _names(u.onload_model_names)}
        self.in_iteration = tuple(self.skeleton.in_iteration_models)
        self.model_names = tuple(sorted(names | set(self.in_iteration)))
        self.denoiser = self.in_iteration[0]
        self._pipe: Any = None
        self._loaded: set[str] = set()
        self._lock = threading.RLock()
        self.units_of = DiffSynthUnits(
            self.skeleton.units,
            self.pipeline_spec().units,
            self.constants(),
            lambda: self.pipe,
            self.group.pipeline_class,
        )

    # -- the pipeline object ---------------------------------------------------------------------
    @property
    def pipe(self) -> Any:
        """The pipeline holding the models this process built so far (build_model; stage 1 its
        stage-1 models, stage 2 the ones its loss sets each step) and, in every other slot a
        file fills, that model's meta-device stand-in (no weights), as DiffSynth's split
        training holds an offloaded one."""
        with self._lock:
            if self._pipe is None:
                pipe = training_mode(skeleton(self.group))
                for slot, model in self.stand_ins.items():
                    setattr(pipe, slot, model)
                self._pipe = pipe
            return self._pipe

    @cached_property
    def stand_ins(self) -> dict[str, nn.Module]:
        """Pipeline slot -> the model DiffSynth's from_pretrained puts there, on the meta device
        (headers and meta-device builds only; `.splitstage_source`: its file and entry)."""
        return stand_ins(self.meta_pipe)

    @cached_property
    def meta_pipe(self) -> Any:
        """The pipeline DiffSynth's from_pretrained builds from every file, on meta (no weights)."""
        return meta_pipeline(self.group)

    @cached_property
    def sources(self) -> dict[str, SlotSource]:
        """Pipeline slot -> its file and MODEL_CONFIGS entry, as DiffSynth's from_pretrained
        fills it."""
        return {slot: model.splitstage_source for slot, model in self.stand_ins.items()}

    @cached_property
    def prompt_slots(self) -> frozenset[str]:
        """Slots a unit reading `prompt` calls: loading one loads the tokenizer with it."""
        units = self.pipeline_spec().units
        return frozenset(m for u in units if "prompt" in u.inputs for m in u.models)

    def _load(self, name: str, device: torch.device) -> Any:
        """Slot `name`'s model, loaded by DiffSynth's from_pretrained from its own file alone
        (once per process); None for a slot no file fills."""
        pipe = self.pipe
        with self._lock:
            if name in self._loaded:
                return getattr(pipe, name, None)
            source = self.sources.get(name)
            if source is not None:
                fresh = load_slot(self.group, source, device, name in self.prompt_slots)
                model = next(m for _, m in fresh.named_children() if m is not None)
                setattr(pipe, name, model)
                if fresh.tokenizer is not None:
                    pipe.tokenizer = fresh.tokenizer
                if getattr(fresh, "processor", None) is not None:  # Qwen-Image-Edit's
                    pipe.processor = fresh.processor
                for size in ("height_division_factor", "width_division_factor"):
                    if getattr(fresh, size) != getattr(self.skeleton, size):  # set by its VAE
                        setattr(pipe, size, getattr(fresh, size))
            self._loaded.add(name)
            return getattr(pipe, name, None)

    def constants(self) -> dict[str, Any]:
        """The inputs DiffSynth's train.py sets besides the data (cfg_scale 1, ...)."""
        return {**BASE_INPUTS, **PIPELINES[self.group.pipeline_class][2], **self.step_settings()}

    def step_settings(self) -> dict[str, Any]:
        """The job's settings among train.py's inputs that only the loss reads: set again every
        step over what the cache holds, so changing one needs no new cache."""
        group = self.group
        settings = {
            "max_timestep_boundary": group.max_timestep_boundary,
            "min_timestep_boundary": group.min_timestep_boundary,
        }
        if "zero_cond_t" in PIPELINES[group.pipeline_class][2]:
            settings["zero_cond_t"] = group.zero_cond_t
        return settings

    @property
    def takes_video(self) -> bool:
        """True for video pipelines (Wan): rows become clips, `input_video`."""
        return "video" in self.group.pipeline_class.lower()

    def stage1_settings(self) -> dict[str, Any]:
        """The `[pipeline]` settings that change stage-1 outputs, how images are scaled
        (DiffSynth's rule, not the diffusers families') and, for video pipelines, the
        `[data.video]` frame choice: the cache key takes them all."""
        task = self.config.train.task
        frames = video_key_settings(self.config.data.video) if self.takes_video else {}
        settings = super().stage1_settings()
        if settings.get("max_pixels") is None:  # fixed sizes: the keys of caches made before it
            settings.pop("max_pixels", None)
        return {**settings, "resize": RESIZE, **frames} | (
            {} if task == "sft" else {"task": task}  # the cache holds the row's starting noise
        )

    # -- units and the splitter's view -----------------------------------------------------------
    def units(self) -> list[RunnableUnit]:
        """The pipeline's units, each run through DiffSynth's unit runner."""
        return self.units_of.runnable()

    def pipeline_spec(self) -> Pipeline:
        """What the splitter sees: the pipeline object's declarations (diffsynth/adapter.py)."""
        _, loss_params, step_params = LOSSES[self.config.train.task]
        return pipeline_from_diffsynth(self.skeleton, None, loss_params, step_params)

    @cached_property
    def unset_params(self) -> tuple[str, ...]:
        """Params units or model_fn read that no unit writes (DiffSynth reads them as None)."""
        spec = self.pipeline_spec()
        read = {p for unit in spec.units for p in unit.inputs} | set(spec.model_fn_params)
        written = {p for unit in spec.units for p in unit.output_params}
        return tuple(sorted(read - written))

    # -- data ------------------------------------------------------------------------------------
    @classmethod
    def check_references(cls, config, rows) -> None:
        """Rows with 'edit_image' only for a pipeline class with edit units, given its processor
        folder; then every row has them (as train.py's `--extra_inputs edit_image` reads each
        row's), at most EDIT_PIPELINES' count. Rows without any: that pipeline's text-to-image."""
        group = config.pipeline
        most = EDIT_PIPELINES.get(group.pipeline_class)
        if most is None:
            label = (
                f"{cls.name} (pipeline_class {group.pipeline_class!r}; only "
                f"{', '.join(map(repr, EDIT_PIPELINES))} takes them)"
            )
            check_reference_rows(rows, None, label, reference_takers)
            return
        first = first_with_references(rows)
        if first is None:
            return
        if group.processor_path is None:
            raise ConfigError(
                f"pipeline.processor_path: {first.where} has 'edit_image', which "
                f"{group.pipeline_class} encodes with the Qwen2.5-VL processor; set "
                "pipeline.processor_path to its local folder (DiffSynth's --processor_path)"
            )
        rule = ReferenceImages(required=True, most=most)
        check_reference_rows(rows, rule, f"{cls.name} {group.pipeline_class}", reference_takers)

    def sized(self, image: Image.Image, where: str) -> Image.Image:
        """An image or frame as train.py's operator sizes it (height x width, or max_pixels)."""
        group = self.group
        if group.max_pixels is None:
            return center_crop_resize(image, group.height, group.width, RESIZE)
        operators = diffsynth_module("diffsynth.core.data.operators")
        division = (DYNAMIC_DIVISION, DYNAMIC_DIVISION)
        operator = operators.ImageCropAndResize(None, None, group.max_pixels, *division)
        height, width = operator.get_height_width(image)
        if not height or not width:
            raise ValueError(
                f"{where}: its {image.width} x {image.height} image is under {DYNAMIC_DIVISION} "
                f"pixels on a side at pipeline.max_pixels = {group.max_pixels}; remove the row "
                "or raise pipeline.max_pixels"
            )
        return operator.crop_and_resize(image, height, width)

    def edit_images(self, row: Row, base_path: str | Path) -> Any:
        """A row's reference images as DiffSynth's train.py hands `edit_image` to the units (its
        data operator, on every data file key): each scaled and cropped by DiffSynth's rule
        (`sized`); one reference as one image (unless pipeline.edit_image_list), several
        as a list (the edit units' single- and multi-image templates differ)."""
        images = []
        for ref in row.references:
            ref_row = reference_row(row, ref)
            image = decode_image(read_image_bytes(ref_row, base_path), ref_row, base_path)
            images.append(self.sized(image, ref_row.where))
        return images[0] if len(images) == 1 and not self.group.edit_image_list else images

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The inputs DiffSynth's train.py builds from a row: the image, or for video pipelines
        the clip (`input_video`: a video row's `[data.video]` frames, an image row as one
        frame, as DiffSynth's video loader gives them), each frame scaled by DiffSynth's rule
        (`sized`), height and width its size (as train.py reads them); the prompt, the training
        constants, and a row's reference images as `edit_image` (`edit_images`)."""
        sample = dict.fromkeys(self.unset_params)  # read, never written: None, as `.get` gives
        sample |= {**self.constants(), "prompt": row.prompt, "negative_prompt": ""}
        if self.config.train.task == "direct_distill":
            sample |= distill_inputs(row)
        if self.takes_video:
            frames = clip_frames(row, base_path, self.config.data.video)
            video = [self.sized(f, row.where) for f in frames]
            size = {"height": video[0].height, "width": video[0].width}
            return sample | size | {"input_video": video, "num_frames": len(video)}
        image = decode_image(read_image_bytes(row, base_path), row, base_path)
        image = self.sized(image, row.where)
        sample |= {"input_image": image, "height": image.height, "width": image.width}
        if row.references:  # checked before stage 1: a pipeline with edit units
            sample["edit_image"] = self.edit_images(row, base_path)
        return sample

    # -- models ----------------------------------------------------------------------------------
    def check_models(self, names: Sequence[str]) -> None:
        """Known slots, one sample per step, and trained models loadable from their file."""
        train = self.config.train
        if train.batch_size != 1:
            raise ConfigError(
                f"train.batch_size={train.batch_size}: DiffSynth pipelines train one sample per "
                "step; set train.batch_size = 1 and train.gradient_accumulation_steps = "
                f"{train.batch_size} for {train.batch_size} samples per update"
            )
        if train.parallelism in ("tp", "fsdp+tp", "pp"):
            raise ConfigError(
                f"train.parallelism={train.parallelism!r}: the diffsynth family trains with "
                "'ddp' or 'fsdp'"
            )
        for name in names:
            self.require_known(name)
        for name in self.config.trainable.models():
            self.require_known(name)

    def check_component_shapes(self) -> None:
        """Every slot DiffSynth's training units need is filled by a file, and the image size
        divides as the pipeline's models need (its factor, set by its VAE), before any model
        loads: not a shape traceback in the ranks after stage 1."""
        group = self.group
        for slot in REQUIRED_SLOTS[group.pipeline_class]:
            if slot not in self.sources:
                raise ConfigError(
                    f"pipeline.model_paths: no file fills the {group.pipeline_class} '{slot}' "
                    f"({REQUIRED_SLOTS[group.pipeline_class][slot]}); add its file to "
                    "pipeline.model_paths"
                )
        for size in ("height", "width"):
            factor = getattr(self.meta_pipe, f"{size}_division_factor")
            value = getattr(group, size)
            if value is None and DYNAMIC_DIVISION % factor:
                raise ConfigError(
                    f"pipeline.max_pixels: DiffSynth's dynamic resolution cuts images to "
                    f"multiples of {DYNAMIC_DIVISION}, and {group.pipeline_class} with these "
                    f"model files needs multiples of {factor}; set pipeline.height and "
                    "pipeline.width instead"
                )
            if value is not None and value % factor:
                fits = max(factor, round(value / factor) * factor)
                raise ConfigError(
                    f"pipeline.{size} = {value}: {group.pipeline_class} with these model files "
                    f"needs a multiple of {factor} (its VAE and patching); use {fits}"
                )
        check_tokenizer(
            group.pipeline_class, group.tokenizer_path, self.stand_ins.get("text_encoder")
        )

    def require_loaded(self, name: str) -> SlotSource:
        """The file and MODEL_CONFIGS entry of a slot, or one line naming what to add."""
        self.require_known(name)
        if name not in self.sources:
            raise ConfigError(
                f"models.{name}: none of pipeline.model_paths loads the {self.group.pipeline_class}"
                f" '{name}'; add its file to pipeline.model_paths"
            )
        return self.sources[name]

    def fingerprint_source(self, name: str) -> dict[str, Any]:
        """The pipeline class and the content of every model, tokenizer and processor file."""
        folders = [self.group.tokenizer_path, self.group.processor_path]
        tokenizer = sorted(
            str(p) for folder in folders if folder for p in Path(folder).rglob("*") if p.is_file()
        )
        return {
            "pipeline_class": self.group.pipeline_class,
            "torch_dtype": self.group.torch_dtype,
            "files": [*self.group.model_paths, *tokenizer],
        }

    def weights_file(self, name: str) -> tuple[str, str] | None:
        """A trained model's own file (read slice by slice after sharding); frozen ones are
        the loaded pipeline's (None)."""
        if name not in self.config.trainable.models():
            return None
        source = self.require_loaded(name)
        path, entry = source.path, source.entry
        if "state_dict_converter" in entry:
            raise ConfigError(
                f"models.{name}: {path} needs DiffSynth's {entry['state_dict_converter']} to "
                "load; train from a file in DiffSynth's own key layout"
            )
        return path, ""

    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        """A frozen slot loaded from its own file (and only it), or the slot's class on meta."""
        if not meta:
            self.require_known(name)
            model = self._load(name, device)
            self.pipe.device = device
            if model is None:  # a slot no file fills: its units see None, as in DiffSynth
                absent = nn.Module()
                absent.diffsynth_absent = True
                return absent
            return model.to(device).eval().requires_grad_(False)
        model = meta_model(self.require_loaded(name).entry)
        model = model.to(DTYPES[self.group.torch_dtype])  # as DiffSynth's loader: all to dtype
        # Non-persistent buffers (RoPE tables...) are in no file: kept here, put back after load.
        keep_buffers(model)
        return model

    def init_buffers(self, model: nn.Module) -> None:
        """The non-persistent buffers as the class built them (to_empty left them garbage)."""
        restore_buffers(model, f"a {self.group.pipeline_class} model")

    # -- the training step -----------------------------------------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Not split into parts: DiffSynth's loss draws and calls model_fn itself."""
        raise ConfigError("the diffsynth family trains through training_loss (no 'pp')")

    def training_loss(self, ctx: StepContext, inputs: dict[str, Any]) -> torch.Tensor:
        """DiffSynth's loss for train.task (FlowMatchSFTLoss, DirectDistillLoss) on this
        sample, with this step's in-iteration models."""
        samples = loss_inputs(self.units_of.session, ctx, inputs, self.units_of.lists)
        if len(samples) != 1:
            raise ConfigError(f"train.batch_size: got {len(samples)} samples; set 1")
        pipe = self.pipe
        pipe.device = ctx.device
        values = {k: _to(v, ctx.device, pipe.torch_dtype) for k, v in samples[0].items()}
        # DiffSynth's model_fn wraps each block in torch.utils.checkpoint when asked (the cached
        # constant is DiffSynth's default, False): the job's switch decides, every step.
        values["use_gradient_checkpointing"] = self.config.train.gradient_checkpointing
        values |= self.step_settings()
        for slot in self.in_iteration:
            model = ctx.models.get(slot)
            if model is not None and not getattr(model, "diffsynth_absent", False):
                setattr(pipe, slot, model)
        loss_name = LOSSES[self.config.train.task][0]
        loss_fn = getattr(diffsynth_module("diffsynth.diffusion.loss"), loss_name)
        seed = int(ctx.draws.randint(2**62, 1))  # one sample per step (checked at launch)
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        # The pipeline's torch_dtype decides precision, as in DiffSynth: no autocast on top.
        autocast_off = torch.autocast(ctx.device.type, enabled=False)
        with torch.random.fork_rng(devices=devices), autocast_off:
            torch.manual_seed(seed)
            root = ctx.model(self.denoiser, "model_fn")
            return call_through(root, lambda: loss_fn(pipe, **values))

    # -- hooks -----------------------------------------------------------------------------------
    def check_gradient_checkpointing(self, name: str) -> None:
        """DiffSynth's model_fn recomputes the in-iteration models' blocks (its
        `use_gradient_checkpointing` input); the units' models cannot."""
        if name not in self.in_iteration:
            super().check_gradient_checkpointing(name)

    def enable_gradient_checkpointing(self, name: str, model: nn.Module) -> None:
        """Nothing to set on the model: training_loss passes `use_gradient_checkpointing` from
        train.gradient_checkpointing to DiffSynth's loss and model_fn."""
        self.check_gradient_checkpointing(name)

    def native_weight_dtype(self, name: str) -> torch.dtype | None:
        """pipeline.torch_dtype, as DiffSynth's loader holds every model (Z-Image needs bf16)."""
        return DTYPES[self.group.torch_dtype]

    def lora_targets(self, name: str) -> list[str]:
        """The config's targets, else those DiffSynth's examples train for this pipeline."""
        return list(
            self.config.trainable.lora_target_modules or PIPELINES[self.group.pipeline_class][1]
        )

    def export_files(
        self, model_name: str, state: dict[str, torch.Tensor], request: ExportRequest
    ) -> dict[str, tuple[str, bytes]]:
        """DiffSynth's layout (`pipe.<model>.<param>` minus remove_prefix_in_ckpt); a LoRA's
        alpha / rank is folded into lora_B, since `pipe.load_lora` fuses B @ A unscaled."""
        if request.lora and request.alpha != request.rank:
            scale = request.alpha / request.rank
            state = {k: v * scale if "lora_B" in k else v for k, v in state.items()}
        return super().export_files(model_name, state, request)

    def export_metadata(self, model_name: str, lora: bool) -> dict[str, str]:
        """The pipeline class the weights belong to."""
        return {"diffsynth_pipeline": self.group.pipeline_class}


def first_with_references(rows) -> Row | None:
    """The first row naming reference images (None: no row does)."""
    if isinstance(rows, RowTable) and not rows.has_references():
        return None
    return next((row for row in rows if row.references), None)


def distill_inputs(row: Row) -> dict[str, Any]:
    """The row's teacher settings DirectDistillLoss reads, checked (distill_rows.py); those
    the row leaves empty keep train.py's values (cfg_scale 1, rand_device the pipeline's)."""
    return {k: v for k, v in distill_values(row).items() if v is not None}


def _names(value: Any) -> list[str]:
    """A declared name field as DiffSynth reads it (None: none; a bare string: one name)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """DiffSynth's transfer_data_to_device: tensors to the device, floating ones to the dtype."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value
