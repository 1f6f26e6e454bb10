"""DiffSynth model files without loading them, and DiffSynth's `from_pretrained` on one of them.

Which pipeline slot a file fills is DiffSynth's own logic: the file's key-and-shape hash picks its
MODEL_CONFIGS entries, and the pipeline's `from_pretrained` fetches them into slots. `stand_ins`
runs that `from_pretrained` over models built on the meta device (headers read, no weights), so
`validate`, preflight and stage 2 know every slot's file and class for free, and a stage holds
those meta models as stand-ins for the slots it does not load; `load_slot` then loads exactly
one slot's model with DiffSynth's own loader, its file and its entry only, the file's tensors
mapped from disk rather than copied (DiffSynth's DiskMap clones every tensor).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from splitstage.config.base_group import ConfigError
from splitstage.pipelines.diffsynth.config import (
    INSTALL_HINT,
    PIPELINES,
    DiffSynthPipelineConfig,
    RegisteredModel,
)
from splitstage.storage.safetensors_io import mapped_state, read_header

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_CONFIGS_LOCK = threading.Lock()  # DiffSynth's MODEL_CONFIGS is one global list


@dataclass(frozen=True)
class SlotSource:
    """Where a pipeline slot's model comes from: its file and its MODEL_CONFIGS entry."""

    path: str
    entry: dict[str, Any]


def diffsynth_module(name: str) -> Any:
    """Import a diffsynth module, or one line saying how to install it."""
    os.environ.setdefault("DIFFSYNTH_SKIP_DOWNLOAD", "True")  # local files only, never a hub
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ConfigError(
            f"pipeline.name = 'diffsynth' needs DiffSynth-Studio ({error}); {INSTALL_HINT}"
        ) from None
    except RuntimeError as error:  # a torchvision build that does not match torch
        raise ConfigError(
            f"pipeline.name = 'diffsynth': importing {name} failed ({str(error).splitlines()[0]}); "
            f"install the torchvision build matching your torch; {INSTALL_HINT}"
        ) from None


def pipeline_class(config: DiffSynthPipelineConfig) -> type:
    """The DiffSynth pipeline class the config names."""
    module = diffsynth_module(PIPELINES[config.pipeline_class][0])
    return getattr(module, config.pipeline_class)


def class_path(cls: type) -> str:
    """`module.Class` of a class, as MODEL_CONFIGS names them."""
    return f"{cls.__module__}.{cls.__qualname__}"


