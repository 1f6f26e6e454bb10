"""The demo's VAE encoder: images to latents (the posterior mean, so caching them is exact)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VAEEncoder(nn.Module):
    """Conv encoder, image [B,3,H,W] in [-1,1] -> mean latents [B,4,H/8,W/8] times scaling_factor.

    Returns the posterior mean (no sampling), so the same image always gives the same latents and
    stage 1 may cache them.
    """

    downsample = 8

    def __init__(
        self,
        in_channels: int = 3,
        latent_channels: int = 4,
        base_channels: int = 32,
        scaling_factor: float = 1.0,
    ):
        super().__init__()
        self.config = dict(
            in_channels=in_channels,
            latent_channels=latent_channels,
            base_channels=base_channels,
            scaling_factor=scaling_factor,
        )
        self.scaling_factor = scaling_factor
        self.latent_channels = latent_channels
        chans = [base_channels, base_channels * 2, base_channels * 4, base_channels * 4]
        self.conv_in = nn.Conv2d(in_channels, chans[0], 3, padding=1)
        layers: list[nn.Module] = []
        for c_in, c_out in zip(chans[:-1], chans[1:], strict=True):
            layers += [
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1),
                nn.SiLU(),
                nn.Conv2d(c_out, c_out, 3, padding=1),
                nn.SiLU(),
            ]
        self.down = nn.Sequential(*layers)
        self.norm_out = nn.GroupNorm(num_groups=min(32, chans[-1]), num_channels=chans[-1])
        self.conv_out = nn.Conv2d(chans[-1], 2 * latent_channels, 3, padding=1)  # mean, logvar
        self.init_weights()

    def init_weights(self) -> None:
        """Variance-preserving init (Kaiming convs, zero biases) so latents vary with the image."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        nn.init.xavier_normal_(self.conv_out.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images to scaled mean latents."""
        if images.ndim != 4 or images.shape[-1] % 8 or images.shape[-2] % 8:
            raise ValueError(
                f"VAEEncoder wants images [B,C,H,W] with H and W divisible by 8, got "
                f"{tuple(images.shape)}; resize the data set (load_sample size=...)."
            )
        images = images.to(self.conv_in.weight.dtype)
        h = self.down(self.conv_in(images))
        moments = self.conv_out(F.silu(self.norm_out(h)))
        mean = moments[:, : self.latent_channels]
        return mean * self.scaling_factor
