"""The lazy registry of pipeline families: name -> config group, imported only when a job uses it.

Built-in families are listed here by import path; other packages add theirs through the
`splitstage.families` entry-point group (name = family name, value = `module:ConfigGroup`), or
code calls `register_family`. Torch-free: a family's heavy imports happen in its family class,
which its config group names (`family_class`) and `pipelines.family.family_for` imports.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from splitstage.splitter import UserError

ENTRY_POINT_GROUP = "splitstage.families"
BUILTIN_FAMILIES = {
    "demo": "splitstage.pipelines.demo.config:DemoPipelineConfig",
    "sd": "splitstage.pipelines.diffusers.config:SDPipelineConfig",
    "sdxl": "splitstage.pipelines.diffusers.config:SDXLPipelineConfig",
    "sd3": "splitstage.pipelines.diffusers.config:SD3PipelineConfig",
    "flux": "splitstage.pipelines.diffusers.config:FluxPipelineConfig",
    "flux_kontext": "splitstage.pipelines.diffusers.config:FluxKontextPipelineConfig",
    "qwenimage": "splitstage.pipelines.diffusers.config:QwenImagePipelineConfig",
    "qwenimage_edit": "splitstage.pipelines.diffusers.config:QwenImageEditPipelineConfig",
    "wan": "splitstage.pipelines.diffusers.config:WanPipelineConfig",
    "wan_i2v": "splitstage.pipelines.diffusers.config:WanI2VPipelineConfig",
    "zimage": "splitstage.pipelines.diffusers.config:ZImagePipelineConfig",
    "flux2": "splitstage.pipelines.diffusers.config:Flux2PipelineConfig",
    "diffsynth": "splitstage.pipelines.diffsynth.config:DiffSynthPipelineConfig",
}
_registered: dict[str, Any] = {}


class UnknownFamilyError(UserError, ValueError):
    """A `[pipeline] name` that no registered family has."""


def import_object(path: str) -> Any:
    """`module:attribute` -> the object."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _plugins() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def register_family(name: str, config_group: type | str) -> None:
    """Register a family's config group (a class, or `module:Class`) under `name`."""
    _registered[name] = config_group


def family_names() -> list[str]:
    """Every family a job may name, built-in first."""
    names = [*BUILTIN_FAMILIES, *_registered, *_plugins()]
    return list(dict.fromkeys(names))


def config_class(name: str) -> type:
    """The config group of family `name`; a one-line error listing the families otherwise."""
    source = _registered.get(name) or BUILTIN_FAMILIES.get(name) or _plugins().get(name)
    if source is None:
        raise UnknownFamilyError(
            f"unknown pipeline family {name!r}; registered families: {', '.join(family_names())}"
        )
    return import_object(source) if isinstance(source, str) else source