def file_hash(path: str) -> str:
    """DiffSynth's `hash_model_file` of a safetensors file (md5 of its sorted keys and shapes),
    from the header alone: no tensor is read."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = read_header(size.to_bytes(8, "little") + f.read(size))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"pipeline.model_paths: {path} is not a readable safetensors file ({error}); "
            "splitstage reads DiffSynth model files as safetensors (convert .bin/.pth files)"
        ) from None
    keys = []
    for key, spec in header.items():
        if key != "__metadata__":
            keys += [f"{key}:{'_'.join(str(n) for n in spec['shape'])}", key]
    return hashlib.md5(",".join(sorted(keys)).encode()).hexdigest()


def registry_entry(model: RegisteredModel) -> dict[str, Any]:
    """A MODEL_CONFIGS entry for a registered file (its hash from the file's header)."""
    entry = {"model_hash": file_hash(model.path), "model_name": model.model_name}
    entry["model_class"] = model.model_class
    if model.extra_kwargs:
        entry["extra_kwargs"] = dict(model.extra_kwargs)
    return entry


def file_entries(path: str, registered: Sequence[RegisteredModel]) -> list[dict[str, Any]]:
    """Every MODEL_CONFIGS entry DiffSynth loads a file as (one file may hold several models,
    e.g. a VAE's encoder and decoder), or one line naming what to register."""
    configs = diffsynth_module("diffsynth.configs.model_configs").MODEL_CONFIGS
    digest = file_hash(path)
    found = [e for e in [*configs, *map(registry_entry, registered)] if e["model_hash"] == digest]
    if not found:
        raise ConfigError(
            f"pipeline.model_paths: DiffSynth does not know the model in {path} (key hash "
            f"{digest}); add it to [[pipeline.register_models]] with its model_name and "
            "model_class"
        )
    return found


def meta_model(entry: dict[str, Any]) -> torch.nn.Module:
    """An entry's model class built with its parameters on the meta device, in no dtype yet."""
    from accelerate import init_empty_weights

    pool = diffsynth_module("diffsynth.models.model_loader").ModelPool()
    cls = pool.import_model_class(entry["model_class"])
    with init_empty_weights():  # parameters on meta; buffers and tables stay real
        return cls(**entry.get("extra_kwargs", {}))


@contextmanager
def _pool_for(cls: type, pool: Any) -> Iterator[None]:
    """`cls.from_pretrained` fetches its slots from `pool` instead of loading files."""
    own = cls.__dict__.get("download_and_load_models")
    cls.download_and_load_models = lambda self, *args, **kwargs: pool
    try:
        yield
    finally:
        if own is None:
            del cls.download_and_load_models
        else:
            cls.download_and_load_models = own


def meta_pipeline(config: DiffSynthPipelineConfig) -> Any:
    """DiffSynth's `from_pretrained` over every model file built on the meta device (its slot
    rules, e.g. Wan's dit / dit2, unchanged; nothing loaded; each model's `.splitstage_source`
    is its file and entry): the slots it fills and the sizes its models set (Wan 2.2's VAE sets
    the division factor), known before any weight is read."""
    pool = diffsynth_module("diffsynth.models.model_loader").ModelPool()
    for path in config.model_paths:
        for entry in file_entries(path, config.register_models):
            model = meta_model(entry)
            model.splitstage_source = SlotSource(path, entry)
            pool.model.append(model)
            pool.model_name.append(entry["model_name"])
            pool.model_path.append(path)
    cls = pipeline_class(config)
    with _CONFIGS_LOCK, _pool_for(cls, pool), contextlib.redirect_stdout(io.StringIO()):
        return cls.from_pretrained(
            torch_dtype=DTYPES[config.torch_dtype], device="cpu", tokenizer_config=None
        )


def stand_ins(pipe: Any) -> dict[str, torch.nn.Module]:
    """Slot -> the meta pipeline's model there. A stage that does not load a slot holds its
    stand-in there, as DiffSynth's split training holds an offloaded model: units that look at
    another slot's structure (Z-Image's prompt unit picks its encoding by the DiT's
    `siglip_embedder`) see what they see in DiffSynth."""
    return {
        slot: model.to("meta").requires_grad_(False).eval()  # its buffers too: it holds nothing
        for slot, model in pipe.named_children()
        if hasattr(model, "splitstage_source")
    }


@contextmanager
def _only_entries(entries: Sequence[dict[str, Any]]) -> Iterator[None]:
    """DiffSynth's global MODEL_CONFIGS holds only `entries` for one load, so a file is loaded
    as exactly the models asked for (not, e.g., a VAE's decoder beside its encoder)."""
    configs = diffsynth_module("diffsynth.configs.model_configs").MODEL_CONFIGS
    with _CONFIGS_LOCK:
        saved = list(configs)
        configs[:] = list(entries)
        try:
            yield
        finally:
            configs[:] = saved


def training_mode(pipe: Any) -> Any:
    """As DiffSynth's switch_pipe_to_training_mode: the training timesteps, models frozen."""
    pipe.scheduler.set_timesteps(1000, training=True)
    pipe.requires_grad_(False).eval()
    return pipe


def skeleton(config: DiffSynthPipelineConfig) -> Any:
    """The pipeline object without models (its units and model_fn): built in milliseconds."""
    return pipeline_class(config)(device="cpu", torch_dtype=DTYPES[config.torch_dtype])


def load_slot(
    config: DiffSynthPipelineConfig, source: SlotSource, device: torch.device, tokenizer: bool
) -> Any:
    """DiffSynth's `from_pretrained` on one slot's file as its entry alone (plus the tokenizer,
    and the processor where the config names one, when asked): a pipeline holding that one
    model, in training mode. The file's tensors go in as a mapped state dict (DiffSynth's
    ModelConfig.state_dict): its converter, load_state_dict (assign) and dtype / device move
    run as for a file it reads itself."""
    core = diffsynth_module("diffsynth.core")
    model = core.ModelConfig(path=source.path, state_dict=mapped_state(source.path))
    extra = {}
    if tokenizer and config.processor_path is not None:  # QwenImagePipeline's (checked)
        extra["processor_config"] = core.ModelConfig(path=config.processor_path)
    with _only_entries([source.entry]):
        pipe = pipeline_class(config).from_pretrained(
            torch_dtype=DTYPES[config.torch_dtype],
            device=str(device),
            model_configs=[model],
            tokenizer_config=core.ModelConfig(path=config.tokenizer_path) if tokenizer else None,
            **extra,
        )
    return training_mode(pipe)
