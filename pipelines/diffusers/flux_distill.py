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

from splitstage.config.job import ConfigError
from splitstage.data.dataset import Row
from splitstage.pipelines.diffusers.packing import pack
from splitstage.pipelines.diffusers.sampling import flux_loop
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Unit

COLUMNS = ("seed", "num_inference_steps")  # required; rand_device and cfg_scale optional
NOISE = "distill_noise"
LOSS_PARAMS = ("input_latents", NOISE, "num_inference_steps", "cfg_scale")
STEP_PARAMS = ("latents", "timestep")


def distill_values(row: Row) -> dict[str, Any]:
    """The row's teacher settings: seed and steps (required), rand_device, cfg_scale (or None)."""
    missing = [c for c in COLUMNS if row.extras.get(c) in (None, "")]
    if missing:
        raise ConfigError(
            f"{row.where}: train.task = 'direct_distill' needs the column(s) "
            f"{', '.join(missing)} (the teacher's seed and steps); add them to the metadata"
        )
    try:
        values = {c: int(row.extras[c]) for c in COLUMNS}
        cfg = row.extras.get("cfg_scale")
        values["cfg_scale"] = None if cfg in (None, "") else float(cfg)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{row.where}: seed and num_inference_steps must be integers and cfg_scale a number "
            f"(got {row.extras['seed']!r}, {row.extras['num_inference_steps']!r}, "
            f"{row.extras.get('cfg_scale')!r})"
        ) from None
    if values["num_inference_steps"] < 1:
        raise ConfigError(f"{row.where}: num_inference_steps must be at least 1")
    values["rand_device"] = str(row.extras.get("rand_device") or "cpu")
    return values


def seeded_noise(
    ctx: StepContext, latent_mean: torch.Tensor, seed: list[int], rand_device: list[str]
) -> dict[str, Any]:
    """Each row's starting noise, shaped as its latents, as FluxPipeline draws it from a
    `torch.Generator(rand_device).manual_seed(seed)` (a function of the row: cached)."""
    shape = tuple(latent_mean.shape[1:])
    noise = []
    for row_seed, device in zip(seed, rand_device, strict=True):
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
