"""A diffusers pipeline folder on disk: its components, their configs and weights files, and
`[models.<component>]` overrides (a folder, one .safetensors file or a sharded index)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from splitstage.pipelines.config import ConfigError, ModelConfig
from splitstage.pipelines.safetensors_io import index_weight_map, is_index_path

WEIGHT_NAMES = ("diffusion_pytorch_model", "model")  # diffusers' and transformers' file stems
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_HINT = (
    "download it once (`hf download {id} --local-dir DIR`, on a machine with network) and set "
    "pretrained = 'DIR'"
)


@dataclass(frozen=True)
class Component:
    """One component of the folder: its library class, config folder and weights file."""

    name: str
    library: str  # "diffusers" | "transformers"
    class_name: str
    config_dir: Path  # holds config.json
    weights: Path | None  # a .safetensors file or a .safetensors.index.json; None: none found

    def weight_files(self) -> list[Path]:
        """Every file the weights are in (the shards of an index, or the one file)."""
        if self.weights is None:
            return []
        if is_index_path(str(self.weights)):
            try:
                weight_map = index_weight_map(self.weights.read_bytes())
            except (OSError, ValueError) as error:
                raise ConfigError(f"models.{self.name}: {self.weights} {error}") from None
            shards = sorted(set(weight_map.values()))
            return [self.weights, *(self.weights.parent / shard for shard in shards)]
        return [self.weights]


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from a file, or one line naming the file."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what} file") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable JSON {what} ({error})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: the {what} is not a JSON object")
    return value


def resolve_pretrained(pretrained: str) -> Path:
    """The local folder `[pipeline] pretrained` names: a path, or a Hub id already in the HF cache.

    Never downloads: training machines are often offline, and a silent multi-GB download in the
    middle of a launch is worse than one line saying where to put the folder.
    """
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ConfigError(
                f"pipeline.pretrained: {path} has no model_index.json; point it at a diffusers "
                "pipeline folder (the one holding model_index.json and unet/ or transformer/)"
            )
        return path
    if path.exists():
        raise ConfigError(
            f"pipeline.pretrained: {path} is a file; point it at a diffusers pipeline folder "
            "(model_index.json + component subfolders); a single file overrides one component "
            "in [models.<component>] weights"
        )
    if HUB_ID.match(pretrained) and not pretrained.startswith((".", "/")):
        cached = _hub_cache_snapshot(pretrained)
        if cached is not None:
            return cached
        raise ConfigError(
            f"pipeline.pretrained: '{pretrained}' is not a local folder and not in the Hugging "
            f"Face cache ({_hub_cache_dir()}); nothing is downloaded; "
            + HUB_HINT.format(id=pretrained)
        )
    raise ConfigError(f"pipeline.pretrained: folder {path} does not exist; fix the path")


def _hub_cache_dir() -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return str(HF_HUB_CACHE)


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of a Hub repo, if one is fully on disk (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return folder if (folder / "model_index.json").is_file() else None


def find_weights(folder: Path) -> Path | None:
    """The safetensors weights in a component folder: one file or a sharded index."""
    for stem in WEIGHT_NAMES:
        for name in (f"{stem}.safetensors", f"{stem}.safetensors.index.json"):
            if (folder / name).is_file():
                return folder / name
    found = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json"))
    return found[0] if len(found) == 1 else None


class PipelineFolder:
    """The folder's model_index.json, resolved components, and per-component overrides."""

    def __init__(self, pretrained: str, models: dict[str, ModelConfig], expected: tuple[str, ...]):
        self.root = resolve_pretrained(pretrained)
        self.overrides = models
        self.expected_classes = expected

    @cached_property
    def index(self) -> dict[str, Any]:
        """model_index.json, checked to be a pipeline this family trains."""
        index = read_json(self.root / "model_index.json", "model_index.json")
        found = index.get("_class_name")
        if self.expected_classes and found not in self.expected_classes:
            raise ConfigError(
                f"pipeline.pretrained: {self.root} holds a {found} (model_index.json), which this "
                f"family does not train (it trains {', '.join(self.expected_classes)}); set "
                f"[pipeline] name to the family of that folder (see `splitstage families`)"
            )
        return index

    def has(self, name: str) -> bool:
        """Whether the folder lists a component (`[null, null]` entries do not count)."""
        entry = self.index.get(name)
        return isinstance(entry, list) and len(entry) == 2 and entry[1] is not None

    def component(self, name: str) -> Component:
        """A component with its override applied (checked: config and weights exist)."""
        if not self.has(name):
            raise ConfigError(
                f"models.{name}: {self.root} has no '{name}' component (model_index.json); "
                "use a folder of the right model, or give the component in "
                f"[models.{name}] weights = 'path/to/{name}/'"
            )
        library, class_name = self.index[name]
        config_dir = self.root / name
        weights = find_weights(config_dir) if config_dir.is_dir() else None
        override = self.overrides.get(name)
        field = f"pipeline.pretrained ({name}/)"
        if override is not None:
            field = f"models.{name}.weights"
            if override.builder is not None:
                raise ConfigError(
                    f"models.{name}.builder: diffusers families load weights only; give "
                    f"weights = 'path/to/{name}/' (a folder, a .safetensors or an .index.json)"
                )
            config_dir, weights = _override_paths(Path(override.weights), config_dir, field)
        if not (config_dir / "config.json").is_file():
            raise ConfigError(f"{field}: {config_dir} has no config.json for '{name}'")
        if weights is None:
            raise ConfigError(
                f"{field}: {config_dir} has no safetensors weights for '{name}' (looked for "
                f"{' / '.join(WEIGHT_NAMES)}.safetensors[.index.json]); .bin / .ckpt files are "
                "not read (pickle): convert them to safetensors"
            )
        return Component(name, library, class_name, config_dir, weights)

    def config(self, name: str) -> dict[str, Any]:
        """A component's config.json (scheduler: scheduler_config.json)."""
        if name == "scheduler":
            return read_json(self.root / "scheduler" / "scheduler_config.json", "scheduler config")
        return read_json(self.component(name).config_dir / "config.json", f"{name} config")


def _override_paths(path: Path, default_config_dir: Path, field: str) -> tuple[Path, Path | None]:
    """(config folder, weights file) of an override: a folder, a file, or an index."""
    path = path.expanduser()
    if path.is_dir():
        return path, find_weights(path)
    if not path.is_file():
        raise ConfigError(f"{field}: {path} does not exist; fix the path")
    if not (path.name.endswith(".safetensors") or path.name.endswith(".safetensors.index.json")):
        raise ConfigError(
            f"{field}: {path} is neither a .safetensors file nor a .safetensors.index.json; "
            "other formats are not read (pickle): convert it to safetensors"
        )
    # A file alone: its architecture is the pretrained folder's (or one beside the file).
    beside = path.parent / "config.json"
    return (path.parent if beside.is_file() else default_config_dir), path
