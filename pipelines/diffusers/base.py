"""What the diffusers families share: the folder, the VAE units, caption dropout, models, export.

Units every family has (its prompt encoder unit comes first, from the family):
- VAEEncoder (V2): the VAE's latent distribution (mean, log-variance) of each image;
- LatentSampler (per step): a fresh latent from that distribution, shifted and scaled as the VAE
  config says, so split training draws new VAE noise every step exactly as unsplit training does;
- CaptionDropout (per step): each prompt's embeddings swapped for the empty prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.data.dataset import Row, load_sample
from splitstage.pipelines.diffusers.component_export import (
    LORA_COMPONENTS,
    component_folder_files,
    lora_files,
)
from splitstage.pipelines.diffusers.component_shapes import ShapeLink, check_component_shapes
from splitstage.pipelines.diffusers.components import (
    build_empty,
    component_class,
    init_buffers,
    load_frozen,
)
from splitstage.pipelines.diffusers.folder import PipelineFolder
from splitstage.pipelines.diffusers.sampling import vae_decode
from splitstage.pipelines.diffusers.text import load_tokenizer, tokenizer_folder
from splitstage.pipelines.family import (
    ExportRequest,
    Family,
    TrainingStep,
    input_dtype,
    library_checkpointing,
)
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Pipeline, Unit

STEP_PARAMS = ("latents", "timestep", "noise")
CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
T5_LORA_TARGETS = ("q", "k", "v", "o")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def encode_images(ctx: StepContext, image: torch.Tensor) -> dict[str, Any]:
    """The VAE's latent distribution of each image: its mean and log-variance (or the mean), in
    the VAE's dtype (pipeline.precision), as unsplit training computes them."""
    vae = ctx.model("vae", "VAEEncoder")
    dtype = next(vae.parameters()).dtype
    dist = vae.encode(image.to(ctx.device, dtype)).latent_dist
    if ctx.settings["vae_latents"] == "mean":
        return {"latent_mean": dist.mean}
    return {"latent_mean": dist.mean, "latent_logvar": dist.logvar}


def draw_latent(
    ctx: StepContext, latent_mean: torch.Tensor, latent_logvar: torch.Tensor | None
) -> torch.Tensor:
    """A float32 draw from the cached latent distribution (its mean when only that is cached),
    as diffusers' DiagonalGaussianDistribution.sample clamps and draws."""
    z = latent_mean.float()
    if latent_logvar is not None:
        std = torch.exp(0.5 * latent_logvar.float().clamp(-30.0, 20.0))
        z = z + std * ctx.draws.randn(z.shape, device=z.device)
    return z


def make_latent_sampler(scaling: float, shift: float):
    """A per-step unit function: draw a latent, then (z - shift_factor) * scaling_factor."""

    def sample_latents(
        ctx: StepContext, latent_mean: torch.Tensor, latent_logvar: torch.Tensor | None = None
    ) -> dict[str, Any]:
        return {"input_latents": (draw_latent(ctx, latent_mean, latent_logvar) - shift) * scaling}

    return sample_latents


def drop_captions(ctx: StepContext, **params: torch.Tensor) -> dict[str, Any]:
    """Per step, swap each sample's prompt embeddings for the empty prompt's (all encoders)."""
    chance = ctx.settings["caption_dropout"]
    names = [name for name in params if not name.startswith("empty_")]
    count = params[names[0]].shape[0]
    draw = ctx.draws.rand(count)
    out = {}
    for name in names:
        value, empty = params[name], params[f"empty_{name}"]
        drop = (draw < chance).to(value.device).reshape(-1, *([1] * (value.ndim - 1)))
        out[name] = torch.where(drop, empty.to(value), value)
    return out


