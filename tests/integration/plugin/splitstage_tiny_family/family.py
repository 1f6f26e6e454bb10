"""The tiny family's units, models and epsilon-prediction training step (see the package doc)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

from splitstage.data.dataset import Row, decode_image, read_image_bytes
from splitstage.pipelines.family import Family, TrainingStep
from splitstage.pipelines.runtime import RunnableUnit, StepContext
from splitstage.splitter import Pipeline, Unit

POOL = 4  # the encoder's downsampling


class PoolEncoder(nn.Module):
    """A fixed 'VAE': average-pool the image by POOL and rescale (no weights)."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """[B,1,H,W] in [-1,1] -> latents [B,1,H/POOL,W/POOL]."""
        return nn.functional.avg_pool2d(image, POOL) * 2.0


class TinyDenoiser(nn.Module):
    """An MLP predicting the noise of flattened latents from (x_t, t, label)."""

    def __init__(self, side: int = 4, labels: int = 32, hidden: int = 64):
        super().__init__()
        self.side = side
        self.label_embed = nn.Embedding(labels, hidden)
        self.proj_in = nn.Linear(side * side + 1, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.proj_out = nn.Linear(hidden, side * side)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Noise prediction shaped like x_t."""
        flat = torch.cat([x_t.flatten(1), t[:, None].to(x_t.dtype)], dim=1)
        h = torch.tanh(self.proj_in(flat) + self.label_embed(label))
        return self.proj_out(torch.tanh(self.mid(h))).view_as(x_t)


def write_denoiser_weights(path: Path, side: int, labels: int, seed: int = 0) -> Path:
    """A seeded 'pretrained' denoiser file for the tests."""
    torch.manual_seed(seed)
    save_file(TinyDenoiser(side, labels).state_dict(), str(path))
    return path


def encode(ctx: StepContext, image: torch.Tensor) -> dict[str, Any]:
    """Latents of the images."""
    return {"latents_0": ctx.model("encoder", "Encode")(image.to(ctx.device))}


def hash_labels(ctx: StepContext, prompt: list[str]) -> dict[str, Any]:
    """Each prompt's label id (crc32 modulo the label count): conditioning without a model."""
    count = ctx.settings["labels"]
    ids = [zlib.crc32(p.encode("utf-8")) % count for p in prompt]
    return {"label": torch.tensor(ids, dtype=torch.long)}


UNITS = (
    RunnableUnit(
        Unit("Encode", ("image",), output_params=("latents_0",), onload_model_names=("encoder",)),
        encode,
    ),
    RunnableUnit(
        Unit("HashLabels", input_params_posi={"prompt": "prompt"}, output_params=("label",)),
        hash_labels,
    ),
)


class TinyFamily(Family):
    """Grayscale images, label conditioning, an MLP denoiser with epsilon prediction."""

    name = "tiny"
    model_names = ("encoder", "denoiser")
    denoiser = "denoiser"
    default_lora_targets = ("proj_in", "proj_out")

    def units(self) -> list[RunnableUnit]:
        return list(UNITS)

    def pipeline_spec(self) -> Pipeline:
        return Pipeline(
            name="tiny",
            units=tuple(u.spec for u in UNITS),
            model_fn_params=("x_t", "t", "label"),
            loss_params=("latents_0",),
            in_iteration_models=("denoiser",),
            step_params=("x_t", "t", "eps"),
        )

    def load_sample(self, row: Row, base_path: str | Path) -> dict[str, Any]:
        side = self.config.pipeline.image_size
        image = decode_image(read_image_bytes(row, base_path), row, base_path).convert("L")
        pixels = np.asarray(image.resize((side, side), Image.BILINEAR), dtype=np.float32)
        return {"image": torch.from_numpy(pixels / 127.5 - 1.0)[None], "prompt": row.prompt}

    def build_model(self, name: str, device: torch.device, *, meta: bool = False) -> nn.Module:
        self.require_known(name)
        if name == "encoder":
            return PoolEncoder().to(device).eval()
        settings = self.config.pipeline
        with torch.device("meta" if meta else device):
            model = TinyDenoiser(settings.image_size // POOL, settings.labels)
        if not meta:
            model.load_state_dict(load_file(self.model_source(name).weights))
            model.eval().requires_grad_(False)
        return model

    def check_models(self, names) -> None:
        for name in names:
            if name != "encoder":
                super().check_models([name])

    def fingerprint_source(self, name: str) -> str | dict[str, Any]:
        if name == "encoder":
            return {"encoder": "avg_pool", "pool": POOL}
        return super().fingerprint_source(name)

    def weights_file(self, name: str) -> tuple[str, str] | None:
        return None if name == "encoder" else super().weights_file(name)

    def training_step(self, ctx: StepContext, inputs: dict[str, Any]) -> TrainingStep:
        """DDPM: t ~ U{0..T-1}, cosine alpha-bar, x_t = sqrt(ab) x0 + sqrt(1-ab) eps; target eps."""
        x0 = inputs["latents_0"].to(ctx.device, torch.float32)
        steps = ctx.settings["noise_steps"]
        draw = ctx.draws.randint(steps, x0.shape[0])
        eps = ctx.draws.randn(x0.shape, device=x0.device)
        t = draw.to(x0.device, torch.float32) / steps
        alpha_bar = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        scale = alpha_bar.sqrt().view(-1, 1, 1, 1)
        x_t = scale * x0 + (1 - alpha_bar).sqrt().view(-1, 1, 1, 1) * eps
        inputs.update(x_t=x_t, t=t, eps=eps)
        return TrainingStep((x_t, t, inputs["label"].to(ctx.device)), eps)
