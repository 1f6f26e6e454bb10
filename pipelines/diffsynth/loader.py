"""DiffSynth model files without loading them, and DiffSynth's `from_pretrained` on one of them.

Which pipeline slot a file fills is DiffSynth's own logic: the file's key-and-shape hash picks its
MODEL_CONFIGS entries, and the pipeline's `from_pretrained` fetches them into slots. `stand_ins`
runs that `from_pretrained` over models built on the meta device (headers read, no weights), so
`validate`, preflight and stage 2 know every slot's file and class for free, and a stage holds
those meta models as stand-ins for the slots it does not load; `load_slot` then loads exactly
one slot's model, its file and its entry only, through DiffSynth's `from_pretrained` with the
model's load done step by step as DiffSynth's `load_model` does it (`load_frozen`), the file
mapped and each tensor converted on its own, its file pages handed back at once: DiffSynth's
DiskMap clones every tensor and its loader holds them all before the whole model is moved.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
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
from splitstage.storage.safetensors_io import drop_mapped_pages, mapped_state, read_header

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
def _models_from(cls: type, load_models: Any) -> Iterator[None]:
    """`cls.from_pretrained` fetches its slots from `load_models(pipe)`'s ModelPool instead of
    DiffSynth's `download_and_load_models` (which reads every file it is given)."""
    own = cls.__dict__.get("download_and_load_models")
    cls.download_and_load_models = lambda self, *args, **kwargs: load_models(self)
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
    models = _models_from(cls, lambda pipe: pool)
    with _CONFIGS_LOCK, models, contextlib.redirect_stdout(io.StringIO()):
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
    """DiffSynth's `from_pretrained` building a pipeline of one slot's model (plus the tokenizer,
    and the processor where the config names one, when asked), in training mode: its slot rules,
    tokenizer and processor unchanged, the model loaded by `load_frozen` from the file mapped,
    tensor by tensor into the pipeline's dtype and device; a model `lean_load_refusal` names (a
    pre-quantized file, DeepSpeed ZeRO-3) goes through DiffSynth's own loader instead
    (`diffsynth_load`: equal, with whole-model copies)."""
    if lean_load_refusal(source.entry) is not None:
        return diffsynth_load(config, source, device, tokenizer)
    core = diffsynth_module("diffsynth.core")
    model_loader = diffsynth_module("diffsynth.models.model_loader")
    extra = {}
    if tokenizer and config.processor_path is not None:  # QwenImagePipeline's (checked)
        extra["processor_config"] = core.ModelConfig(path=config.processor_path)

    def load_models(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        """DiffSynth's download_and_load_models for this one file, at the pipeline's dtype and
        device (its vram_config's computation dtype and device, as DiffSynth resolves them)."""
        print(f"Loading models from: {json.dumps(source.path, indent=4)}")  # DiffSynth's line
        pool = model_loader.ModelPool()
        pool.model.append(load_frozen(source, pipe.torch_dtype, pipe.device))
        pool.model_name.append(source.entry["model_name"])
        pool.model_path.append(source.path)
        return pool

    cls = pipeline_class(config)
    with _CONFIGS_LOCK, _models_from(cls, load_models):
        pipe = cls.from_pretrained(
            torch_dtype=DTYPES[config.torch_dtype],
            device=str(device),
            model_configs=[core.ModelConfig(path=source.path)],
            tokenizer_config=core.ModelConfig(path=config.tokenizer_path) if tokenizer else None,
            **extra,
        )
    return training_mode(pipe)


def lean_load_refusal(entry: dict[str, Any]) -> str | None:
    """Why `load_frozen` would not load an entry's model exactly as DiffSynth's `load_model`
    does (a pre-quantized file: DiffSynth quantizes while loading; DeepSpeed ZeRO-3: it
    partitions the model while loading), or None."""
    if "quant_config" in entry:
        return "a pre-quantized checkpoint (DiffSynth quantizes while loading)"
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 partitions the model while loading"
    return None


def moves_as_torch(model: torch.nn.Module) -> bool:
    """Whether `model.to` is torch's `Module.to`: its class's, or transformers'
    `PreTrainedModel.to` on a model no quantizer touched (that method only refuses or patches
    BNB / GPTQ / HQQ / Quark models and otherwise runs `super().to`, torch's next in its
    class order)."""
    move = type(model).to
    if move is torch.nn.Module.to:
        return True
    from transformers import PreTrainedModel

    if move is not PreTrainedModel.to or not isinstance(model, PreTrainedModel):
        return False
    order = type(model).__mro__
    after = order[order.index(PreTrainedModel) + 1 :]
    next_move = next(cls.__dict__["to"] for cls in after if "to" in cls.__dict__)
    quantized = getattr(model, "quantization_method", None) or getattr(model, "hf_quantizer", None)
    return next_move is torch.nn.Module.to and not quantized


def own_loading_code(model: torch.nn.Module) -> list[str]:
    """What in a model runs its own code on the tensors it loads or moves (a `to` other than
    torch's, `_apply`, `_load_from_state_dict`, load hooks; e.g. a buffer put back in fp32, a
    weight-norm key renamed): `load_frozen` runs each where `load_model` does, on tensors read
    `private` (a copy of its own per read, as DiskMap's clone), so that code gets what it gets
    in DiffSynth: equal values, dtypes, devices and a storage of each tensor's own."""
    found = [] if moves_as_torch(model) else [f"{type(model).__name__}.to"]
    for name, module in model.named_modules():
        cls, where = type(module), f"{type(module).__name__} ({name or 'the model'})"
        if cls._apply is not torch.nn.Module._apply:
            found.append(f"{where}._apply")
        if cls._load_from_state_dict is not torch.nn.Module._load_from_state_dict:
            found.append(f"{where}._load_from_state_dict")
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            found.append(f"{where} load hooks")
    return found


class MovedOnRead(Mapping):
    """A file's tensors as DiffSynth's DiskMap hands them to a model's loader (each read in
    `dtype` on `device`, whatever its own dtype, integers included), read from the file mapped:
    once a tensor is copied, the file's pages it was read from are handed back, so only the
    copies stay. A tensor already in `dtype` on the CPU is the file's view itself (mapped
    copy-on-write, never written: DiskMap's clone, without the copy), unless `private`: then
    it is copied too, each read a tensor of its own as DiskMap's are (for models that run
    their own code on what they load, `own_loading_code`)."""

    def __init__(self, path: str, dtype: torch.dtype, device: Any, private: bool = False) -> None:
        self.views = mapped_state(path)
        self.dtype, self.device, self.private = dtype, device, private

    def __getitem__(self, key: str) -> torch.Tensor:
        view = self.views[key]
        moved = view.to(device=self.device, dtype=self.dtype)
        if moved is view and self.private:
            moved = view.clone()
        if moved is not view:
            drop_mapped_pages(view)
        return moved

    def __contains__(self, key: object) -> bool:
        return key in self.views  # without reading the tensor (Mapping's would)

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)