class DiffusersFamily(Family):
    """A diffusers pipeline folder trained split: components by diffusers' names."""

    pipeline_classes: ClassVar[tuple[str, ...]]  # model_index.json _class_name values it trains
    text_params: ClassVar[tuple[str, ...]]  # the prompt encoder unit's outputs (all dropped)
    text_models: ClassVar[tuple[str, ...]]  # the encoders its prompt unit calls
    denoiser_params: ClassVar[tuple[str, ...]]  # model_fn's params besides latents/timestep
    shape_links: ClassVar[tuple[ShapeLink, ...]] = ()  # widths its components hand each other
    lora_layout: ClassVar[str] = ""  # the LoRA file layout it writes (lora_export); "": its name

    # -- the folder ------------------------------------------------------------------------------
    @cached_property
    def folder(self) -> PipelineFolder:
        """The pretrained folder with the `[models.<component>]` overrides applied."""
        return PipelineFolder(
            self.config.pipeline.pretrained, dict(self.config.models), self.pipeline_classes
        )

    @cached_property
    def vae_config(self) -> dict[str, Any]:
        """The VAE's config.json (scaling and shift factors)."""
        return self.folder.config("vae")

    @cached_property
    def scheduler_config(self) -> dict[str, Any]:
        """scheduler/scheduler_config.json (the training schedule comes from it)."""
        return self.folder.config("scheduler")

    @cached_property
    def tokenizers(self) -> dict[str, Any]:
        """Each text encoder's tokenizer, loaded on first use."""
        return {}

    def tokenizer(self, encoder: str) -> Any:
        """The tokenizer of `encoder` (text_encoder -> tokenizer/, text_encoder_2 -> ...)."""
        if encoder not in self.tokenizers:
            self.tokenizers[encoder] = load_tokenizer(self.folder.root, encoder)
        return self.tokenizers[encoder]

    # -- units -----------------------------------------------------------------------------------
    def prompt_encoders(self) -> tuple[str, ...]:
        """The encoders the prompt unit calls (SD3 without T5 calls fewer)."""
        return self.text_models

    def text_unit(self) -> RunnableUnit:
        """`PromptEncoder`: `text_params` of each prompt and of the empty prompt (`empty_*`, for
        caption dropout), from the family's `encode_prompts`."""
        empty = tuple(f"empty_{p}" for p in self.text_params)
        return RunnableUnit(
            Unit(
                "PromptEncoder",
                input_params_posi={"prompt": "prompt"},
                output_params=(*self.text_params, *empty),
                onload_model_names=self.prompt_encoders(),
            ),
            self.encode_prompts,
        )

    pixel_param = "image"  # the sample field the VAE encodes ("video" for clips)

    def pixel_encoder(self):
        """The V2 function giving the VAE's latent distribution of `pixel_param`'s pixels."""
        return encode_images

    def latent_sampler(self):
        """The per-step function drawing training latents from the cached distribution:
        (z - shift_factor) * scaling_factor, refused without a scaling_factor."""
        if not self.vae_config.get("scaling_factor"):
            raise ConfigError(
                f"pipeline.pretrained: {self.folder.root}/vae/config.json has no scaling_factor; "
                "add the one the model was trained with (SD 0.18215, SDXL 0.13025, SD3 1.5305, "
                "FLUX 0.3611), else latents would be silently mis-scaled"
            )
        scaling = float(self.vae_config["scaling_factor"])
        shift = float(self.vae_config.get("shift_factor") or 0.0)
        return make_latent_sampler(scaling, shift)

    def units(self) -> list[RunnableUnit]:
        """Prompt encoding, VAE encoding, per-step latent sampling and caption dropout."""
        mean_only = self.config.pipeline.vae_latents == "mean"
        latent_params = ("latent_mean",) if mean_only else ("latent_mean", "latent_logvar")
        sampler = self.latent_sampler()
        empty = tuple(f"empty_{p}" for p in self.text_params)
        return [
            self.text_unit(),
            RunnableUnit(
                Unit(
                    "VAEEncoder",
                    (self.pixel_param,),
                    output_params=latent_params,
                    onload_model_names=("vae",),
                ),
                self.pixel_encoder(),
            ),
            RunnableUnit(
                Unit(
                    "LatentSampler",
                    latent_params,
                    output_params=("input_latents",),
                    per_step=True,
                ),
                sampler,
            ),
            RunnableUnit(
                Unit(
                    "CaptionDropout",
                    self.text_params + empty,
                    output_params=self.text_params,
                    per_step=True,
                ),
                drop_captions,
            ),
        ]

    def pipeline_spec(self) -> Pipeline:
        """Units, the denoiser's inputs, the loss's inputs, the step params."""
        return Pipeline(
            name=self.name,
            units=tuple(unit.spec for unit in self.units()),
            model_fn_params=("latents", "timestep", *self.denoiser_params),
            loss_params=("input_latents",),
            in_iteration_models=(self.denoiser,),
            step_params=STEP_PARAMS,
        )

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The image cropped to `resolution` square (or its aspect bucket) and its prompt."""
        return load_sample(row, base_path, self.image_size())

    def image_resolution(self) -> tuple[int, int]:
        """`resolution`, and the multiple the VAE and the denoiser's patching need."""
        return self.config.pipeline.resolution, self.config.pipeline.pixel_multiple

    # -- models ----------------------------------------------------------------------------------
    def check_models(self, names: Sequence[str]) -> None:
        """Every named component is the family's and is in the folder (or its override)."""
        for name in names:
            self.require_known(name)
            self.folder.component(name)

    def check_component_shapes(self) -> None:
        """`shape_links` over the folder's config files (overrides included)."""
        check_component_shapes(self.shape_links, self.folder.has, self.folder.config)

    def fingerprint_source(self, name: str) -> dict[str, Any]:
        """Class, config and weights files (hashed by content, memoized) of a component."""
        component = self.folder.component(name)
        files = [str(path) for path in component.weight_files()]
        if name.startswith("text_encoder"):  # its tokenizer decides the embeddings too
            files += [str(p) for p in self.tokenizer_files(name)]
        return {
            "class": f"{component.library}.{component.class_name}",
            "config": self.folder.config(name),
            "files": files,
        }

    def tokenizer_files(self, encoder: str) -> list[Path]:
        """Every file of an encoder's tokenizer folder (vocab, merges, tokenizer.json, ...)."""
        folder = tokenizer_folder(self.folder.root, encoder)
        return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []

    def weights_file(self, name: str) -> tuple[str, str] | None:
        """The component's safetensors file or sharded index, as diffusers saved it."""
        return str(self.folder.component(name).weights), ""

    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        """A component on meta (stage 2 loads its slices), or loaded and frozen."""
        self.require_known(name)
        component = self.folder.component(name)
        if meta:
            return build_empty(component)
        return load_frozen(component, device, DTYPES[self.config.pipeline.precision])

    def loaded_dtype(self, name: str) -> torch.dtype:
        """`pipeline.precision`, which `load_frozen` casts every component to."""
        return DTYPES[self.config.pipeline.precision]

    def init_buffers(self, model: nn.Module) -> None:
        """CLIP's position ids and T5's tied embeddings, after `to_empty`."""
        init_buffers(model)

    # -- the training step -----------------------------------------------------------------------
    def denoise(self, ctx: StepContext, step: TrainingStep) -> torch.Tensor:
        """The denoiser's prediction (diffusers models return a tuple with return_dict=False)."""
        model = ctx.model(self.denoiser, "model_fn")
        return model(*step.denoiser_args, **step.denoiser_kwargs, return_dict=False)[0]

    def denoiser_dtype(self, ctx: StepContext) -> torch.dtype:
        """The dtype the denoiser's inputs are cast to (its frozen weights', see input_dtype)."""
        return input_dtype(ctx.model(self.denoiser, "model_fn"))

    # -- validation sampling ---------------------------------------------------------------------
    def check_sampling(self) -> None:
        """The VAE (its decoder) is in the folder."""
        self.folder.component("vae")

    def load_decoder(self, device: torch.device) -> nn.Module:
        """The folder's VAE, loaded only to decode samples."""
        return self.build_model("vae", device)

    def decode(self, decoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Latents (shifted and scaled as trained) -> images in [-1, 1]."""
        return vae_decode(self, decoder, latents)

    # -- hooks -----------------------------------------------------------------------------------
    def check_gradient_checkpointing(self, name: str) -> None:
        """The component's class has diffusers' (or transformers') checkpointing switch (the
        UNet, the SD3 / FLUX transformers, CLIP and T5 all do)."""
        cls = component_class(self.folder.component(name))
        if not (
            getattr(cls, "_supports_gradient_checkpointing", False)
            or getattr(cls, "supports_gradient_checkpointing", False)
        ):
            raise ConfigError(
                f"train.gradient_checkpointing: {cls.__name__} ('{name}' of the {self.name} "
                "family) has no gradient checkpointing; set train.gradient_checkpointing = false"
            )

    def enable_gradient_checkpointing(self, name: str, model: nn.Module) -> None:
        """The model's own switch (`enable_gradient_checkpointing()` / transformers'
        `gradient_checkpointing_enable`), non-reentrant checkpoints around each block."""
        self.check_gradient_checkpointing(name)
        if not library_checkpointing(model):
            raise ConfigError(
                f"train.gradient_checkpointing: {type(model).__name__} ('{name}') has no "
                "gradient checkpointing switch; set train.gradient_checkpointing = false"
            )

    def lora_targets(self, name: str) -> list[str]:
        """The config's targets, else the usual ones of the model: the denoiser's, CLIP's
        attention (q/k/v/out_proj) or T5's (q/k/v/o), as diffusers' training examples adapt."""
        if self.config.trainable.lora_target_modules or not name.startswith("text_encoder"):
            return super().lora_targets(name)
        t5 = self.folder.component(name).class_name.startswith("T5")
        return list(T5_LORA_TARGETS if t5 else CLIP_LORA_TARGETS)

    def pp_module_fqns(self, model: nn.Module) -> list[str]:
        """Top-level modules in forward order (the transformer families give theirs)."""
        return super().pp_module_fqns(model)

    def pp_prune(self, model: nn.Module, keep_fqns: Sequence[str]) -> nn.Module:
        """Not yet: a diffusers denoiser's forward cannot run a slice of its blocks."""
        raise ConfigError(
            f"train.parallelism='pp' cannot run the {self.name} {self.denoiser} yet (its "
            "diffusers forward runs every block); use 'ddp', 'fsdp' or 'fsdp+tp'"
        )

    def check_export(self, model_name: str, request: ExportRequest, keys: Sequence[str]) -> None:
        """A LoRA only of a component diffusers' and kohya's layouts hold; no key prefix to
        remove: both LoRA layouts and a save_pretrained folder are read with their keys as
        written (`pipe.load_lora_weights`, ComfyUI, `from_pretrained`)."""
        if request.remove_prefix:
            raise ConfigError(
                f"output.remove_prefix_in_ckpt = {request.remove_prefix!r}: the {self.name} "
                "family exports diffusers' layouts (a LoRA as pytorch_lora_weights.safetensors "
                "and a kohya file, full weights as a save_pretrained folder), whose loaders need "
                "the keys as written; remove output.remove_prefix_in_ckpt"
            )
        if not request.lora:
            return
        components = LORA_COMPONENTS.get(self.name, (self.denoiser,))
        exportable = [name for name in components if name in self.model_names]
        if model_name not in exportable:
            raise ConfigError(
                f"trainable.lora_base_model = {model_name!r}: the {self.name} family exports a "
                f"LoRA only of {', '.join(exportable)} (the components diffusers' and kohya's "
                "LoRA files hold); set trainable.lora_base_model to one of them"
            )

    def export_files(
        self, model_name: str, state: dict[str, torch.Tensor], request: ExportRequest
    ) -> dict[str, tuple[str, bytes]]:
        """LoRA: diffusers' pytorch_lora_weights.safetensors and a kohya file; full: the
        component folder as save_pretrained writes it."""
        if not request.lora:
            return component_folder_files(self.folder.component(model_name), state)
        v_prediction = self.scheduler_config.get("prediction_type") == "v_prediction"
        return lora_files(
            self.lora_layout or self.name,
            model_name,
            state,
            request,
            base_model=self.folder.root.name,
            resolution=self.config.pipeline.resolution,
            output_name=self.config.job.name,
            v2=self.name == "sd" and v_prediction,
        )
