"""The family seam: what one pipeline family gives every stage, with defaults, and its lookup.

Generic code (tasks/, flows/) never names a family: it calls `family_for(config)` and uses only
this interface. A family is one module (or folder) with a torch-free config group (its
`[pipeline]` settings, see `config.pipeline_group.setting`) that names its `Family`
subclass; the registry (`config.families`) finds the group by name. See
docs/adding-a-family.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from splitstage.config.families import config_class, import_object
from splitstage.config.job import ConfigError, ModelConfig
from splitstage.data.buckets import BucketError, Buckets
from splitstage.data.images import center_crop_resize, image_to_tensor
from splitstage.data.references import ReferenceImages, check_reference_rows
from splitstage.data.source import DataSource
from splitstage.pipelines.runtime import RunnableUnit, StepContext, run_units
from splitstage.splitter import Pipeline
from splitstage.storage.safetensors_io import index_weight_map, is_index_path

if TYPE_CHECKING:
    from collections.abc import Iterable

    from splitstage.config.job import SplitstageConfig
    from splitstage.data.dataset import Row, SizeRule


@dataclass
class TrainingStep:
    """One step's denoiser inputs (in the denoiser's dtype), target and weighting."""

    denoiser_args: tuple[Any, ...]
    target: torch.Tensor
    weight: torch.Tensor | None = None  # per-sample loss weights [B] (e.g. min-SNR), or None
    denoiser_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword inputs (not PP)


@dataclass
class ExportRequest:
    """What an export is of: LoRA or full, its rank / alpha / targets, the run's updates."""

    lora: bool
    rank: int
    alpha: float
    targets: list[str]
    remove_prefix: str = ""
    steps: int = 0


