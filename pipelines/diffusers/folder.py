"""A diffusers pipeline folder on disk: its components, their configs and weights files, and
`[models.<component>]` overrides (a folder, one .safetensors file or a sharded index)."""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from splitstage.config.job import ConfigError, ModelConfig
from splitstage.storage.safetensors_io import index_weight_map, is_index_path

WEIGHT_NAMES = ("diffusion_pytorch_model", "model")  # diffusers' and transformers' file stems
LIBRARIES = ("diffusers", "transformers")  # where model_index.json's classes may come from
PIPELINE_FAMILIES = {  # model_index.json _class_name -> the family that trains it (its
    "StableDiffusionPipeline": "sd",  # pipeline_classes; the families import this module)
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxKontextPipeline": "flux_kontext",
    "QwenImagePipeline": "qwenimage",
    "QwenImageEditPipeline": "qwenimage_edit",
    "QwenImageEditPlusPipeline": "qwenimage_edit",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan_i2v",
    "ZImagePipeline": "zimage",
    "Flux2Pipeline": "flux2",
}
# Config keys that fix what a component exchanges with the others (latent channels, text widths,
# conditioning): an override must keep the folder's, since the other components stay.
INTERFACE_KEYS = (
    "in_channels",
    "out_channels",
    "latent_channels",
    "cross_attention_dim",
    "addition_embed_type",
    "projection_class_embeddings_input_dim",
    "joint_attention_dim",
    "pooled_projection_dim",
    "guidance_embeds",
    "patch_size",
    "hidden_size",
    "projection_dim",
    "d_model",
)
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
    field: str = ""  # the config field the files come from, for messages

    @property
    def source(self) -> str:
        """The field to name in messages about this component's files."""
        return self.field or f"models.{self.name}"

    def weight_files(self) -> list[Path]:
        """Every file the weights are in (the shards of an index, or the one file)."""
        if self.weights is None:
            return []
        if is_index_path(str(self.weights)):
            try:
                weight_map = index_weight_map(self.weights.read_bytes())
            except (OSError, ValueError) as error:
                raise ConfigError(f"{self.source}: {self.weights} {error}") from None
            shards = [self.weights.parent / shard for shard in sorted(set(weight_map.values()))]
            missing = [shard.name for shard in shards if not shard.is_file()]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise ConfigError(
                    f"{self.source}: {self.weights} lists shard {missing[0]}{more}, which is "
                    f"not in {self.weights.parent}; download every shard next to the index"
                )
            return [self.weights, *shards]
        return [self.weights]


