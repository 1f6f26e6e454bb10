"""Train the demo's VAE (encoder + decoder) on the digits, deterministically, in seconds on a CPU.

So the demo's latents mean something and DiT samples decode to images. The images are the exact
tensors the demo preprocesses (`digits.digit_image` -> `images.image_to_tensor`, what
`write_digits_dataset` + `data.load_sample` give: PNG is lossless). Every 10th digit is held out
for measuring. The loss is pixel MSE plus a small KL term on the posterior (SD-style VAE, sampled
with a seeded generator), so latents stay near unit scale and the decoder tolerates their noise.
After training, `scaling_factor` = 1 / std of the training set's mean latents (like SD's 0.18215)
is stored in both configs, so the encoder's scaled latents have about unit variance.

Same seed -> bitwise-identical weights on the same machine and torch build: fixed init seed, a
seeded generator for batch order and posterior noise, CPU, one thread during training.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitstage.pipelines.demo.vae import VAEDecoder, VAEEncoder

IMAGE_SIZE = 64
HOLDOUT_EVERY = 10  # digits 0, 10, 20, ... are held out (180 of 1,797)
STEPS = 300
BATCH_SIZE = 32
LEARNING_RATE = 5e-3
KL_WEIGHT = 1e-3
LOGVAR_RANGE = (-30.0, 20.0)  # as diffusers' DiagonalGaussianDistribution clamps it
EVAL_BATCH = 256


@dataclass
class AutoencoderReport:
    """What a training run measured: held-out MSE (trained vs. at init), latent scale, time."""

    heldout_mse: float
    untrained_heldout_mse: float
    train_mse: float
    latent_std: float
    latent_mean: float
    scaling_factor: float
    steps: int
    seconds: float


@dataclass
class TrainedAutoencoder:
    """A trained encoder/decoder pair (scaling_factor set in both) and its report."""

    encoder: VAEEncoder
    decoder: VAEDecoder
    report: AutoencoderReport


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread (results do not depend on the caller's thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=2)
def _digit_images(size: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    from splitstage.data.digits import digit_image
    from splitstage.data.images import image_to_tensor

    pixels = load_digits().images
    return torch.stack([image_to_tensor(digit_image(p, size)) for p in pixels])


def digit_images(size: int = IMAGE_SIZE) -> torch.Tensor:
    """All 1,797 digits as [N,3,size,size] in [-1,1], equal to what load_sample gives."""
    return _digit_images(size).clone()


def split_indices(count: int, every: int = HOLDOUT_EVERY) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) sample indices: every `every`-th sample (0, every, ...) is held out."""
    index = torch.arange(count)
    held = index % every == 0
    return index[~held], index[held]


@torch.no_grad()
def mean_latents(encoder: VAEEncoder, images: torch.Tensor) -> torch.Tensor:
    """Unscaled posterior means of images, in evaluation batches."""
    return torch.cat([encoder.moments(b)[0] for b in images.split(EVAL_BATCH)])


@torch.no_grad()
def reconstruction_mse(encoder: VAEEncoder, decoder: VAEDecoder, images: torch.Tensor) -> float:
    """Mean squared error of decoder(encoder(images)) in [-1,1] pixel space."""
    total = 0.0
    for batch in images.split(EVAL_BATCH):
        total += F.mse_loss(decoder(encoder(batch)), batch, reduction="sum").item()
    return total / images.numel()


def kl_divergence(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """Mean per-element KL(N(mean, exp(logvar)) || N(0, 1))."""
    return 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless seeded shuffles of range(count), cut into full batches."""
    while True:
        order = torch.randperm(count, generator=generator)
        for start in range(0, count - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def _set_scaling(model: VAEEncoder | VAEDecoder, scaling_factor: float) -> None:
    model.scaling_factor = scaling_factor
    model.config["scaling_factor"] = scaling_factor


def train_autoencoder(
    seed: int = 0,
    steps: int = STEPS,
    batch_size: int = BATCH_SIZE,
    learning_rate: float = LEARNING_RATE,
    kl_weight: float = KL_WEIGHT,
    images: torch.Tensor | None = None,
) -> TrainedAutoencoder:
    """Train a fresh VAEEncoder/VAEDecoder on the training split; measure on the held-out one."""
    images = digit_images() if images is None else images
    train_index, held_index = split_indices(len(images))
    train, held = images[train_index], images[held_index]
    started = time.perf_counter()
    with one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder, decoder = VAEEncoder(), VAEDecoder()
        untrained = reconstruction_mse(encoder, decoder, held)
        params = [*encoder.parameters(), *decoder.parameters()]
        optimizer = torch.optim.Adam(params, lr=learning_rate)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.15
        )
        generator = torch.Generator().manual_seed(seed)
        batches = _batches(len(train), batch_size, generator)
        for _ in range(steps):
            batch = train[next(batches)]
            mean, logvar = encoder.moments(batch)
            logvar = logvar.clamp(*LOGVAR_RANGE)
            noise = torch.randn(mean.shape, generator=generator)
            sample = mean + (0.5 * logvar).exp() * noise
            loss = F.mse_loss(decoder.decode_unscaled(sample), batch)
            loss = loss + kl_weight * kl_divergence(mean, logvar)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        encoder.eval().requires_grad_(False)
        decoder.eval().requires_grad_(False)
        latents = mean_latents(encoder, train)
        std = latents.std().item()
        scaling = float(f"{1.0 / std:.6g}")  # a short, exact-in-JSON number
        _set_scaling(encoder, scaling)
        _set_scaling(decoder, scaling)
        report = AutoencoderReport(
            heldout_mse=reconstruction_mse(encoder, decoder, held),
            untrained_heldout_mse=untrained,
            train_mse=reconstruction_mse(encoder, decoder, train),
            latent_std=std,
            latent_mean=latents.mean().item(),
            scaling_factor=scaling,
            steps=steps,
            seconds=time.perf_counter() - started,
        )
    return TrainedAutoencoder(encoder, decoder, report)


@functools.lru_cache(maxsize=4)
def _trained(seed: int) -> TrainedAutoencoder:
    return train_autoencoder(seed)


def trained_autoencoder(seed: int = 0) -> TrainedAutoencoder:
    """train_autoencoder(seed), trained once a process (a copy: callers may change it)."""
    return copy.deepcopy(_trained(seed))


def clear_trained_cache() -> None:
    """Forget the trained autoencoders (so the next trained_autoencoder call trains again)."""
    _trained.cache_clear()
