"""Qwen-Image-Edit: Qwen-Image's models and flow matching, conditioned on each row's references.

As QwenImageEditPipeline / QwenImageEditPlusPipeline (diffusers 0.42) do, and all in stage 1:
Qwen2.5-VL encodes the prompt with the reference images (its edit template; Plus labels each
"Picture n:" and sees them at CONDITION_IMAGE_SIZE, the single-image pipeline at the VAE size);
each reference is resized to its own aspect ratio at about `reference_max_pixels`
(calculate_dimensions: sides multiples of 32) and VAE-encoded to its normalised mode. Stage 2
packs the reference latents after the noisy latents along the sequence, with their own
img_shapes entries, and cuts the prediction back to the target's tokens; it never opens an
image. The model_index's pipeline class decides Edit (one reference) or Plus (up to three).
References sized on their own may differ in shape between rows: the cache's shape groups keep
such rows in separate batches (each reference slot is its own cached tensor; an absent one is
an empty tensor). Validation samples need `validation.reference_images` (Plus: up to three per
prompt): stage 1 encodes each prompt and its negative with its images as the pipeline does (its
true CFG sees the negative with the same images) and their latents, sized as above.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.data.dataset import DataError, Row, read_image_bytes, reference_row
from splitstage.data.images import image_to_tensor, open_image
from splitstage.data.references import ReferenceImages
from splitstage.data.source import source_for
from splitstage.pipelines.diffusers.qwenimage import QwenImageFamily
from splitstage.pipelines.diffusers.qwenimage_edit_sampling import edit_sample
from splitstage.pipelines.diffusers.qwenimage_edit_text import (
    check_edit_template,
    encode_prompt,
    load_processor,
    pad_prompts,
    token_count,
    too_long,
)
from splitstage.pipelines.diffusers.qwenimage_latents import pack
from splitstage.pipelines.diffusers.wan_vae_norm import normalise
from splitstage.pipelines.family import TrainingStep
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Unit

PLUS = "QwenImageEditPlusPipeline"
MOST = 3  # references a Plus row takes (Qwen-Image-Edit-2509 is made for one to three)
SLOTS = ("reference_latents", "reference_latents_2", "reference_latents_3")
NEEDS_REFERENCES = (
    "validation.reference_images: the qwenimage_edit family samples only beside reference "
    "images; give each of validation.prompts its image(s) in validation.reference_images"
)


def reference_sizes(image, plus: bool, vae_area: int, condition_area: int):
    """((height, width) for the VAE, (height, width) for Qwen2.5-VL) of a PIL reference, as the
    pipeline computes them (calculate_dimensions; the single-image pipeline's VL sees the VAE's)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    ratio = image.width / image.height
    vae_w, vae_h = calculate_dimensions(vae_area, ratio)
    cond_w, cond_h = calculate_dimensions(condition_area, ratio) if plus else (vae_w, vae_h)
    return (vae_h, vae_w), (cond_h, cond_w)


