"""Validation sampling in stage 2: every N updates and at the end, draw the prompts' images.

Every rank samples (a sharded denoiser's forward is collective) from the same seeded noise, so
1 rank and N ranks draw the same images; rank 0 alone loads the decoder, only while decoding,
writes a labelled grid under `<output>/samples/` and prints `samples update N: URL` (the flow
publishes it as an artifact). A sampling failure is logged and never stops training.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from splitstage.pipelines.config import SplitstageConfig
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling import grid_png
from splitstage.tasks.cache.storage import join, write_atomic
from splitstage.tasks.outputs import open_output
from splitstage.tasks.plan import JobPlan
from splitstage.tasks.validation_prompts import Conditioning, encode, read_validation_prompts

SAMPLES_FOLDER = "samples"


def repeat_rows(values: dict[str, torch.Tensor], times: int) -> dict[str, torch.Tensor]:
    """Each prompt's row repeated `times` (images per prompt), prompt-major."""
    return {name: value.repeat_interleave(times, dim=0) for name, value in values.items()}


class Validator:
    """Samples the `[validation]` prompts with the model being trained."""

    def __init__(
        self,
        config: SplitstageConfig,
        plan: JobPlan,
        models: dict[str, torch.nn.Module],
        device: torch.device,
        output_url: str,
        *,
        is_main: bool,
        log: Callable[[str], None],
        autocast: Callable[[], Any] = contextlib.nullcontext,
        on_grid: Callable[[int, bytes], None] | None = None,
    ):
        self.config, self.plan, self.models, self.device = config, plan, models, device
        self.settings = config.validation
        self.output_url = output_url
        self.is_main, self.log, self.autocast = is_main, log, autocast
        self.on_grid = on_grid  # e.g. the trackers' image logging
        self.samples: dict[int, str] = {}
        family = plan.family
        # Encode in-process when stage 2 holds the prompt encoders (trained, or unsplit).
        self.in_process = all(name in models for name in family.prompt_models())
        self.cached: Conditioning | None = None

    def due(self, update: int, total: int) -> bool:
        """Whether to sample after `update` (every N, and always at the end)."""
        every = self.settings.every
        return self.settings.enabled and (update == total or bool(every and update % every == 0))

    def run(self, update: int) -> str | None:
        """Sample, write the grid (rank 0); the grid's URL. Errors are logged, never raised."""
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
            self.cached = read_validation_prompts(self.config, self.plan)
            if self.cached is None:
                raise FileNotFoundError(
                    "the validation prompts are not encoded for this cache; run "
                    "`splitstage preprocess` (it encodes only them)"
                )
        return self.cached

    def draw(self) -> torch.Tensor:
        """Latents for every prompt x images_per_prompt (collective on sharded models)."""
        family = self.plan.family
        cond, uncond = self.conditioning()
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
                    ctx, cond, uncond, generator, steps=self.settings.steps, guidance=guidance
                )
        finally:
            denoiser.train(was_training)

    def sample_and_write(self, update: int) -> str | None:
        """Draw on every rank; decode and write the grid on rank 0."""
        if os.environ.get("SPLITSTAGE_FAULT_VALIDATION"):  # fault-injection tests
            raise RuntimeError("injected validation fault (SPLITSTAGE_FAULT_VALIDATION)")
        latents = self.draw()
        if not self.is_main:
            return None
        family = self.plan.family
        decoder = family.load_decoder(self.device)  # only while decoding: freed right after
        try:
            with torch.no_grad():
                images = family.decode(decoder, latents)
        finally:
            del decoder
        prompts = self.settings.prompts
        png = grid_png(images.cpu(), prompts, columns=self.settings.images_per_prompt)
        fs, root = open_output(self.config, self.output_url)
        name = f"update-{update:06d}.png"
        write_atomic(fs, join(root, SAMPLES_FOLDER, name), png)
        url = f"{self.output_url.rstrip('/')}/{SAMPLES_FOLDER}/{name}"
        self.samples[update] = url
        self.log(f"samples update {update}: {url}")
        if self.on_grid is not None:
            self.on_grid(update, png)
        return url