class Family:
    """One pipeline family: units, spec, settings, data, models, ONE training step, hooks."""

    name: ClassVar[str]
    model_names: ClassVar[tuple[str, ...]]  # every model the units or the denoiser call
    denoiser: ClassVar[str]  # the in-iteration model the training step calls
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out")
    tp_plans: ClassVar[Mapping[str, Mapping[str, str]]] = {}  # model -> FQN pattern -> style
    tasks: ClassVar[tuple[str, ...]] = ("sft",)  # the train.task values this family trains
    # Whether the memory plan can step its units on fake models (they take models from the
    # step's context, not from an object of their own that loads them).
    fake_steps: ClassVar[bool] = True
    no_fake_steps_because: ClassVar[str] = "its units load their own models"
    # The reference images ('edit_image') a row carries beside its target, and their size;
    # None: the family takes none, and rows with them are refused before stage 1.
    reference_images: ClassVar[ReferenceImages | None] = None
    # Cached params whose dim 0 is a sequence as long as the sample's own (prompt tokens) ->
    # their mask param (None: none, the unit gives each sample's unpadded). Stage 1 caches each
    # sample's cut after its mask's last 1; batches pad them all (masks with 0) to the batch's
    # longest, one length for all; the cache batches samples of any such length together.
    sequence_params: ClassVar[Mapping[str, str | None]] = {}

    def __init__(self, config: SplitstageConfig):
        self.config = config
        task = config.train.task
        if task not in self.tasks:
            raise ConfigError(
                f"train.task={task!r}: the {self.name} family trains "
                f"{', '.join(map(repr, self.tasks))}; set train.task to one of them"
            )

    # -- units and the splitter's view ---------------------------------------------------------
    def units(self) -> list[RunnableUnit]:
        """The pipeline's units in order, each a DiffSynth-style declaration plus its function."""
        raise NotImplementedError

    def pipeline_spec(self) -> Pipeline:
        """What the splitter sees: units, model_fn / loss / step params, in-iteration models."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """Every `[pipeline]` setting, for the units and the training step."""
        return self.config.pipeline.settings()

    def stage1_settings(self) -> dict[str, Any]:
        """The settings that change stage-1 outputs: the cache key takes exactly these."""
        return self.config.pipeline.stage1_settings()

    # -- data ------------------------------------------------------------------------------------
    @classmethod
    def check_references(cls, config: SplitstageConfig, rows: Iterable[Row]) -> None:
        """Refuse, before stage 1, rows whose reference images this job cannot train (one line);
        default: against `reference_images` (a family whose rule depends on its settings
        overrides this)."""
        rule = cls.reference_images
        check_reference_rows(rows, rule, config.pipeline.name, reference_takers)

    def most_references(self) -> int:
        """How many reference images this job's rows may carry at most (the memory plan sizes
        its sample by it); 0 for a family that takes none."""
        rule = self.reference_images
        return rule.most if rule is not None else 0

    def longest_prompt(self, row: Row, base_path: str | Path | DataSource) -> str:
        """The longest head of the row's prompt this family takes (the memory plan's prompt);
        the whole prompt where longer ones are cut to the limit, as the text units do."""
        return row.prompt

    def load_sample(self, row: Row, base_path: str | Path | DataSource) -> dict[str, Any]:
        """What one data row becomes: the pipeline inputs of one sample (tensors and values).
        `base_path` is the data set's opened DataSource (stages 1 and 2 pass it, opened once)
        or its folder/URL; the data room's loaders take either."""
        raise NotImplementedError

    def image_resolution(self) -> tuple[int, int] | None:
        """(square side, multiple every side must be) of the images, or None if the family takes
        no images of a chosen size (then `[data.buckets]` is refused)."""
        return None

    @cached_property
    def buckets(self) -> Buckets | None:
        """The `[data.buckets]` sizes for this family's resolution, or None when off."""
        config = self.config.data.buckets
        if not config.enabled:
            return None
        resolution = self.image_resolution()
        if resolution is None:
            raise ConfigError(
                f"data.buckets: the {self.name!r} family does not take images of a chosen size; "
                "remove [data.buckets]"
            )
        try:
            return Buckets(config, *resolution)
        except BucketError as error:
            raise ConfigError(str(error)) from None

    def image_size(self) -> int | tuple[int, int] | SizeRule:
        """The size load_sample crops images to: the square, or each image's bucket."""
        buckets = self.buckets
        return buckets.size_for if buckets else self.image_resolution()[0]

    # -- models ----------------------------------------------------------------------------------
    def model_source(self, name: str) -> ModelConfig:
        """The `[models.NAME]` entry (a family may give defaults)."""
        if name in self.config.models:
            return self.config.models[name]
        raise ConfigError(
            f"model '{name}' has no [models.{name}] entry; add weights = "
            f"'path/to/{name}.safetensors'"
        )

    def check_models(self, names: Sequence[str]) -> None:
        """Every named model is the family's and has a usable source (checked before launch)."""
        for name in names:
            self.require_known(name)
            source = self.model_source(name)
            if source.weights is not None:
                require_file(source.weights, f"models.{name}.weights")

    def check_component_shapes(self) -> None:
        """The widths the job's models hand each other agree (config reads only, no weights):
        a text encoder or VAE from another model is refused before anything runs."""

    def require_known(self, name: str) -> None:
        """A one-line error for a model name this family does not have."""
        if name not in self.model_names:
            raise ConfigError(
                f"models.{name}: the {self.name} pipeline has no model '{name}'; its models are "
                f"{', '.join(self.model_names)}"
            )

    def fingerprint_source(self, name: str) -> str | dict[str, Any]:
        """What identifies a model's weights: a file (hashed by content) or a JSON payload
        (whose "files" list, if any, is replaced by the files' content hashes)."""
        source = self.model_source(name)
        if source.weights:
            require_file(source.weights, f"models.{name}.weights")
            if is_index_path(source.weights):  # the shards' content, not just the index's
                return {"files": [source.weights, *index_shard_paths(source.weights)]}
            return source.weights
        return {"builder": source.builder, "seed": self.config.job.seed}

    def weights_file(self, name: str) -> tuple[str, str] | None:
        """(path, key prefix) of the one file stage 2 loads `name`'s slices from after sharding;
        None when the model is built loaded (then it is parallelized after loading)."""
        source = self.model_source(name)
        return (source.weights, source.key_prefix) if source.weights else None

    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        """Build one model: loaded and frozen, or with meta=True on the meta device (no weights)."""
        raise NotImplementedError

    def loaded_dtype(self, name: str) -> torch.dtype | None:
        """The dtype `build_model(name, device)` holds a frozen model's floating weights in, for
        plans that build it on meta instead (None: as the meta build makes it)."""
        return None

    def init_buffers(self, model: nn.Module) -> None:
        """Recompute non-persistent buffers (positional tables) that `to_empty` left as garbage."""
        for module in model.modules():
            init = getattr(module, "init_non_persistent_buffers", None)
            if callable(init):
                with torch.no_grad():
                    init()

    # -- the training step (one definition, every trainer) ----------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Draw the step params (written into `inputs`), the denoiser's inputs and the target."""
        raise NotImplementedError

    def denoise(self, ctx: StepContext, step: TrainingStep) -> torch.Tensor:
        """The denoiser's prediction for a step (PP runs the same args through its stages)."""
        return ctx.model(self.denoiser, "model_fn")(*step.denoiser_args, **step.denoiser_kwargs)

    def loss(self, prediction: torch.Tensor, step: TrainingStep) -> torch.Tensor:
        """The training loss of a prediction (float32 MSE, weighted per sample if the step says)."""
        if step.weight is None:
            return F.mse_loss(prediction.float(), step.target.float())
        error = F.mse_loss(prediction.float(), step.target.float(), reduction="none")
        per_sample = error.flatten(1).mean(1)
        return (per_sample * step.weight.to(per_sample)).mean()

    def training_loss(self, ctx: StepContext, inputs: dict[str, Any]) -> torch.Tensor:
        """The whole step: step params, denoiser, loss (what DDP / FSDP / TP trainers call)."""
        step = self.training_step(ctx, inputs)
        return self.loss(self.denoise(ctx, step), step)

    # -- optional hooks ---------------------------------------------------------------------------
    def lora_targets(self, name: str) -> list[str]:
        """Module names LoRA adapts in `name`: the config's, else the family's defaults."""
        return list(self.config.trainable.lora_target_modules or self.default_lora_targets)

    def check_gradient_checkpointing(self, name: str) -> None:
        """Refuse, before launch, `train.gradient_checkpointing` for a trained model this family
        cannot recompute (default: every model); reads the config only, builds nothing."""
        raise ConfigError(
            f"train.gradient_checkpointing: the {self.name} family cannot recompute the "
            f"activations of '{name}'; set train.gradient_checkpointing = false"
        )

    def enable_gradient_checkpointing(self, name: str, model: nn.Module) -> None:
        """Make the trained `model` recompute its activations in backward instead of keeping
        them. Stage 2 calls it before sharding (so it composes with FSDP2 / TP, as torchtitan
        applies its checkpoint wrappers before `fully_shard`). Default: refuse (one line)."""
        self.check_gradient_checkpointing(name)
        raise NotImplementedError(
            f"the {self.name} family checks gradient checkpointing of '{name}' but does not "
            "enable it"
        )

    def native_weight_dtype(self, name: str) -> torch.dtype | None:
        """The dtype the family's own settings hold `name`'s weights in (what `train.weight_dtype
        = 'auto'` keeps for its frozen base), or None: 'auto' is then the compute dtype."""
        return None

    def tp_plan(self, name: str) -> Mapping[str, str] | None:
        """Tensor-parallel plan (FQN pattern -> 'colwise' / 'rowwise') for a model, if any."""
        return self.tp_plans.get(name)

    def tp_prepare(self, model: nn.Module, tp_degree: int) -> None:
        """Adjust a model after tensor-parallel sharding (e.g. per-rank head counts)."""

    def pp_module_fqns(self, model: nn.Module) -> list[str]:
        """The denoiser's top-level module FQNs in forward order, for pipeline-parallel stages."""
        raise ConfigError(
            f"train.parallelism='pp': the {self.name} family gives no pipeline-parallel module "
            "order; use 'ddp', 'fsdp' or 'tp'"
        )

    def pp_prune(self, model: nn.Module, keep_fqns: Sequence[str]) -> nn.Module:
        """Delete the denoiser's modules outside one stage, in place (FQNs stay global)."""
        raise ConfigError(f"the {self.name} family cannot prune its denoiser into PP stages")

    def pp_stage_has_work(self, fqns: Sequence[str]) -> bool:
        """Whether a stage holding these modules does real work (holds a repeated block)."""
        return True

    def export_key(self, model_name: str, key: str) -> str:
        """The key an exported tensor gets: `pipe.<model>.<param>` as DiffSynth names it."""
        return f"pipe.{model_name}.{key}"

    def export_metadata(self, model_name: str, lora: bool) -> dict[str, str]:
        """Extra safetensors metadata of an exported model (e.g. its architecture)."""
        return {}

    def check_export(self, model_name: str, request: ExportRequest, keys: Sequence[str]) -> None:
        """Refuse before launch (one ConfigError line) what `export_files` could not write as
        asked; `keys`: the trained parameters' names (LoRA: `<module>.lora_A.weight` for every
        module). Default: any model; remove_prefix_in_ckpt must start some exported key."""
        prefix = request.remove_prefix
        names = [self.export_key(model_name, key) for key in keys]
        if prefix and names and not any(name.startswith(prefix) for name in names):
            raise ConfigError(
                f"output.remove_prefix_in_ckpt = {prefix!r} starts none of the keys {model_name} "
                f"exports (e.g. {names[0]!r}), so it would remove nothing; use a prefix they "
                f"start with, e.g. {self.export_key(model_name, '')!r}, or remove it"
            )

    def export_files(
        self, model_name: str, state: dict[str, torch.Tensor], request: ExportRequest
    ) -> dict[str, tuple[str, bytes]]:
        """The files one trained model exports: {label: (file name, bytes)}.

        Default: `<model>[_lora].safetensors`, keys `pipe.<model>.<param>` (DiffSynth's layout)
        minus `remove_prefix_in_ckpt`; `state` has peft's adapter name already removed.
        """
        from safetensors.torch import save

        tensors = {}
        for key, tensor in state.items():
            if request.lora and "lora_" not in key:
                continue
            full = self.export_key(model_name, key)
            if request.remove_prefix and full.startswith(request.remove_prefix):
                full = full[len(request.remove_prefix) :]
            tensors[full] = tensor.detach().contiguous()
        meta = {"format": "pt", "model": model_name, "lora": str(request.lora).lower()}
        meta.update(self.export_metadata(model_name, request.lora))
        if request.lora:
            meta.update(lora_rank=str(request.rank), lora_alpha=f"{request.alpha:g}")
        name = f"{model_name}_lora.safetensors" if request.lora else f"{model_name}.safetensors"
        return {model_name: (name, save(tensors, metadata=meta))}

    # -- validation sampling ----------------------------------------------------------------------
    def prompt_units(self) -> list[RunnableUnit]:
        """The units that encode prompts alone (they read only `prompt`): what conditions a
        sample, run in stage 1 for validation prompts (or in stage 2 when their model trains)."""
        return [unit for unit in self.units() if set(unit.spec.inputs) == {"prompt"}]

    def prompt_models(self) -> list[str]:
        """The models the prompt units call."""
        return sorted({m for unit in self.prompt_units() for m in unit.spec.onload_model_names})

    def prompt_conditioning(
        self, ctx: StepContext, prompts: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """The prompt units' tensor outputs for `prompts` (empty-prompt copies left out)."""
        inputs: dict[str, Any] = {"prompt": list(prompts)}
        run_units(self.prompt_units(), ctx, inputs)
        return {
            name: value
            for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and not name.startswith("empty_")
        }

    def reference_units(self) -> list[RunnableUnit]:
        """The units that encode reference images alone (they read only `reference_image`):
        the reference step stage 1 runs on `validation.reference_images`."""
        return [unit for unit in self.units() if set(unit.spec.inputs) == {"reference_image"}]

    def reference_models(self) -> list[str]:
        """The models `reference_conditioning` calls; ConfigError (one line) when the family
        cannot condition samples on reference images (checked before launch)."""
        rule, units = self.reference_images, self.reference_units()
        if rule is None:
            names = ", ".join(map(repr, reference_takers())) or "none is registered"
            raise ConfigError(
                f"validation.reference_images: the {self.name} family takes no reference "
                "images; remove validation.reference_images or set pipeline.name to a family "
                f"that does ({names})"
            )
        if rule.most != 1 or not units:
            raise ConfigError(
                f"validation.reference_images: the {self.name} family cannot sample with "
                "reference images yet; remove validation.reference_images"
            )
        return sorted({m for unit in units for m in unit.spec.onload_model_names})

    def validation_reference(self, image: Any, target: tuple[int, int]) -> Any:
        """One decoded `validation.reference_images` file (PIL) as `reference_conditioning`
        takes it beside a `target` (height, width) sample. Default: [3, H, W] in [-1, 1] at
        `reference_images`' size (cropped to it, as training crops to the bucket); a family
        whose pipeline sizes references from the image itself overrides this."""
        rule = self.reference_images or ReferenceImages()
        height, width = rule.size((image.height, image.width), target)
        return image_to_tensor(center_crop_resize(image, height, width))

    def reference_conditioning(
        self,
        ctx: StepContext,
        images: Sequence[Sequence[Any]],
        prompts: Sequence[str],
    ) -> dict[str, torch.Tensor]:
        """What each prompt seen with its reference images (as `validation_reference` gives
        them: [3, H, W] in [-1, 1] by default) conditions on, merged over
        `prompt_conditioning(prompts)` (called for the prompts and for their negatives).
        Default: one image per prompt, stacked as `reference_image` through `reference_units`
        (the prompts unused); a family taking several, or encoding the prompt with the image,
        overrides this and `reference_models`."""
        self.reference_models()  # refuses what the default cannot encode
        inputs: dict[str, Any] = {"reference_image": torch.stack([one for (one,) in images])}
        run_units(self.reference_units(), ctx, inputs)
        return {
            name: value
            for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and name != "reference_image"
        }

    default_guidance: ClassVar[float] = 1.0  # validation.guidance_scale when not given

    def check_sampling(self) -> None:
        """Refuse, before launch, validation sampling this family cannot do."""
        raise ConfigError(
            f"validation.prompts: the {self.name} family cannot sample yet; remove the "
            "[validation] prompts"
        )

    def load_decoder(self, device: torch.device) -> nn.Module:
        """The model that turns latents into images (loaded only to sample)."""
        raise NotImplementedError(f"the {self.name} family has no decoder to sample with")

    def decode(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] in [-1, 1]."""
        raise NotImplementedError(f"the {self.name} family has no decoder to sample with")

    def decode_clips(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor | None:
        """Latents -> clips [B, F, 3, H, W] in [-1, 1] for a video family; None: it samples
        images (validation then calls `decode`)."""
        return None

    def sample(
        self,
        ctx: StepContext,
        cond: dict[str, torch.Tensor],
        uncond: dict[str, torch.Tensor],
        generator: torch.Generator,
        *,
        steps: int,
        guidance: float,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Latents for each row of `cond` (guided away from `uncond`), from seeded noise, of
        images `size` = (height, width) pixels (None: the square resolution, see sample_size);
        every rank calls it alike (a sharded denoiser's forward is collective)."""
        raise NotImplementedError(f"the {self.name} family has no sampler yet")

    def sample_size(self, size: tuple[int, int] | None = None) -> tuple[int, int]:
        """(height, width) pixels a sample is drawn at: `size`, or the square resolution."""
        if size is not None:
            return int(size[0]), int(size[1])
        resolution = self.image_resolution()
        if resolution is None:
            raise ConfigError(f"the {self.name} family has no image resolution to sample at")
        return resolution[0], resolution[0]


def input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's inputs are cast to: its frozen weights' (a LoRA's base, held in
    train.weight_dtype while the adapters stay fp32), else its first parameter's."""
    first = None
    for param in model.parameters():
        if not param.is_floating_point():
            continue
        if not param.requires_grad:
            return param.dtype
        first = first or param.dtype
    return first or torch.float32


def library_checkpointing(model: nn.Module) -> bool:
    """Turn on a diffusers or transformers model's own gradient checkpointing (non-reentrant
    `torch.utils.checkpoint` around each block); False when the model has no such switch."""
    if getattr(model, "_supports_gradient_checkpointing", False) and hasattr(
        model, "enable_gradient_checkpointing"
    ):  # diffusers' ModelMixin
        model.enable_gradient_checkpointing()
        return True
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(
        model, "gradient_checkpointing_enable"
    ):  # transformers' PreTrainedModel
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return True
    return False


def index_shard_paths(index_path: str) -> list[str]:
    """The shard files a `*.safetensors.index.json` lists (beside it), for fingerprinting."""
    try:
        weight_map = index_weight_map(Path(index_path).read_bytes())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{index_path}: {error}") from None
    return [str(Path(index_path).parent / shard) for shard in sorted(set(weight_map.values()))]


def require_file(path: str, field_name: str, hint: str = "fix the path") -> None:
    """A clear error for a weights file that is not there."""
    if not Path(path).is_file():
        raise ConfigError(f"{field_name}: file {path} does not exist; {hint}")


@cache
def family_class(name: str) -> type[Family]:
    """The Family subclass of family `name` (imports its heavy dependencies now)."""
    group = config_class(name)
    return import_object(group.family_class)


def family_for(config: SplitstageConfig) -> Family:
    """The family the job's `[pipeline] name` picks, bound to the job config."""
    return family_class(config.pipeline.name)(config)


def reference_takers() -> list[str]:
    """The registered families that take reference images (imports each: for messages only)."""
    from splitstage.config.families import family_names

    takers = []
    for name in family_names():
        try:
            if family_class(name).reference_images is not None:
                takers.append(name)
        except Exception:  # noqa: BLE001 - a family whose extra is not installed takes none here
            continue
    return takers


def check_family_rows(config: SplitstageConfig, rows: Iterable[Row]) -> None:
    """The rows' reference images against the family's rule (before stage 1)."""
    family_class(config.pipeline.name).check_references(config, rows)
