"""The demo's VAE: an encoder (images to mean latents, so caching them is exact) and a decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _groups(channels: int) -> int:
    """GroupNorm groups: up to 8, so a group pools several channels (not a per-channel norm)."""
    return max(g for g in (1, 2, 4, 8) if channels % g == 0)


def _init_convs(module: nn.Module, last: nn.Conv2d) -> None:
    """Variance-preserving init (Kaiming convs, zero biases, Xavier last conv) for fast training."""
    for sub in module.modules():
        if isinstance(sub, nn.Conv2d):
            nn.init.kaiming_normal_(sub.weight, nonlinearity="relu")
            nn.init.zeros_(sub.bias)
    nn.init.xavier_normal_(last.weight)


class VAEEncoder(nn.Module):
    """Conv encoder, image [B,3,H,W] in [-1,1] -> mean latents [B,4,H/8,W/8] times scaling_factor.

    Returns the posterior mean (no sampling), so the same image always gives the same latents and
    stage 1 may cache them. `moments` gives the unscaled mean and log-variance (for training).
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
        width = base_channels
        # A patch embedding (8x8 pixels -> one latent position), then 3x3 convs mixing neighbours:
        # no convolution at full resolution, so the demo trains it in seconds on a CPU.
        self.conv_in = nn.Conv2d(in_channels, width, self.downsample, stride=self.downsample)
        self.mid = nn.Sequential(
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
        )
        self.norm_out = nn.GroupNorm(num_groups=_groups(width), num_channels=width)
        self.conv_out = nn.Conv2d(width, 2 * latent_channels, 3, padding=1)  # mean, logvar
        self.init_weights()

    def init_weights(self) -> None:
        """Variance-preserving init so latents vary with the image from the start."""
        _init_convs(self, self.conv_out)

    def moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled posterior mean and log-variance, each [B, latent_channels, H/8, W/8]."""
        if images.ndim != 4 or images.shape[-1] % 8 or images.shape[-2] % 8:
            raise ValueError(
                f"VAEEncoder wants images [B,C,H,W] with H and W divisible by 8, got "
                f"{tuple(images.shape)}; resize the data set (load_sample size=...)."
            )
        images = images.to(self.conv_in.weight.dtype)
        h = self.mid(self.conv_in(images))
        moments = self.conv_out(F.silu(self.norm_out(h)))
        return moments[:, : self.latent_channels], moments[:, self.latent_channels :]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images to scaled mean latents."""
        return self.moments(images)[0] * self.scaling_factor


class VAEDecoder(nn.Module):
    """Conv decoder, scaled latents [B,4,h,w] (what VAEEncoder gives) -> images [B,3,8h,8w].

    `decode` (= forward) divides by scaling_factor first, so decoder(encoder(x)) reconstructs x;
    a tanh keeps the output in [-1,1] like the images the encoder takes.
    """

    upsample = 8

    def __init__(
        self,
        out_channels: int = 3,
        latent_channels: int = 4,
        base_channels: int = 32,
        scaling_factor: float = 1.0,
    ):
        super().__init__()
        self.config = dict(
            out_channels=out_channels,
            latent_channels=latent_channels,
            base_channels=base_channels,
            scaling_factor=scaling_factor,
        )
        self.scaling_factor = scaling_factor
        self.latent_channels = latent_channels
        width = base_channels
        self.conv_in = nn.Conv2d(latent_channels, width, 3, padding=1)
        self.mid = nn.Sequential(
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
        )
        self.norm_out = nn.GroupNorm(num_groups=_groups(width), num_channels=width)
        # Each latent position predicts its 8x8 pixel patch (from its 3x3 neighbourhood).
        self.conv_out = nn.Conv2d(width, out_channels * self.upsample**2, 3, padding=1)
        self.unpatch = nn.PixelShuffle(self.upsample)
        self.init_weights()

    def init_weights(self) -> None:
        """Variance-preserving init, as the encoder's."""
        _init_convs(self, self.conv_out)

    def decode_unscaled(self, latents: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (the encoder's `moments` mean) -> images in [-1,1]."""
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"VAEDecoder wants latents [B,{self.latent_channels},h,w], got "
                f"{tuple(latents.shape)}"
            )
        h = self.mid(self.conv_in(latents.to(self.conv_in.weight.dtype)))
        return torch.tanh(self.unpatch(self.conv_out(F.silu(self.norm_out(h)))))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents (encoder output, or a sample of the DiT) -> images in [-1,1]."""
        return self.decode_unscaled(latents / self.scaling_factor)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Same as decode."""
        return self.decode(latents)