def as_rgb8(image):
    """An 8-bit RGB PIL image (what the pipeline resizes): a float "F" image (a 16-bit or float
    file, in [0, 1]) rounded to 8 bits as image_to_tensor maps it, never clipped to black."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    pixels = ((image_to_tensor(image) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy(), "RGB")


def _stacked(value) -> torch.Tensor:
    """A batch's tensor: stacked when units gave per-sample lists (unsplit runs)."""
    return torch.stack(list(value)) if isinstance(value, list | tuple) else value


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit and Qwen-Image-Edit-2509 (QwenImageEdit(Plus)Pipeline folders)."""

    name = "qwenimage_edit"
    lora_layout = "qwenimage"  # the edit transformer has Qwen-Image's module names: the same files
    pipeline_classes = ("QwenImageEditPipeline", PLUS)
    tasks = ("sft",)
    fake_steps = False
    no_fake_steps_because = (
        "Qwen2.5-VL finds the images' tokens in the prompt by value (nonzero), which fake "
        "tensors cannot; size a run from its first steps' peak instead"
    )
    shape_links = QwenImageFamily.shape_links  # the same parts hand each other the same widths
    # Sized on their own (the config's reference_max_pixels): the cache groups by their shape.
    reference_images = ReferenceImages(
        required=True, most=MOST, max_pixels=1024 * 1024, multiple=32
    )

    @property
    def plus(self) -> bool:
        """Whether the folder is QwenImageEditPlusPipeline's (several labelled references)."""
        return self.folder.index.get("_class_name") == PLUS

    @property
    def reference_slots(self) -> tuple[str, ...]:
        """The cached reference params: one per reference a row may have."""
        return SLOTS if self.plus else SLOTS[:1]

    def longest_prompt(self, row: Row, base_path: str | Path) -> str:
        """The longest head (whole words) of the row's prompt that fits max_prompt_length with
        the row's references (a longer one is refused, not cut: see `load_sample`)."""
        words = row.prompt.split()
        low, high = 0, len(words)
        while low < high:  # the most words that still load
            middle = (low + high + 1) // 2
            try:
                self.load_sample(replace(row, prompt=" ".join(words[:middle])), base_path)
                low = middle
            except ConfigError as error:
                if not str(error).startswith("pipeline.max_prompt_length:"):
                    raise
                high = middle - 1
        return " ".join(words[:low])

    def most_references(self) -> int:
        """One per cached reference slot: three for Plus, one for the single-image pipeline."""
        return len(self.reference_slots)

    @property
    def denoiser_params(self) -> tuple[str, ...]:  # type: ignore[override]
        """Qwen-Image's, and the reference slots."""
        return ("prompt_embeds", "prompt_embeds_mask", *self.reference_slots)

    @cached_property
    def processor(self) -> Any:
        """The folder's Qwen2VLProcessor files as an image + text processor (no torchvision)."""
        return load_processor(Path(self.folder.root) / "processor")

    @cached_property
    def image_processor(self) -> Any:
        """The pipeline's VaeImageProcessor (resize and [-1, 1] tensors at multiples of 16)."""
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=self.vae_scale * 2)

    def check_template(self) -> None:
        """The processor's tokenizer encodes the edit template's system prefix into the tokens
        the pipeline drops (checked once, by every plan)."""
        if not self.__dict__.get("_template_checked"):
            check_edit_template(self.processor.tokenizer, self.plus)
            self._template_checked = True

    def tokenizer_files(self, encoder: str) -> list[Path]:
        """The tokenizer's files and the processor's (both decide the embeddings)."""
        files = super().tokenizer_files(encoder)
        folder = Path(self.folder.root) / "processor"
        return (
            files + sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else files
        )

    # -- units -----------------------------------------------------------------------------------
    def text_unit(self) -> RunnableUnit:
        """`PromptEncoder`: Qwen2.5-VL over each prompt and its reference images (and over ''
        with them, for caption dropout)."""
        empty = tuple(f"empty_{p}" for p in self.text_params)
        return RunnableUnit(
            Unit(
                "PromptEncoder",
                ("condition_image",),
                input_params_posi={"prompt": "prompt"},
                output_params=(*self.text_params, *empty),
                onload_model_names=self.prompt_encoders(),
            ),
            self.encode_edit_prompts,
        )

    def encode_edit_prompts(self, ctx: StepContext, prompt, condition_image) -> dict[str, Any]:
        """Embeddings [B, L, D] and mask [B, L] of each sample's prompt and of '' with its
        images, each encoded alone as the pipeline encodes one prompt, padded to L, the longest
        of them all (at most max_prompt_length: stage 1 caches each at its own length)."""
        encoder = ctx.model("text_encoder", "PromptEncoder")
        hiddens: list[torch.Tensor] = []
        for text, images in zip(prompt, condition_image, strict=True):
            for words in (text, ""):
                hiddens.append(
                    encode_prompt(encoder, self.processor, words, images, self.plus, ctx.device)
                )
        wheres = [f"the batch's sample {index // 2 + 1}" for index in range(len(hiddens))]
        embeds, mask = pad_prompts(hiddens, self.config.pipeline.max_prompt_length, wheres)
        return {
            "prompt_embeds": embeds[0::2],
            "prompt_embeds_mask": mask[0::2],
            "empty_prompt_embeds": embeds[1::2],
            "empty_prompt_embeds_mask": mask[1::2],
        }

    def encode_references(self, ctx: StepContext, reference_image) -> dict[str, Any]:
        """Each sample's references as QwenImageEdit(Plus)Pipeline._encode_vae_image makes them:
        the VAE's mode of a one-frame clip, normalised per channel; absent slots empty."""
        vae = ctx.model("vae", "ReferenceEncoder")
        dtype = next(vae.parameters()).dtype
        channels = int(self.vae_config["z_dim"])
        out: dict[str, list[torch.Tensor]] = {slot: [] for slot in self.reference_slots}
        for images in reference_image:
            for at, slot in enumerate(self.reference_slots):
                if at >= len(images):
                    out[slot].append(torch.zeros(channels, 0, 0, dtype=dtype))
                    continue
                clip = images[at].to(ctx.device, dtype)[None, :, None]
                z = vae.encode(clip).latent_dist.mode()
                out[slot].append(normalise(self.vae_config, z)[0, :, 0].to(dtype))
        return out

    def units(self) -> list[RunnableUnit]:
        """Qwen-Image's units (the prompt unit sees the references), and `ReferenceEncoder`
        (V2) after the VAE encoder."""
        units = super().units()
        encoder = RunnableUnit(
            Unit(
                "ReferenceEncoder",
                ("reference_image",),
                output_params=self.reference_slots,
                onload_model_names=("vae",),
            ),
            self.encode_references,
        )
        at = next(i for i, unit in enumerate(units) if unit.spec.name == "VAEEncoder") + 1
        return [*units[:at], encoder, *units[at:]]

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        """The image and prompt, and the row's references resized as the pipeline resizes them:
        for the VAE ([3, H, W] in [-1, 1]) and for Qwen2.5-VL (PIL)."""
        sample = super().load_sample(row, base_path)
        if not self.plus and len(row.references) > 1:
            raise DataError(
                f"{row.where} has {len(row.references)} reference images: "
                "QwenImageEditPipeline takes one; keep one, or train a QwenImageEditPlusPipeline "
                "folder (Qwen-Image-Edit-2509)"
            )
        source = source_for(base_path)
        images = []
        for ref in row.references:
            data = read_image_bytes(reference_row(row, ref), source)
            images.append(as_rgb8(open_image(data, row.where, source.display(ref))))
        vae_images, conditions = self.sized_references(images)
        length = self.config.pipeline.max_prompt_length
        count = token_count(self.processor, sample["prompt"], conditions, self.plus)
        if count > length:  # refused before any model sees the row
            raise too_long(row.where, count, length)
        return sample | {"reference_image": vae_images, "condition_image": conditions}

    def sized_references(self, images: list[Any]) -> tuple[list[torch.Tensor], list[Any]]:
        """(VAE inputs [3, H, W] in [-1, 1], Qwen2.5-VL's PIL images) of 8-bit RGB references,
        each resized to its own aspect ratio as the pipeline resizes it."""
        settings = self.config.pipeline
        vae_images, conditions = [], []
        for image in images:
            vae_size, cond_size = reference_sizes(
                image, self.plus, settings.reference_max_pixels, settings.condition_max_pixels
            )
            vae_images.append(self.image_processor.preprocess(image, *vae_size)[0])
            conditions.append(self.image_processor.resize(image, *cond_size))
        return vae_images, conditions

    # -- the training step -----------------------------------------------------------------------
    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """Qwen-Image's flow matching on the target's packed latents, the packed reference
        latents after them (their own img_shapes entries); the target is the noisy tokens'."""
        step = super().training_step(ctx, inputs)
        kwargs = step.denoiser_kwargs
        dtype = kwargs["hidden_states"].dtype
        refs = [
            _stacked(inputs[slot]).to(ctx.device, torch.float32) for slot in self.reference_slots
        ]
        refs = [ref for ref in refs if ref.shape[-1]]
        if not refs:
            raise ConfigError(
                "the batch has no reference latents; rerun preprocess (the qwenimage_edit "
                "family needs an 'edit_image' on every row)"
            )
        kwargs["hidden_states"] = torch.cat(
            [kwargs["hidden_states"], *(pack(ref).to(dtype) for ref in refs)], dim=1
        )
        extra = [(1, ref.shape[-2] // 2, ref.shape[-1] // 2) for ref in refs]
        kwargs["img_shapes"] = [[*shapes, *extra] for shapes in kwargs["img_shapes"]]
        return step

    def denoise(self, ctx: StepContext, step: TrainingStep) -> torch.Tensor:
        """The transformer's prediction for the noisy tokens (the references' are cut off)."""
        return super().denoise(ctx, step)[:, : step.target.shape[1]]

    # -- validation sampling ---------------------------------------------------------------------
    def check_sampling(self) -> None:
        """The VAE is there and every validation prompt has its reference image(s): the edit
        pipelines take no prompt alone."""
        super().check_sampling()
        settings = self.config.validation
        if not settings.reference_images:
            raise ConfigError(NEEDS_REFERENCES)
        self.reference_models()

    def prompt_models(self) -> list[str]:
        """Qwen2.5-VL: no unit encodes a prompt alone, but the validation prompts are encoded by
        it (with their images, in `reference_conditioning`), so stage 2 reads them from stage
        1's file unless it holds it (and `train` refuses before launch when they are not there)."""
        return list(self.prompt_encoders())

    def reference_models(self) -> list[str]:
        """Qwen2.5-VL (the prompts are encoded with their images) and the VAE; more than one
        image for a prompt of QwenImageEditPipeline is refused (one line)."""
        if not self.plus:
            for index, paths in enumerate(self.config.validation.references()):
                if len(paths) > 1:
                    raise ConfigError(
                        f"validation.reference_images[{index}] names {len(paths)} images; "
                        "QwenImageEditPipeline takes one: keep one, or use a "
                        "QwenImageEditPlusPipeline folder (Qwen-Image-Edit-2509)"
                    )
        return sorted({*self.prompt_encoders(), "vae"})

    def validation_reference(self, image: Any, target: tuple[int, int]) -> Any:
        """The decoded file as 8-bit RGB (PIL): sized later as the pipeline sizes it, from the
        image's own aspect ratio, whatever the sample size."""
        return as_rgb8(image)

    def reference_conditioning(self, ctx: StepContext, images, prompts) -> dict[str, torch.Tensor]:
        """As QwenImageEdit(Plus)Pipeline conditions on each prompt (or negative) and its
        references: Qwen2.5-VL over the prompt with the images (edit template, padded to the
        longest prompt's tokens), and their latents in the reference slots. References sized on
        their own differ in shape between prompts: each slot is zero-padded to the largest,
        `reference_shapes` [B, slots, 2] gives each row's latent (h, w), 0 where absent."""
        encoder = ctx.model("text_encoder", "validation")
        rows: list[dict[str, torch.Tensor]] = []
        hiddens: list[torch.Tensor] = []
        for prompt, refs in zip(prompts, images, strict=True):
            vae_images, conditions = self.sized_references(list(refs))
            hiddens.append(
                encode_prompt(encoder, self.processor, prompt, conditions, self.plus, ctx.device)
            )
            latents = self.encode_references(ctx, [vae_images])
            rows.append({slot: latents[slot][0] for slot in self.reference_slots})
        wheres = [f"validation.reference_images[{index}]" for index in range(len(hiddens))]
        embeds, mask = pad_prompts(hiddens, self.config.pipeline.max_prompt_length, wheres)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        shapes = [[list(row[slot].shape[-2:]) for slot in self.reference_slots] for row in rows]
        out["reference_shapes"] = torch.tensor(shapes, dtype=torch.long)
        for slot in self.reference_slots:
            height = max(row[slot].shape[-2] for row in rows)
            width = max(row[slot].shape[-1] for row in rows)
            out[slot] = torch.stack(
                [pad_to(row[slot].to(ctx.device), height, width) for row in rows]
            )
        return out

    def sample(self, ctx, cond, uncond, generator, *, steps, guidance, size=None) -> torch.Tensor:
        """Given the reference slots in `cond`: QwenImageEdit(Plus)Pipeline's loop; without
        them: refused (the edit pipelines take no prompt alone)."""
        if self.reference_slots[0] not in cond:
            raise ConfigError(NEEDS_REFERENCES)
        size = self.sample_size(size)
        return edit_sample(
            self, ctx, cond, uncond, generator, steps=steps, guidance=guidance, size=size
        )


def pad_to(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[C, h, w] latents zero-padded at the bottom and right to [C, height, width]."""
    return torch.nn.functional.pad(
        latents, (0, width - latents.shape[-1], 0, height - latents.shape[-2])
    )
