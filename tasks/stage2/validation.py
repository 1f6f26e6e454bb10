"""Validation sampling in stage 2: every N updates and at the end, draw the prompts' images.

Every rank samples (a sharded denoiser's forward is collective) from the same seeded noise, so
1 rank and N ranks draw the same images; rank 0 alone loads the decoder, only while decoding,
writes a labelled grid under `<output>/samples/` (a video family's clips also as animated WebP
files beside it, and as 4-frame filmstrips in the grid) and prints `samples update N: URL` (the flow
publishes it as an artifact). With `validation.sizes` every prompt is drawn at every size (each
size from the seed afresh, so a size's images do not depend on the others), one grid per size.
With `validation.reference_images` each size's reference conditioning (stage 1's, or encoded
here when stage 2 holds the reference models) is merged over the prompts' and the negatives'.
A sampling failure is logged and never stops training.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.config.monitoring import size_label
from splitstage.pipelines.family import Family
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling_common import clip_gif, clip_webp, filmstrip, grid_png
from splitstage.storage.files import join, write_atomic
from splitstage.tasks.cache.validation_prompts import (
    Conditioning,
    References,
    encode,
    encode_references,
    read_validation_prompts,
    read_validation_references,
)
from splitstage.tasks.cache.validation_references import check_validation_references
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage2.outputs import open_output

SAMPLES_FOLDER = "samples"
GRID_TAG = "samples"  # the trackers' image name (a size's grid: "samples/768x512")
Size = tuple[int, int]  # (height, width) pixels


def check_validation_sizes(family: Family) -> None:
    """`validation.sizes` fit the family (checked before launch): it samples images of a chosen
    size, and both sides are multiples of its side multiple (the VAE's and denoiser's patches);
    then `validation.reference_images` (the family takes them, every file decodes)."""
    settings = family.config.validation
    if not settings.enabled:
        return
    if settings.sizes:
        check_sample_sizes(family)
    check_validation_references(family)


def check_sample_sizes(family: Family) -> None:
    """Each of `validation.sizes` can be drawn by the family (one ConfigError line if not)."""
    settings = family.config.validation
    resolution = family.image_resolution()
    if resolution is None:
        raise ConfigError(
            f"validation.sizes: the {family.name} family does not sample images of a chosen "
            "size; remove validation.sizes"
        )
    multiple = resolution[1]
    for text, (height, width) in zip(settings.sizes, settings.sample_sizes(), strict=True):
        if height % multiple or width % multiple:
            near = [
                max(multiple, (side + multiple // 2) // multiple * multiple)
                for side in (width, height)
            ]
            raise ConfigError(
                f"validation.sizes: {text!r}: both sides must be multiples of {multiple} for the "
                f"{family.name} family; use '{near[0]}x{near[1]}'"
            )


def grid_name(update: int, size: Size | None) -> str:
    """`update-NNNNNN.png` (the square default), or `update-NNNNNN-WxH.png` for a given size."""
    return (
        f"update-{update:06d}.png"
        if size is None
        else f"update-{update:06d}-{size_label(*size)}.png"
    )


def tracker_tag(size: Size | None) -> str:
    """The trackers' name of a size's samples: 'samples', or 'samples/768x512' per size."""
    return GRID_TAG if size is None else f"{GRID_TAG}/{size_label(*size)}"


def repeat_rows(values: dict[str, torch.Tensor], times: int) -> dict[str, torch.Tensor]:
    """Each prompt's row repeated `times` (images per prompt), prompt-major."""
    return {name: value.repeat_interleave(times, dim=0) for name, value in values.items()}


