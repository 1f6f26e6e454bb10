"""Readable labels of param-spec groups (an aspect bucket's samples share one spec).

A label names what differs between the groups (a bucket's latents, e.g. `input_latents 4x64x96`)
and, when the job's image sizes tell it, leads with the images' size in pixels as
`validation.sizes` writes sizes (WIDTHxHEIGHT, e.g. `768x512 (input_latents 4x64x96)`): a cached
tensor whose last two sides are the same whole fraction of one image size in every group (a
latent's h x w under one VAE factor). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ImageSizes = Sequence[tuple[int, int]] | None  # (height, width) pixels a job's images train at


def _short_label(sig: tuple) -> str:
    """'param AxBxC' of the largest tensor param (the latents, for images), else 'json'."""
    tensors = [(int(np.prod(s[2])), s[0], s[2]) for s in sig if len(s) == 3]
    if not tensors:
        return "json only"
    _, name, shape = max(tensors, key=lambda t: (t[0], t[1]))
    return f"{name} {'x'.join(map(str, shape)) or 'scalar'}"


def _spec_labels(order: list[tuple]) -> list[str]:
    """One label per group: the params whose dtype or shape differ between groups (a bucket's
    latents, e.g. 'input_latents 4x6x10'), so labels are short and distinct."""
    if len(order) == 1:
        return [_short_label(order[0])]
    specs = [{s[0]: s[1:] for s in sig} for sig in order]
    names = sorted({name for spec in specs for name in spec})
    varying = [n for n in names if len({spec.get(n) for spec in specs}) > 1]
    dtypes = {n for n in varying if len({spec.get(n, (None,))[0] for spec in specs}) > 1}

    def part(name: str, spec: tuple | None) -> str:
        if spec is None:
            return f"no {name}"
        if spec == ("json",):
            return f"{name} json"
        shape = "x".join(map(str, spec[1])) or "scalar"
        return f"{name} {spec[0]} {shape}" if name in dtypes else f"{name} {shape}"

    return [", ".join(part(n, spec.get(n)) for n in varying) for spec in specs]


def group_labels(order: list[tuple], image_sizes: ImageSizes = None) -> list[str]:
    """One distinct-enough label per group signature of `order` (see the module docstring)."""
    labels = _spec_labels(order)
    pixels = pixel_sizes(order, image_sizes) if image_sizes else None
    if pixels is None:
        return labels
    return [f"{w}x{h} ({label})" for (h, w), label in zip(pixels, labels, strict=True)]


def pixel_sizes(order: list[tuple], image_sizes: ImageSizes) -> list[tuple[int, int]] | None:
    """Each group's image (height, width): from the one tensor param (3+ dims) that every
    group has and whose last two sides times one factor give one of `image_sizes` in every
    group (several such params, e.g. a VAE's latent_mean and latent_logvar, must agree); None
    when no param does, or two disagree."""
    found = []
    names = sorted({s[0] for sig in order for s in sig if len(s) == 3 and len(s[2]) >= 3})
    for name in names:
        sides = [_sides(sig, name) for sig in order]
        if None in sides:
            continue
        factors = None
        for h, w in sides:
            fit = {H // h for H, W in image_sizes if H % h == 0 == W % w and H // h == W // w}
            factors = fit if factors is None else factors & fit
        if factors and len(factors) == 1:
            (factor,) = factors
            found.append([(factor * h, factor * w) for h, w in sides])
    distinct = {tuple(sizes) for sizes in found}  # latent_mean and latent_logvar agree
    return found[0] if len(distinct) == 1 else None


def _sides(sig: tuple, name: str) -> tuple[int, int] | None:
    """The last two sides of tensor param `name` in signature `sig` (None: absent, < 3 dims)."""
    for spec in sig:
        if spec[0] == name and len(spec) == 3 and len(spec[2]) >= 3 and min(spec[2][-2:]) > 0:
            return int(spec[2][-2]), int(spec[2][-1])
    return None
