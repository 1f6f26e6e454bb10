"""Distribution checks for per-step draws: two-sample KS, standard normal noise, binomial rates."""

from __future__ import annotations

import math

import torch
from scipy import stats

P_MIN = 0.01  # a check fails at a KS p-value at or below this


def ks_p(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov p-value of the flattened values."""
    a, b = ours.double().flatten().numpy(), theirs.double().flatten().numpy()
    return float(stats.ks_2samp(a, b).pvalue)


def assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    """Two samples pass a two-sample KS test at p > P_MIN; returns p."""
    p = ks_p(ours, theirs)
    assert p > P_MIN, f"{what}: KS p = {p:.3g} <= {P_MIN}"
    return p


def assert_standard_normal(noise: torch.Tensor, what: str, ks_values: int | None = None) -> None:
    """Mean, std within 3 SE of N(0, 1); KS vs N(0, 1) p > P_MIN on the first `ks_values`."""
    x = noise.double().flatten()
    n = x.numel()
    mean, std = float(x.mean()), float(x.std())
    assert abs(mean) <= 3 / math.sqrt(n), f"{what}: mean {mean:.4g} over {n} values"
    assert abs(std - 1) <= 3 / math.sqrt(2 * n), f"{what}: std {std:.4g} over {n} values"
    p = float(stats.kstest(x[:ks_values].numpy(), "norm").pvalue)
    assert p > P_MIN, f"{what}: KS vs N(0, 1) p = {p:.3g} <= {P_MIN}"


def assert_rate(hits: int, count: int, chance: float, what: str) -> None:
    """`hits` of `count` within 3 binomial standard deviations of count * chance."""
    sd = math.sqrt(count * chance * (1 - chance))
    assert abs(hits - count * chance) <= 3 * sd, f"{what}: {hits} of {count}, chance {chance}"


def assert_close_means(ours: torch.Tensor, theirs: torch.Tensor, what: str, within: float = 2.0):
    """The two samples' means differ by at most `within` standard errors of the difference."""
    a, b = ours.double(), theirs.double()
    se = math.sqrt(float(a.var()) / a.numel() + float(b.var()) / b.numel())
    gap = abs(float(a.mean()) - float(b.mean()))
    means = f"{float(a.mean()):.4g} vs {float(b.mean()):.4g}"
    assert gap <= within * se, f"{what}: means {means}, SE {se:.3g}"
