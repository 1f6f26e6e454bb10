"""The two training recipes of diffusers' examples: DDPM for UNets, flow matching for MMDiTs.

Both draw everything random per sample from the step's draws (noise, then timesteps), so split
and unsplit training with one seed see the same draws, however the batch is cut. Timestep
densities, SNR and loss weightings are diffusers' own `training_utils` functions.
"""

from __future__ import annotations

from typing import Any

import torch

from splitstage.config.job import ConfigError
from splitstage.pipelines.flow_matching import sample_noise
from splitstage.pipelines.runtime import StepContext


def ddpm_scheduler(config: dict[str, Any]):
    """A DDPMScheduler from the folder's scheduler config (as the training examples build it)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config(config)


def flow_scheduler(config: dict[str, Any]):
    """A FlowMatchEulerDiscreteScheduler from the folder's scheduler config (its shift table)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config(config)


def prediction_type(settings: dict[str, Any], scheduler) -> str:
    """The training target: the setting, else the scheduler config's prediction_type."""
    chosen = settings["prediction_type"]
    chosen = scheduler.config.prediction_type if chosen == "scheduler" else chosen
    if chosen not in ("epsilon", "v_prediction"):
        raise ConfigError(
            f"pipeline.prediction_type: the scheduler's prediction_type is {chosen!r}; training "
            "supports 'epsilon' and 'v_prediction': set one"
        )
    return chosen


def ddpm_draw(ctx: StepContext, x0: torch.Tensor, scheduler) -> dict[str, torch.Tensor]:
    """Noise (with the noise offset), uniform integer timesteps, noisy latents, target, weight."""
    settings = ctx.settings
    noise = sample_noise(x0, ctx.draws)
    if settings["noise_offset"]:
        offset = ctx.draws.randn((*x0.shape[:2], 1, 1))
        noise = noise + settings["noise_offset"] * offset.to(noise)
    steps = scheduler.config.num_train_timesteps
    timesteps = ctx.draws.randint(steps, x0.shape[0], device=x0.device)
    latents = scheduler.add_noise(x0, noise, timesteps)
    kind = prediction_type(settings, scheduler)
    target = noise if kind == "epsilon" else scheduler.get_velocity(x0, noise, timesteps)
    return {
        "noise": noise,
        "timestep": timesteps,
        "latents": latents,
        "target": target,
        "weight": min_snr_weight(settings["min_snr_gamma"], scheduler, timesteps, kind),
    }


def min_snr_weight(gamma: float | None, scheduler, timesteps: torch.Tensor, kind: str):
    """Min-SNR-gamma per-sample loss weights (diffusers' recipe), or None."""
    if gamma is None:
        return None
    from diffusers.training_utils import compute_snr

    snr = compute_snr(scheduler, timesteps)
    weight = torch.clamp(snr, max=gamma)
    return weight / snr if kind == "epsilon" else weight / (snr + 1)


def flow_draw(ctx: StepContext, x0: torch.Tensor, scheduler) -> dict[str, torch.Tensor]:
    """Noise, timesteps from the configured density and the scheduler's table, x_t, target."""
    from diffusers.training_utils import (
        compute_density_for_timestep_sampling,
        compute_loss_weighting_for_sd3,
    )

    settings = ctx.settings
    noise = sample_noise(x0, ctx.draws)
    u = ctx.draws.each(
        x0.shape[0],
        lambda generator, rows: compute_density_for_timestep_sampling(
            weighting_scheme=settings["weighting_scheme"],
            batch_size=rows,
            logit_mean=settings["logit_mean"],
            logit_std=settings["logit_std"],
            mode_scale=settings["mode_scale"],
            device=ctx.draws.device,
            generator=generator,
        ),
    )
    count = scheduler.config.num_train_timesteps
    indices = (u.cpu() * count).long().clamp(0, count - 1)
    timesteps = scheduler.timesteps[indices].to(x0.device, torch.float32)
    sigmas = scheduler.sigmas[indices].to(x0.device, torch.float32)
    shaped = sigmas.reshape(-1, *([1] * (x0.ndim - 1)))
    weighting = compute_loss_weighting_for_sd3(settings["weighting_scheme"], shaped)
    return {
        "noise": noise,
        "timestep": timesteps,
        "latents": (1.0 - shaped) * x0 + shaped * noise,
        "target": noise - x0,
        # Ones except for sigma_sqrt and cosmap (the others shape the density only).
        "weight": weighting.flatten(1)[:, 0],
    }
