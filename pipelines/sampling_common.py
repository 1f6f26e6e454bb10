"""Sampling helpers every family's sampler shares: guided flow-matching Euler, grids, clips."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

Velocity = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]  # (x, t, conditional)
Field = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, t) -> dx/dt


def guided(
    velocity: Velocity, guidance: float
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Classifier-free guidance: v_u + g (v_c - v_u); g = 1 (or 0) needs one call."""

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        cond = velocity(x, t, True)
        if guidance == 1.0:
            return cond
        uncond = velocity(x, t, False)
        return uncond + guidance * (cond - uncond)

    return step


def flow_euler(
    velocity: Field,
    noise: torch.Tensor,
    sigmas: Sequence[float],
) -> torch.Tensor:
    """Integrate dx/dt = v from t = sigmas[0] (noise) to sigmas[-1] (data), Euler steps; the
    training convention x_t = (1 - t) x0 + t noise, v = noise - x0."""
    x = noise.float()
    for t, t_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        t_batch = torch.full((x.shape[0],), float(t), device=x.device)
        x = x + (float(t_next) - float(t)) * velocity(x, t_batch).float()
    return x


def linear_sigmas(steps: int) -> list[float]:
    """steps + 1 times from 1 down to 0, evenly spaced."""
    return [1.0 - i / steps for i in range(steps + 1)]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """Images [B, 3, H, W] in [-1, 1] -> 8-bit RGB PIL images."""
    array = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(a.permute(1, 2, 0).cpu().numpy())) for a in array]


def grid_png(
    images: torch.Tensor, labels: Sequence[str], columns: int, max_side: int = 2048
) -> bytes:
    """A labelled grid (one row per prompt, `columns` images each) as PNG bytes."""
    tiles = to_pil(images)
    width, height = tiles[0].size
    scale = min(1.0, max_side / (width * columns))
    width, height = max(1, int(width * scale)), max(1, int(height * scale))
    rows = (len(tiles) + columns - 1) // columns
    band = 14
    canvas = Image.new("RGB", (width * columns, (height + band) * rows), "white")
    draw = ImageDraw.Draw(canvas)
    for index, tile in enumerate(tiles):
        row, col = divmod(index, columns)
        top = row * (height + band)
        if col == 0:
            draw.text((2, top + 1), labels[row][: max(8, width * columns // 6)], fill="black")
        canvas.paste(tile.resize((width, height)), (col * width, top + band))
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return buffer.getvalue()


def filmstrip(clips: torch.Tensor, count: int = 4) -> torch.Tensor:
    """Clips [B, F, 3, H, W] -> images [B, 3, H, count * W]: `count` frames spread from the first
    to the last, side by side (a clip shown in an image grid)."""
    frames = clips.shape[1]
    picked = torch.linspace(0, frames - 1, min(count, frames)).round().long().tolist()
    return torch.cat([clips[:, index] for index in picked], dim=-1)


def _animation(clip: torch.Tensor, fps: float, image_format: str, **options: Any) -> bytes:
    """One clip [F, 3, H, W] in [-1, 1] as a looping animated image file in `image_format`."""
    frames = to_pil(clip)
    buffer = io.BytesIO()
    frames[0].save(
        buffer,
        format=image_format,
        save_all=True,
        append_images=frames[1:],
        duration=max(1, round(1000 / fps)),
        loop=0,
        **options,
    )
    return buffer.getvalue()


def clip_gif(clip: torch.Tensor, fps: float = 16.0) -> bytes:
    """A clip as an animated GIF: what TensorBoard's image dashboard and W&B's video panel play
    (256 colours; the WebP file is the lossless one)."""
    return _animation(clip, fps, "GIF")


def clip_webp(clip: torch.Tensor, fps: float = 16.0) -> bytes:
    """A clip as a lossless animated WebP (browsers and the dashboard play it; no video codec)."""
    return _animation(clip, fps, "WEBP", lossless=True)
