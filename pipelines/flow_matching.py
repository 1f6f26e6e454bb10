"""Flow-matching (rectified flow) helpers any family's recipe calls: timesteps, noise, target."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitstage.pipelines.draws import Draws


def sample_timesteps(
    batch: int,
    draws: Draws,
    device: torch.device | str | None = None,
    *,
    distribution: str = "uniform",
    mean: float = 0.0,
    std: float = 1.0,
) -> torch.Tensor:
    """Timesteps [batch] in [0,1]: "uniform" or "logit_normal" (sigmoid of N(mean, std))."""
    if distribution == "uniform":
        t = draws.rand(batch)
    elif distribution == "logit_normal":
        t = torch.sigmoid(draws.randn((batch,)) * std + mean)
    else:
        raise ValueError(f"distribution must be 'uniform' or 'logit_normal', got {distribution!r}")
    return t.to(device) if device is not None else t


def sample_noise(like: torch.Tensor, draws: Draws) -> torch.Tensor:
    """Gaussian noise shaped like `like` (per sample) on like's device and dtype."""
    return draws.randn(like.shape).to(device=like.device, dtype=like.dtype)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Rectified-flow interpolation (1-t)*x0 + t*noise, t [B] broadcast over the other dims."""
    t = t.to(x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise


def flow_matching_target(noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Velocity target d x_t / d t = noise - x0."""
    return noise - x0


def flow_matching_loss(
    model_pred: torch.Tensor, noise: torch.Tensor, input_latents: torch.Tensor
) -> torch.Tensor:
    """MSE between the predicted and true velocity, computed in float32."""
    target = flow_matching_target(noise.float(), input_latents.float())
    return F.mse_loss(model_pred.float(), target)
