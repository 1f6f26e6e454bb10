"""The random draws of one training step (noise, timesteps, caption dropout, latent samples), made
per sample: each sample draws from its own generator, seeded by (job seed, sample key, epoch).

So a sample's draws do not depend on how the batch is cut: the same job with batch 8, or batch 1
and accumulation 8, or 2 ranks of 4, or resumed on another world size, draws the same noise and
timestep for each sample and computes the same update. Split and unsplit runs see the same keys,
hence the same draws. A family draws through `Draws` (never the global RNG); a test or a
benchmark without sample keys uses `Draws.shared(generator)` (one generator for the whole batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch


def sample_seed(seed: int, key: str, epoch: int) -> int:
    """A 63-bit seed from (job seed, sample key, epoch): stable across processes and runs."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Draws:
    """Random tensors for a batch, each sample's rows from its own generator (or, `shared`, the
    whole batch from one generator); drawn on the generators' device, returned on `device`."""

    def __init__(self, generators: Sequence[torch.Generator | None], shared: bool = False):
        self.generators = list(generators)
        self.shared = shared

    @classmethod
    def per_sample(
        cls, seed: int, keys: Sequence[str], epoch: int, device: torch.device | str = "cpu"
    ) -> Draws:
        """One generator per sample key, on `device` (a CUDA generator draws on the GPU)."""
        generators = []
        for key in keys:
            generator = torch.Generator(device=device)
            generator.manual_seed(sample_seed(seed, key, epoch))
            generators.append(generator)
        return cls(generators)

    @classmethod
    def shared(cls, generator: torch.Generator | None = None) -> Draws:
        """The whole batch from one generator (None: torch's global RNG)."""
        return cls([generator], shared=True)

    @property
    def device(self) -> torch.device:
        """Where the generators draw."""
        generator = self.generators[0]
        return generator.device if generator is not None else torch.device("cpu")

    def each(self, count: int, draw: Callable[[torch.Generator | None, int], torch.Tensor]):
        """`draw(generator, rows)` for each sample (rows=1), concatenated on dim 0: the batch's
        `count` rows (shared: one call with rows=count)."""
        if self.shared:
            return draw(self.generators[0], count)
        if count != len(self.generators):
            raise ValueError(
                f"a draw for {count} samples from the draws of {len(self.generators)} samples"
            )
        return torch.cat([draw(generator, 1) for generator in self.generators])

    def randn(self, shape: Sequence[int], device=None, dtype=torch.float32) -> torch.Tensor:
        """Standard normal [shape], shape[0] = samples."""
        rest = tuple(shape[1:])
        out = self.each(
            shape[0], lambda g, n: torch.randn((n, *rest), generator=g, device=self.device)
        )
        return out.to(device=device or out.device, dtype=dtype)

    def rand(self, count: int, device=None) -> torch.Tensor:
        """Uniform [0, 1) [count], one per sample."""
        out = self.each(count, lambda g, n: torch.rand(n, generator=g, device=self.device))
        return out.to(device or out.device)

    def randint(self, high: int, count: int, device=None) -> torch.Tensor:
        """Integers in [0, high) [count], one per sample."""
        out = self.each(
            count, lambda g, n: torch.randint(0, high, (n,), generator=g, device=self.device)
        )
        return out.to(device or out.device)