def read_json(path: Path, what: str, field: str = "") -> dict[str, Any]:
    """A JSON object from a file, or one line naming the field (if given) and the file."""
    where = f"{field}: {path}" if field else str(path)
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such {what} file") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: not a readable JSON {what} ({error})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: the {what} is not a JSON object")
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
        self._components: dict[str, Component] = {}

    @cached_property
    def index(self) -> dict[str, Any]:
        """model_index.json, checked to be a pipeline this family trains."""
        index = read_json(self.root / "model_index.json", "model_index.json", "pipeline.pretrained")
        found = index.get("_class_name")
        if self.expected_classes and found not in self.expected_classes:
            what = f"holds a {found}" if found else "names no pipeline class (_class_name)"
            family = PIPELINE_FAMILIES.get(found) if isinstance(found, str) else None
            fix = (
                f"set [pipeline] name = '{family}' (the family that trains it)"
                if family
                else "use a folder of a pipeline some family trains (see `splitstage families`)"
            )
            raise ConfigError(
                f"pipeline.pretrained: {self.root} {what} (model_index.json), which this "
                f"family does not train (it trains {', '.join(self.expected_classes)}); {fix}"
            )
        self.scheduler_config  # noqa: B018 - every family trains with the folder's schedule
        return index

    @cached_property
    def scheduler_config(self) -> dict[str, Any]:
        """scheduler/scheduler_config.json (every family builds its training schedule from it)."""
        return read_json(
            self.root / "scheduler" / "scheduler_config.json",
            "scheduler config",
            "pipeline.pretrained (scheduler/)",
        )

    def has(self, name: str) -> bool:
        """Whether the folder lists a component (`[null, null]` entries do not count)."""
        entry = self.index.get(name)
        return (
            isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)
        )

    def component(self, name: str) -> Component:
        """A component with its override applied, checked once: its class exists, its config
        reads, its weights files are there (an override's fit the architecture), its tokenizer
        loads (text encoders)."""
        if name not in self._components:
            component = self._component(name)
            self._check(component)
            self._components[name] = component
        return self._components[name]

    def _component(self, name: str) -> Component:
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
            if override.key_prefix:
                raise ConfigError(
                    f"models.{name}.key_prefix: diffusers families read {name} weights as "
                    "diffusers saves them, keys unprefixed, or a BFL FLUX single file as BFL ships "
                    "it; remove key_prefix"
                )
            config_dir, weights = _override_paths(Path(override.weights), config_dir, field)
        if not (config_dir / "config.json").is_file():
            what = "has no config.json" if config_dir.is_dir() else "does not exist"
            raise ConfigError(
                f"{field}: {config_dir} {what}; '{name}' needs a folder with its config.json and "
                f"safetensors weights (as diffusers saves {name}/): restore it, or point "
                f"[models.{name}] weights at one"
            )
        if weights is None:
            raise ConfigError(
                f"{field}: {config_dir} has no safetensors weights for '{name}' (looked for "
                f"{' / '.join(WEIGHT_NAMES)}.safetensors[.index.json]); .bin / .ckpt files are "
                "not read (pickle): convert them to safetensors"
            )
        return Component(name, library, class_name, config_dir, weights, field)

    def _check(self, component: Component) -> None:
        """What `component` promises, checked before anything is launched."""
        name, library, class_name = component.name, component.library, component.class_name
        read_json(component.config_dir / "config.json", f"{name} config", component.source)
        where = f"pipeline.pretrained: {self.root / 'model_index.json'} gives '{name}'"
        if library not in LIBRARIES:
            raise ConfigError(
                f"{where} library {library!r}; only {' and '.join(LIBRARIES)} classes are built"
            )
        module = importlib.import_module(library)
        try:
            found = isinstance(getattr(module, class_name, None), type)
        except (ImportError, RuntimeError):
            found = False
        if not found:
            version = getattr(module, "__version__", "")
            raise ConfigError(
                f"{where} the class {library}.{class_name}, which {library} {version} does not "
                "have; fix model_index.json or upgrade it"
            )
        component.weight_files()  # an index's shards are all there
        if name in self.overrides:
            from splitstage.pipelines.diffusers.components import check_fits

            self._check_interface(component)
            check_fits(component)
        if name.startswith("text_encoder"):
            from splitstage.pipelines.diffusers.text import load_tokenizer

            load_tokenizer(self.root, name)

    def _check_interface(self, override: Component) -> None:
        """An override with its own config.json keeps the sizes the other components use."""
        own = self.root / override.name / "config.json"
        if override.config_dir == own.parent or not own.is_file():
            return
        mine = read_json(override.config_dir / "config.json", "config", override.source)
        theirs = read_json(
            own, f"{override.name} config", f"pipeline.pretrained ({override.name}/)"
        )
        differ = [k for k in INTERFACE_KEYS if k in mine and k in theirs and mine[k] != theirs[k]]
        if differ:
            key = differ[0]
            raise ConfigError(
                f"{override.source}: {override.config_dir / 'config.json'} has {key}="
                f"{mine[key]!r} but {own} has {theirs[key]!r}; the folder's other components "
                f"work with the latter: give a {override.name} of this model (e.g. a fine-tune)"
            )

    def config(self, name: str) -> dict[str, Any]:
        """A component's config.json (scheduler: scheduler_config.json)."""
        if name == "scheduler":
            return self.scheduler_config
        component = self.component(name)
        return read_json(component.config_dir / "config.json", f"{name} config", component.source)


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
