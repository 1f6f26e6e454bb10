"""Widths one component hands another, checked from the folder's config files before any model
loads: a text encoder, VAE or denoiser of the wrong size is refused in one line naming both parts
and their config fields, not found as a shape traceback in the ranks after stage 1."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitstage.config.job import ConfigError


@dataclass(frozen=True)
class Width:
    """One config field of one component (a dotted path for nested configs), times a factor."""

    component: str
    field: str  # "hidden_size", or alternatives "text_config.hidden_size|hidden_size"
    factor: int = 1

    def read(self, config: Mapping[str, Any]) -> int | None:
        """The first stated alternative's value times the factor; None where none is stated."""
        for path in self.field.split("|"):
            value: Any = config
            for part in path.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value * self.factor
        return None

    def text(self, value: int | None = None) -> str:
        """ "4 x the vae's latent_channels" (with "(16)" once read)."""
        times = f"{self.factor} x " if self.factor != 1 else ""
        read = f" ({value // self.factor})" if value is not None else ""
        name = self.field.split("|")[0].rsplit(".", 1)[-1]
        return f"{times}the {self.component}'s {name}{read}"


@dataclass(frozen=True)
class ShapeLink:
    """What `given` components produce must equal what `taker` expects (sums of widths)."""

    given: tuple[Width, ...]
    taker: Width
    why: str  # what flows between them, e.g. "the text encoder's hidden states"
    at_most: bool = False  # the taker pads what it is given up to its width

    @property
    def components(self) -> set[str]:
        """Every component the link reads a config of."""
        return {w.component for w in (*self.given, self.taker)}


def link(
    given: Sequence[tuple[str, str] | Width],
    taker: tuple[str, str],
    why: str,
    *,
    at_most: bool = False,
) -> ShapeLink:
    """A link from (component, field) pairs or widths: `link([("vae", "z_dim")], ...)`."""
    widths = tuple(w if isinstance(w, Width) else Width(*w) for w in given)
    return ShapeLink(widths, Width(*taker), why, at_most)


def check_component_shapes(
    links: Sequence[ShapeLink],
    has: Callable[[str], bool],
    config: Callable[[str], Mapping[str, Any]],
) -> None:
    """Every link whose components the folder holds and whose fields their configs state: the
    sizes agree, or one line naming the components, fields, values and what to change."""
    for link in links:
        if not all(has(name) for name in link.components):
            continue  # a missing component is named by the model checks
        values = [w.read(config(w.component)) for w in link.given]
        taken = link.taker.read(config(link.taker.component))
        if taken is None or None in values:
            continue  # a config that does not state the field: the model's default decides
        given = sum(v for v in values if v is not None)
        if given == taken or (link.at_most and given < taken):
            continue
        parts = " + ".join(w.text(v) for w, v in zip(link.given, values, strict=True))
        sum_text = f" = {given}" if len(link.given) > 1 else ""
        verb = "exceeds" if link.at_most else "does not match"
        owners = list(
            dict.fromkeys(w.component for w in link.given if w.component != link.taker.component)
        )
        raise ConfigError(
            f"models: {parts}{sum_text} {verb} {link.taker.text(taken)}, which takes "
            f"{link.why}: these parts come from different models; give the "
            f"{' and '.join(owners)} made for this {link.taker.component} "
            f"([models.{owners[0]}] weights = 'path/to/{owners[0]}/'), or a pretrained folder "
            "whose parts all match"
        )
