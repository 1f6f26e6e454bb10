"""Direct distillation for FLUX (`train.task = "direct_distill"`), as DiffSynth's DirectDistillLoss.

Each row carries the teacher's `seed` and `num_inference_steps` (DiffSynth's metadata columns;
`rand_device` and `cfg_scale` optional), so the starting noise is a function of the row: the
`SeededNoise` unit draws it in stage 1 and the cache holds it with the image latents and the
prompt embeddings. Stage 2 runs FluxPipeline's few-step loop with gradients through the trained
transformer; the loss is the MSE between its final latents and the teacher image's latents.
"""

from __future__ import annotations

from typing import Any

import torch

from splitstage.pipelines.diffusers.packing import pack
from splitstage.pipelines.diffusers.sampling import flux_loop
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Unit

NOISE = "distill_noise"
LOSS_PARAMS = ("input_latents", NOISE, "num_inference_steps", "cfg_scale")
STEP_PARAMS = ("latents", "timestep")


def seeded_noise(
    ctx: StepContext, latent_mean: torch.Tensor, seed: list[int], rand_device: list[str]
) -> dict[str, Any]:
    """Each row's starting noise, shaped as its latents, as FluxPipeline draws it from a
    `torch.Generator(rand_device).manual_seed(seed)` (a function of the row: cached); a row
    without rand_device draws on the device stage 1 runs on, as DiffSynth's train.py does."""
    shape = tuple(latent_mean.shape[1:])
    noise = []
    for row_seed, row_device in zip(seed, rand_device, strict=True):
        device = row_device or str(ctx.device)
        generator = torch.Generator(device).manual_seed(int(row_seed))
        noise.append(torch.randn((1, *shape), generator=generator, device=device)[0])
    return {NOISE: torch.stack(noise).to(ctx.device, torch.float32)}


def noise_unit() -> RunnableUnit:
    """`SeededNoise` (V2): the starting noise from the row's seed and the latents' shape."""
    return RunnableUnit(
        Unit("SeededNoise", ("latent_mean", "seed", "rand_device"), output_params=(NOISE,)),
        seeded_noise,
    )


def distill_loss(family, ctx: StepContext, inputs: dict[str, Any]) -> torch.Tensor:
    """MSE between FluxPipeline's few-step loop (with gradients, the row's steps and cfg_scale
    as the embedded guidance, else pipeline.guidance_scale) and the teacher image's latents."""
    model = ctx.model(family.denoiser, "model_fn")
    target = inputs["input_latents"].to(ctx.device, torch.float32)
    noise = inputs[NOISE].to(ctx.device, torch.float32)
    steps = [int(s) for s in inputs["num_inference_steps"]]
    default = family.config.pipeline.guidance_scale
    guidance = [default if g is None else float(g) for g in inputs["cfg_scale"]]
    groups: dict[tuple[int, float], list[int]] = {}
    for index, key in enumerate(zip(steps, guidance, strict=True)):
        groups.setdefault(key, []).append(index)
    total = target.new_zeros(())
    for (count, scale), rows in groups.items():
        cond = {name: inputs[name][rows] for name in family.denoiser_params}
        x = flux_loop(family, model, ctx, noise[rows], cond, steps=count, guidance=scale)
        total = total + (x.float() - pack(target[rows])).square().sum()
    return total / target.numel()
