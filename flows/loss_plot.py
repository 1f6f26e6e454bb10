"""The loss curve as a small PNG (matplotlib's Agg canvas: no display, no global backend switch)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

from matplotlib.figure import Figure


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curve_png(
    losses: Sequence[float],
    title: str = "training loss",
    grad_norms: Sequence[float] | None = None,
) -> bytes:
    """PNG bytes of loss per update, with a moving average once there are enough points, and
    the pre-clip gradient norm per update below it when given."""
    norms = list(grad_norms or [])
    figure = Figure(figsize=(6.4, 5.2 if norms else 3.2), dpi=80)
    axes = figure.add_subplot(2, 1, 1) if norms else figure.add_subplot()
    updates = list(range(1, len(losses) + 1))
    axes.plot(updates, losses, marker="o" if len(losses) < 30 else None, lw=1, label="loss")
    if len(losses) >= 20:
        window = max(5, len(losses) // 20)
        axes.plot(updates, smooth(losses, window), lw=2, label=f"mean of {window}")
        axes.legend(loc="upper right")
    axes.set_xlabel("update")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if norms:
        below = figure.add_subplot(2, 1, 2, sharex=axes)
        below.plot(range(1, len(norms) + 1), norms, lw=1, color="tab:orange")
        below.set_xlabel("update")
        below.set_ylabel("grad norm")
        below.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def png_data_uri(png: bytes) -> str:
    """A data: URI that markdown can embed as an image."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