class Validator:
    """Samples the `[validation]` prompts with the model being trained."""

    def __init__(
        self,
        plan: JobPlan,
        models: dict[str, torch.nn.Module],
        device: torch.device,
        output_url: str,
        *,
        is_main: bool,
        log: Callable[[str], None],
        autocast: Callable[[], Any] = contextlib.nullcontext,
        on_grid: Callable[[int, bytes, str], None] | None = None,
        on_clips: Callable[[int, list[bytes], str], None] | None = None,
        weights: Callable[[Callable[[], Any]], Any] | None = None,
    ):
        self.config, self.plan, self.models, self.device = plan.config, plan, models, device
        self.settings = self.config.validation
        self.output_url = output_url
        self.is_main, self.log, self.autocast = is_main, log, autocast
        self.on_grid = on_grid  # e.g. the trackers' image logging: (update, png, tag)
        self.on_clips = on_clips  # a video family's clips as GIFs: (update, gifs, tag)
        self.weights = weights  # runs sampling with other weights swapped in (the EMA's)
        self.samples: dict[int, str] = {}  # update -> the first grid's URL (the run report's)
        self.grids: dict[int, list[str]] = {}  # update -> every grid's URL, in size order
        self.sizes: list[Size | None] = list(self.settings.sample_sizes()) or [None]
        family = plan.family
        # Encode in-process when stage 2 holds the prompt encoders (trained, or unsplit).
        self.in_process = all(name in models for name in family.prompt_models())
        self.cached: Conditioning | None = None
        self.cached_references: References | None = None

    def due(self, update: int, *, last: bool = False) -> bool:
        """Whether to sample after `update`: every `validation.every` updates, and the last."""
        every = self.settings.every
        return self.settings.enabled and (last or bool(every and update % every == 0))

    def validate(self, update: int, *, last: bool = False) -> str | None:
        """Sample after `update` if it is due (with `weights` swapped in); the first grid's
        URL, or None."""
        if not self.due(update, last=last):
            return None
        if self.weights is None:
            return self.run(update)
        return self.weights(lambda: self.run(update))

    def run(self, update: int) -> str | None:
        """Sample, write the grids (rank 0); the first grid's URL. Errors are logged, never
        raised."""
        try:
            return self.sample_and_write(update)
        except Exception as error:  # noqa: BLE001 - sampling must never stop a run
            first = (str(error).splitlines() or [""])[0]
            self.log(f"validation at update {update} failed ({type(error).__name__}: {first}); "
                     "training continues")  # fmt: skip
            return None

    def conditioning(self) -> Conditioning:
        """The prompts' and negatives' embeddings: encoded here, or read from stage 1's file."""
        if self.in_process:
            return encode(
                self.plan,
                self.models,
                self.device,
                self.settings.prompts,
                self.settings.negatives(),
            )
        if self.cached is None:
            self.cached = read_validation_prompts(self.plan)
            if self.cached is None:
                raise FileNotFoundError(
                    "the validation prompts are not encoded for this cache; run "
                    "`splitstage preprocess` (it encodes only them)"
                )
        return self.cached

    def references(self, size: Size | None) -> Conditioning:
        """What the reference images add to (cond, uncond) at `size` (empty without them):
        encoded here when stage 2 holds the reference models, else read once from stage 1's
        file."""
        if not self.settings.reference_images:
            return {}, {}
        family = self.plan.family
        target = family.sample_size(size)
        label = size_label(*target)
        if all(name in self.models for name in family.reference_models()):
            images = check_validation_references(family)
            encoded = encode_references(self.plan, self.models, self.device, images, [target])
            return encoded[label]
        if self.cached_references is None:
            self.cached_references = read_validation_references(self.plan)
            if self.cached_references is None:
                raise FileNotFoundError(
                    "the validation reference images are not encoded for this cache; run "
                    "`splitstage preprocess` (it encodes only them)"
                )
        return self.cached_references[label]

    def draw(self, size: Size | None = None) -> torch.Tensor:
        """Latents for every prompt x images_per_prompt at `size` (None: the family's square),
        from the seed afresh (collective on sharded models)."""
        family = self.plan.family
        cond, uncond = self.conditioning()
        ref_cond, ref_uncond = self.references(size)
        cond, uncond = cond | ref_cond, uncond | ref_uncond
        times = self.settings.images_per_prompt
        cond, uncond = repeat_rows(cond, times), repeat_rows(uncond, times)
        guidance = self.settings.guidance_scale
        guidance = family.default_guidance if guidance is None else guidance
        generator = torch.Generator().manual_seed(self.settings.seed)
        denoiser = self.models[family.denoiser]
        was_training = denoiser.training
        denoiser.eval()
        try:
            ctx = StepContext(self.models, self.device, settings=family.settings())
            with torch.no_grad(), self.autocast():
                return family.sample(
                    ctx,
                    cond,
                    uncond,
                    generator,
                    steps=self.settings.steps,
                    guidance=guidance,
                    size=size,
                )
        finally:
            denoiser.train(was_training)

    def sample_and_write(self, update: int) -> str | None:
        """Draw every size on every rank first (collective: a rank-0 decode failure must not
        leave the other ranks in a forward), then decode and write each grid on rank 0."""
        if os.environ.get("SPLITSTAGE_FAULT_VALIDATION"):  # fault-injection tests
            raise RuntimeError("injected validation fault (SPLITSTAGE_FAULT_VALIDATION)")
        drawn = [(size, self.draw(size)) for size in self.sizes]
        if not self.is_main:
            return None
        family = self.plan.family
        decoder = family.load_decoder(self.device)  # only while decoding: freed right after
        try:
            for size, latents in drawn:
                with torch.no_grad():
                    clips = family.decode_clips(decoder, latents)
                    images = family.decode(decoder, latents) if clips is None else filmstrip(clips)
                url = self.write_grid(update, size, images.cpu())
                if clips is not None:
                    self.write_clips(update, size, clips.cpu())
                self.grids.setdefault(update, []).append(url)
                self.samples.setdefault(update, url)
        finally:
            del decoder
        return self.samples[update]

    def write_clips(self, update: int, size: Size | None, clips: torch.Tensor) -> list[str]:
        """A video family's clips, each an animated WebP beside the grid (`<grid>-NN.webp`, in
        grid order: prompt-major), at `[data.video] fps` (else 16); their URLs."""
        fs, root = open_output(self.config, self.output_url)
        fps = self.config.data.video.fps or 16.0
        stem = grid_name(update, size).removesuffix(".png")
        urls = []
        for index, clip in enumerate(clips):
            name = f"{stem}-{index:02d}.webp"
            write_atomic(fs, join(root, SAMPLES_FOLDER, name), clip_webp(clip, fps))
            urls.append(f"{self.output_url.rstrip('/')}/{SAMPLES_FOLDER}/{name}")
        self.log(f"sample clips update {update}: {len(urls)} animated WebP, {urls[0]} ...")
        if self.on_clips is not None:
            self.on_clips(update, [clip_gif(clip, fps) for clip in clips], tracker_tag(size))
        return urls

    def write_grid(self, update: int, size: Size | None, images: torch.Tensor) -> str:
        """Write one size's labelled grid, log its URL, hand it to the trackers; its URL."""
        png = grid_png(images, self.settings.prompts, columns=self.settings.images_per_prompt)
        fs, root = open_output(self.config, self.output_url)
        name = grid_name(update, size)
        write_atomic(fs, join(root, SAMPLES_FOLDER, name), png)
        url = f"{self.output_url.rstrip('/')}/{SAMPLES_FOLDER}/{name}"
        self.log(f"samples update {update}: {url}")
        if self.on_grid is not None:
            self.on_grid(update, png, tracker_tag(size))
        return url
