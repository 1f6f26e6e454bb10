"""Building a DiffSynth pipeline object from local files: import, MODEL_CONFIGS, from_pretrained."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from splitstage.config.base_group import ConfigError
from splitstage.pipelines.diffsynth.config import (
    INSTALL_HINT,
    PIPELINES,
    DiffSynthPipelineConfig,
    RegisteredModel,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


def model_entry(path: str, registered: Sequence[RegisteredModel]) -> dict[str, Any]:
    """The MODEL_CONFIGS entry DiffSynth picks for a file (by its key-and-shape hash)."""
    configs = diffsynth_module("diffsynth.configs.model_configs").MODEL_CONFIGS
    file_hash = diffsynth_module("diffsynth.core.loader").hash_model_file(path)
    for entry in [*(registry_entry(r) for r in registered), *configs]:
        if entry["model_hash"] == file_hash:
            return entry
    raise ConfigError(
        f"pipeline.model_paths: DiffSynth does not know the model in {path} (key hash "
        f"{file_hash}); add it to [[pipeline.register_models]] with its model_name and model_class"
    )


def registry_entry(model: RegisteredModel) -> dict[str, Any]:
    """A MODEL_CONFIGS entry for a registered file (its hash computed from the file)."""
    file_hash = diffsynth_module("diffsynth.core.loader").hash_model_file(model.path)
    entry = {"model_hash": file_hash, "model_name": model.model_name}
    entry["model_class"] = model.model_class
    if model.extra_kwargs:
        entry["extra_kwargs"] = dict(model.extra_kwargs)
    return entry


@contextmanager
def registered(models: Sequence[RegisteredModel]) -> Iterator[None]:
    """DiffSynth's global MODEL_CONFIGS with the config's extra entries, for one load."""
    configs = diffsynth_module("diffsynth.configs.model_configs").MODEL_CONFIGS
    added = [registry_entry(model) for model in models]
    configs.extend(added)
    try:
        yield
    finally:
        for entry in added:
            configs.remove(entry)


def skeleton(config: DiffSynthPipelineConfig) -> Any:
    """The pipeline object without models (its units and model_fn): built in milliseconds."""
    return pipeline_class(config)(device="cpu", torch_dtype=DTYPES[config.torch_dtype])


def load_pipeline(config: DiffSynthPipelineConfig, device: torch.device) -> Any:
    """`from_pretrained` on the config's local files (no download), in training mode."""
    core = diffsynth_module("diffsynth.core")
    with registered(config.register_models):
        pipe = pipeline_class(config).from_pretrained(
            torch_dtype=DTYPES[config.torch_dtype],
            device=str(device),
            model_configs=[core.ModelConfig(path=path) for path in config.model_paths],
            tokenizer_config=core.ModelConfig(path=config.tokenizer_path),
        )
    pipe.scheduler.set_timesteps(1000, training=True)  # as switch_pipe_to_training_mode
    pipe.requires_grad_(False).eval()
    return pipe