def load_frozen(source: SlotSource, dtype: torch.dtype, device: Any) -> torch.nn.Module:
    """DiffSynth's `load_model` of one file, step by step (its init context, the file's tensors
    in `dtype` on `device` as its DiskMap reads them, its converter, load_state_dict with assign,
    the model's own `to` to `dtype` and `device`, eval: the same calls in the same order, the
    class's own `to`, `_apply`, state-dict loading and hooks included), the file mapped and each
    tensor's pages handed back once it is converted (`MovedOnRead`): the peak holds the final
    weights plus one tensor, never the file beside the converted model."""
    loader = diffsynth_module("diffsynth.core.loader.model")
    pool = diffsynth_module("diffsynth.models.model_loader").ModelPool()
    entry = source.entry
    with contextlib.ExitStack() as stack:
        for context in loader.get_init_context(torch_dtype=dtype, device=device):
            stack.enter_context(context)
        model = pool.import_model_class(entry["model_class"])(**entry.get("extra_kwargs", {}))
    state = MovedOnRead(source.path, dtype, device, private=bool(own_loading_code(model)))
    if "state_dict_converter" in entry:
        converted = pool.import_model_class(entry["state_dict_converter"])(state)
    else:
        converted = {key: state[key] for key in state}
    del state
    model.load_state_dict(converted, assign=True)
    del converted
    return model.to(dtype=dtype, device=device).eval()  # what no file holds; the rest stays


def diffsynth_load(
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
