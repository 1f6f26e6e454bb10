"""Load one pretrained file (or sharded safetensors index) into a meta-initialized, already
parallelized model, exactly.

Order (torchtitan's): build on the meta device -> `tasks.parallelize.parallelize` ->
`materialize_and_load` -> train. Strategies:
- "slices" (default, cheaper): every rank reads only its own shard of each tensor from the file
  (safetensors `get_slice`, or an mmap'd `torch.load(weights_only=True)`), no communication; with
  a `*.safetensors.index.json` (save_pretrained's shards) each tensor comes from its own shard.
- "broadcast": rank 0 reads the whole file and `set_model_state_dict` broadcasts it; use it when
  the file is on rank 0's disk only.
Keys are matched on plain-model names: peft's `base_model.model.` prefix and `.base_layer` are
ignored, and LoRA adapter weights absent from the file get peft's default init (A: kaiming-uniform,
B: zeros), drawn from a seeded generator so every parallel layout starts identically. File tensors
of another dtype are cast to the model's dtype, one tensor at a time: a LoRA's frozen base is
allocated in `train.weight_dtype` on meta before loading, so it is read straight into it and no
fp32 copy of it stays.

A pretrained weights file (safetensors, a sharded safetensors index, or torch.save, never
unpickled) checked against a model.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from splitstage.pipelines.key_rules import Rule
from splitstage.splitter import UserError
from splitstage.storage.safetensors_io import (
    INDEX_SUFFIX,
    drop_mapped_pages,
    index_weight_map,
    is_index_path,
    looks_like_safetensors,
)
from splitstage.tasks.stage2.distributed import comm_device, default_device_type
from splitstage.tasks.stage2.parallelize import logical_name

ADAPTER_SEGMENTS = {"lora_A", "lora_B"}


OTHER_ADAPTER_SEGMENTS = {"lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}


MAX_NAMED = 5


class WeightsError(UserError, ValueError):
    """The pretrained file does not fit the model; the message names the keys and the fix."""


class WeightsFileNotFoundError(WeightsError, FileNotFoundError):
    """The pretrained weights file does not exist."""


class PretrainedFile:
    """Lazy read access to one safetensors or torch.save file, or to a sharded safetensors index
    (`*.safetensors.index.json`, shards beside it, each opened on first use): names, shapes,
    regions."""

    def __init__(self, path: str, key_prefix: str) -> None:
        _check_path(path)
        self.path = path
        self.key_prefix = key_prefix
        self._tensors: dict[str, torch.Tensor] = {}
        self._shard_of: dict[str, str] = {}  # safetensors tensor name -> its file
        self._open: dict[str, Any] = {}  # safetensors file -> its safe_open handle
        if is_index_path(path):
            self._shard_of = _read_index(path)
        elif _is_safetensors(path):
            self._open[path] = _safe_open(path, f"weights file {path}")
            self._shard_of = dict.fromkeys(self._open[path].keys(), path)
        else:
            self._tensors = _flatten(_torch_load(path))
        names = [*self._shard_of, *self._tensors]
        self.all_keys = names
        # model key -> file key, for the file keys under key_prefix.
        self.keys = {k[len(key_prefix) :]: k for k in names if k.startswith(key_prefix)}
        self.rules: dict[str, Rule] | None = None  # set by `convert`: an original layout
        self.layout = ""
        self.file_shapes: dict[str, tuple[int, ...]] = {}
        self._read_views: list[torch.Tensor] = []  # what the last converted read mapped

    def convert(self, rules: dict[str, Rule], layout: str) -> None:
        """Read the file through `rules` (an original-layout single file): model keys become the
        rules' keys, each read as slices of the file's own tensors."""
        self.file_shapes = {name: self._file_shape(name) for name in self.all_keys}
        self.rules, self.layout = rules, layout
        self.keys = {key: key for key in rules}

    def shape(self, key: str) -> tuple[int, ...]:
        """Global shape of a tensor, read from the header only."""
        if self.rules is not None:
            return self.rules[key].shape(self.file_shapes)
        return self._file_shape(self.keys[key])

    def _file_shape(self, name: str) -> tuple[int, ...]:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return tuple(self._handle(name).get_slice(name).get_shape())

    def is_mapped(self, key: str) -> bool:
        """Whether `read(key)` is a view of a safetensors file mapped copy-on-write (its pages
        can be handed back after a copy, or held as the tensor itself)."""
        return self.rules is None and self.keys[key] in self._shard_of

    def read(self, key: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A tensor, or only `region` of it (reads only those bytes)."""
        if self.rules is None:
            return self._read_file(self.keys[key], region)
        self._read_views = []

        def read_file(name: str, part: tuple[slice, ...] | None) -> torch.Tensor:
            if name not in self._shard_of:
                return self._read_file(name, part)
            view = self._read_file(name, None)  # the mapped file: only the pages used are read
            self._read_views.append(view)
            return view[part] if part else view

        return self.rules[key].read(read_file, self.file_shapes, region)

    def release(self, key: str, tensor: torch.Tensor) -> None:
        """Hand back the file pages `read(key)` touched, once `tensor` (what it returned) has
        been copied elsewhere: the mapped view itself, or the original layout's tensors it was
        converted from."""
        if self.is_mapped(key):
            drop_mapped_pages(tensor)
        elif self.rules is not None:
            for view in self._read_views:
                drop_mapped_pages(view)
            self._read_views = []

    def _read_file(self, name: str, region: tuple[slice, ...] | None) -> torch.Tensor:
        """The file's own tensor `name`, or only `region` of it."""
        if name in self._tensors:
            tensor = self._tensors[name]
            return tensor if region is None else tensor[region]
        if region is None or len(region) == 0:
            return self._handle(name).get_tensor(name)
        return self._handle(name).get_slice(name)[region]

    def _handle(self, name: str):
        """The safe_open handle of the file holding `name`; an index's shard opens once, here."""
        shard = self._shard_of[name]
        if shard not in self._open:
            self._open[shard] = self._open_shard(shard)
        return self._open[shard]

    def _open_shard(self, shard: str):
        """Open one shard of the index, checking it holds every tensor the weight_map gives it."""
        where = f"weights index {self.path}: shard {os.path.basename(shard)}"
        if not _is_safetensors(shard):
            raise WeightsError(
                f"{where} is not a safetensors file; re-save the shards as safetensors"
            )
        handle = _safe_open(shard, where)
        listed = {n for n, s in self._shard_of.items() if s == shard}
        absent = listed - set(handle.keys())
        if absent:
            raise WeightsError(
                f"{where} lacks {len(absent)} tensor(s) its weight_map puts there: "
                f"{named(absent)}; the index and its shards do not match (re-download or "
                "re-save them together)"
            )
        return handle


def _check_path(path: str) -> None:
    """One line for a path that is not a file: missing, or a folder (name what to point at)."""
    if os.path.isdir(path):
        names = os.listdir(path)
        found = [n for n in names if n.endswith(INDEX_SUFFIX)]
        found = found or [n for n in names if n.endswith(".safetensors")]
        seen = f" (it holds {named(found)})" if found else ""
        raise WeightsError(
            f"pretrained weights path {path} is a directory{seen}; point at the .safetensors "
            f"file or the {INDEX_SUFFIX} of the sharded weights"
        )
    if not os.path.isfile(path):
        raise WeightsFileNotFoundError(
            f"pretrained weights file {path} does not exist; check the weights path in the config"
        )


def _read_index(path: str) -> dict[str, str]:
    """A sharded index's {tensor name: shard path}, every shard file present beside it."""
    with open(path, "rb") as f:
        try:
            weight_map = index_weight_map(f.read())
        except ValueError as exc:
            raise WeightsError(f"weights index {path} {exc}") from None
    folder = os.path.dirname(os.path.abspath(path))
    shards = set(weight_map.values())
    outside = [s for s in shards if os.path.isabs(s) or ".." in s.replace("\\", "/").split("/")]
    if outside:
        raise WeightsError(
            f"weights index {path}: shard files must lie beside the index, not {named(outside)}"
        )
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        files, verb = ("shard files", "do") if len(missing) > 1 else ("shard file", "does")
        raise WeightsError(
            f"weights index {path}: {files} {named(missing)} listed in its weight_map {verb} "
            f"not exist in {folder}; download every shard next to the index"
        )
    return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}


def _safe_open(path: str, where: str):
    """safetensors' lazy reader of a file; a corrupt header is a one-line WeightsError."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError: a bad header or a truncated file
        reason = " ".join(str(exc).split())  # one line
        raise WeightsError(f"{where} is not a readable safetensors file: {reason}") from None


def _is_safetensors(path: str) -> bool:
    """True when the file starts like safetensors (not a torch.save zip)."""
    with open(path, "rb") as f:
        return looks_like_safetensors(f.read(9))


def _torch_load(path: str):
    """torch.load without pickle code execution, memory-mapped so nothing is read yet."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a legacy or non-torch file
        raise WeightsError(
            f"weights file {path} is neither safetensors nor a torch.save zip file loadable with "
            f"weights_only=True, mmap=True: {exc}"
        ) from exc


def _flatten(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors -> {'a.b': tensor}; non-tensor leaves (epoch, config) dropped."""
    if isinstance(obj, torch.Tensor):
        return {prefix[:-1]: obj}
    if isinstance(obj, dict):
        out: dict[str, torch.Tensor] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {}


def is_adapter(name: str) -> bool:
    """True for a peft adapter weight (not expected in a base model's pretrained file)."""
    return bool(set(name.split(".")) & (ADAPTER_SEGMENTS | OTHER_ADAPTER_SEGMENTS))


def named(keys, limit: int = MAX_NAMED) -> str:
    """Up to `limit` names, then how many more."""
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _suggest_prefix(missing: set[str], file_keys: list[str], key_prefix: str) -> str | None:
    """A key_prefix whose removal makes the file provide every missing key, if one exists."""
    votes: Counter[str] = Counter()
    for fk in file_keys:
        parts = fk.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in missing:
                votes[".".join(parts[:i]) + "."] += 1
    for prefix, _ in votes.most_common(3):
        provided = {k[len(prefix) :] for k in file_keys if k.startswith(prefix)}
        if missing <= provided:
            return prefix
    if key_prefix and missing <= set(file_keys):
        return ""
    return None


def _check_keys(
    file: PretrainedFile,
    shapes: dict[str, tuple],
    required: set[str],
    ignore_unexpected: bool = False,
) -> None:
    """Raise a WeightsError naming missing/unexpected keys (with a key_prefix hint) and shapes."""
    missing = required - set(file.keys)
    unexpected = set() if ignore_unexpected else set(file.keys) - set(shapes)
    if missing or unexpected:
        lines = [f"weights file {file.path} does not match the model"]
        if file.layout:
            lines[0] += f" (read as a {file.layout} single file through diffusers' converter)"
        elif file.key_prefix:
            lines[0] += f" (with key_prefix={file.key_prefix!r})"
        if missing:
            lines.append(f"{len(missing)} model keys missing from the file: {named(missing)}")
        if unexpected:
            lines.append(f"{len(unexpected)} unexpected keys in the file: {named(unexpected)}")
        hint = None
        if missing and not file.layout:
            hint = _suggest_prefix(missing, file.all_keys, file.key_prefix)
        if hint is not None:
            lines.append(f"set key_prefix={hint!r} to read the model's keys under that prefix")
        raise WeightsError("; ".join(lines))
    for key, model_shape in shapes.items():
        if key in file.keys and file.shape(key) != tuple(model_shape):
            where = f" ({file.layout} layout, converted)" if file.layout else ""
            raise WeightsError(
                f"weights file {file.path}{where}: key {file.keys[key]!r} has shape "
                f"{tuple(file.shape(key))} in the file but {tuple(model_shape)} in the model"
            )


def model_tensors(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Logical (plain-model) key -> (state-dict FQN, tensor or DTensor), persistent state only."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for fqn, tensor in get_model_state_dict(model).items():
        key = logical_name(fqn)
        if key in out:
            raise WeightsError(f"model keys {out[key][0]!r} and {fqn!r} both map to {key!r}")
        out[key] = (fqn, tensor)
    return out


def tied_keys(model: nn.Module) -> set[str]:
    """Logical keys of parameters tied to another (T5's embed_tokens = shared): a weights file
    may omit them, and the model's `tie_weights` (the family's buffers_init) restores them."""
    tied: set[str] = set()
    seen: set[int] = set()
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(logical_name(fqn))
        seen.add(id(param))
    for prefix, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None)
        if isinstance(declared, dict):  # transformers 5: {tied key: source key}
            tied.update(logical_name(f"{prefix}.{k}" if prefix else k) for k in declared)
    return tied


def open_and_check(
    path, key_prefix, shapes, required, ignore_unexpected, model: nn.Module | None = None
) -> PretrainedFile:
    """Open the file (or sharded index) and validate its keys and shapes against the model.

    A model that carries `original_layout_rules(header shapes) -> (rules, layout) | None` (a
    family's hook: diffusers' single-file converters) reads a file in its original layout
    through those rules, from the header only; its keys the rules do not use are ignored (an SD
    single file also holds the VAE and the text encoder)."""
    file = PretrainedFile(path, key_prefix)
    hook = getattr(model, "original_layout_rules", None)
    if callable(hook) and required - set(file.keys):
        try:
            found = hook({name: file._file_shape(name) for name in file.all_keys})
        except ValueError as error:  # the family's converter refused the file: one line
            raise WeightsError(f"weights file {path}: {error}") from None
        if found is not None:
            file.convert(*found)
    _check_keys(file, shapes, required, ignore_unexpected)
    return file


def check_weights_file(model: nn.Module, path: str | os.PathLike, key_prefix: str = "") -> None:
    """Check a weights file's keys and shapes against a (meta) model without loading tensors:
    lets a launcher refuse a wrong file before any process starts."""
    targets = model_tensors(model)
    shapes = {key: tuple(t.shape) for key, (_, t) in targets.items()}
    required = {key for key in shapes if not is_adapter(key)} - tied_keys(model)
    open_and_check(os.fspath(path), key_prefix, shapes, required, False, model)


STRATEGIES = ("slices", "broadcast")


@dataclass
class LoadReport:
    """What `materialize_and_load` did on this rank."""

    path: str
    strategy: str
    loaded: int = 0
    initialized_adapters: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    bytes_read: int = 0
    mapped: int = 0  # frozen tensors held as views of the file, not copied
    bytes_mapped: int = 0
    installed: int = 0  # tensors handed to an installer (a quantized base)


@contextlib.contextmanager
def left_on_meta(model: nn.Module, keys: Mapping[str, object]):
    """Hide the parameters of `keys` (logical names) from `to_empty`, so it allocates nothing for
    them; they come back on the meta device for their installers."""
    hidden = []
    for fqn, _param in list(model.named_parameters()):
        if logical_name(fqn) in keys:
            module_name, _, name = fqn.rpartition(".")
            module = model.get_submodule(module_name)
            hidden.append((module, name, module._parameters.pop(name)))
    try:
        yield
    finally:
        for module, name, param in hidden:
            module._parameters[name] = param


def _meta_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Non-persistent buffers still on the meta device (to_empty leaves them as garbage)."""
    names = []
    for mod_name, module in model.named_modules():
        for buf_name in module._non_persistent_buffers_set:
            buf = module._buffers.get(buf_name)
            if buf is not None and buf.is_meta:
                names.append(f"{mod_name}.{buf_name}" if mod_name else buf_name)
    return names


def _default_device() -> torch.device:
    """The device parameters go to: the process group's device, else the best one present."""
    if dist.is_initialized():
        return comm_device()
    device_type = default_device_type()
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _region(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the global tensor this rank holds (None: all of it)."""
    if not isinstance(tensor, DTensor):
        return None
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise WeightsError(f"a DTensor with {len(chunks)} local chunks is not supported")
    return tuple(slice(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes))


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy a full tensor or this rank's region into a tensor or DTensor's local shard."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if tuple(local.shape) != tuple(source.shape):
        raise WeightsError(f"internal: shard shape {tuple(local.shape)} != {tuple(source.shape)}")
    local.copy_(source)


def _adapter_full(key: str, shape: tuple[int, ...], dtype, seed: int) -> torch.Tensor:
    """peft's default LoRA init for a full tensor: A kaiming-uniform(a=sqrt(5)), B zeros."""
    parts = key.split(".")
    if "lora_B" in parts or len(shape) < 2:
        return torch.zeros(shape, dtype=dtype)
    if "lora_A" not in parts:
        raise WeightsError(
            f"adapter weight {key!r} is not in the weights file and has no default init; "
            "add it to the file"
        )
    generator = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
    full = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
    return full.to(dtype)


def _agree(error: str | None) -> str | None:
    """Every rank learns whether any rank failed: its own error, else the first rank's message."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    device = comm_device()
    data = (error or "").encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    if max(sizes) == 0:
        return None
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)  # tensors only: nothing is pickled
    if error:
        return error
    rank = next(r for r, n in enumerate(sizes) if n)
    return f"[rank {rank}] " + bytes(bufs[rank][: sizes[rank]].cpu().tolist()).decode()


def _raise_agreed(error: Exception | None) -> None:
    """Raise the same WeightsError on every rank when any rank failed."""
    message = _agree(None if error is None else str(error))
    if message is None:
        return
    if isinstance(error, WeightsError):
        raise error
    if error is not None:
        raise WeightsError(message) from error
    raise WeightsError(message)


def materialize_and_load(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    strategy: str = "slices",
    key_prefix: str = "",
    buffers_init: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    adapter_seed: int = 0,
    ignore_unexpected: bool = False,
    map_frozen: bool = True,
    installers: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> LoadReport:
    """Allocate a meta model on `device` and fill it from one file; the same on every layout.

    `path` is a safetensors or torch.save file, or a sharded `*.safetensors.index.json` whose
    shards lie beside it (each rank opens only the shards holding its tensors).
    Collective: every rank calls it, and every rank raises the same error when any rank fails.
    A model that is not on the meta device is loaded in place.
    Only file keys starting with `key_prefix` are read, with the prefix removed.
    `buffers_init(model)` recomputes non-persistent buffers (RoPE tables...) that `to_empty`
    leaves uninitialized. `ignore_unexpected=True` accepts file keys the model lacks (a pipeline
    stage holds only some of the file's modules); missing keys are still errors.

    Nothing is held twice: a frozen tensor of a safetensors file, on the CPU, in the file's
    dtype and whole on this rank becomes a view of the file mapped copy-on-write (its pages are
    resident as it is used, evictable, never an anonymous copy; `map_frozen=False` copies it);
    every other tensor is copied (converted, sliced or moved to the device) one at a time, and
    the file's pages it was read from are handed back at once. A key of `installers` (whole,
    frozen parameters: a quantized base) is not allocated with the model: its installer gets the
    file's tensor and puts what the model holds in its place.
    """
    path = os.fspath(path)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown; allowed: {', '.join(STRATEGIES)}")
    meta_buffers = _meta_non_persistent_buffers(model)
    if meta_buffers and buffers_init is None:
        raise ValueError(
            f"model has non-persistent buffers on the meta device ({named(meta_buffers)}) that "
            "to_empty leaves uninitialized: pass buffers_init=callable(model) that recomputes them"
        )
    targets = model_tensors(model)
    shapes = {key: tuple(t.shape) for key, (_, t) in targets.items()}
    required = {key for key in shapes if not is_adapter(key)} - tied_keys(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    reads_file = strategy == "slices" or rank == 0
    file, error = None, None
    if reads_file:
        try:
            file = open_and_check(path, key_prefix, shapes, required, ignore_unexpected, model)
        except Exception as exc:
            error = exc
    _raise_agreed(error)

    device = torch.device(device) if device is not None else _default_device()
    installers = dict(installers or {})
    if installers and strategy != "slices":
        raise ValueError("installers (a quantized base) load with strategy='slices' only")
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        with left_on_meta(model, installers):
            model.to_empty(device=device)
    targets = model_tensors(model)  # to_empty may replace tensors
    adapters = sorted(key for key in targets if is_adapter(key))
    init_keys = [key for key in adapters if file is not None and key not in file.keys]
    if strategy == "broadcast":  # only rank 0 knows the file's keys
        init_keys = _broadcast_lines(init_keys)
    report = LoadReport(path=path, strategy=strategy)
    frozen = frozen_owners(model) if map_frozen else {}
    try:
        with torch.no_grad():
            if strategy == "slices":
                _load_slices(file, targets, report, frozen, installers)
            else:
                _load_broadcast(model, file, targets, report)
            _init_adapters(init_keys, targets, report, adapter_seed)
            if buffers_init is not None:
                buffers_init(model)
        error = None
    except Exception as exc:
        error = exc
    if strategy == "slices":
        _raise_agreed(error)
    elif error is not None:
        raise error
    return report


def frozen_owners(model: nn.Module) -> dict[int, nn.Parameter | torch.Tensor]:
    """The model's frozen CPU tensors (parameters that take no gradient, buffers) that are not
    DTensors, by the address of their storage: what `_load_slices` may replace with a view of
    the file (the model's own objects, which optimizers and adapters hold, keep their identity)."""
    owners: dict[int, nn.Parameter | torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.requires_grad or isinstance(tensor, DTensor) or not tensor.numel():
            continue
        if tensor.device.type == "cpu":
            owners[tensor.data_ptr()] = tensor
    return owners


def _load_slices(
    file: PretrainedFile, targets, report: LoadReport, frozen: dict, installers: dict
) -> None:
    """Each rank reads only its own region of each tensor from the file: a frozen tensor in the
    file's dtype becomes a view of the file; any other is copied and its file pages handed back;
    an installer's key goes to its installer."""
    for key, (_, tensor) in targets.items():
        if key not in file.keys:
            continue
        region = _region(tensor)
        source = file.read(key, region)
        nbytes = source.numel() * source.element_size()
        if key in installers:
            installers[key](source)
            file.release(key, source)
            report.installed += 1
            report.loaded += 1
            report.bytes_read += nbytes
            continue
        owner = frozen.get(tensor.data_ptr()) if tensor.numel() else None
        mapped = file.is_mapped(key)
        if (
            owner is not None
            and mapped
            and region is None
            and source.dtype == owner.dtype
            and tuple(source.shape) == tuple(owner.shape)
            and source.is_contiguous()
        ):
            owner.data = source  # the model's own tensor object, now backed by the file's pages
            report.mapped += 1
            report.bytes_mapped += nbytes
        else:
            if source.dtype != tensor.dtype:
                report.cast.append(key)
            _copy_into(tensor, source)
            file.release(key, source)
        report.loaded += 1
        report.bytes_read += nbytes


def _load_broadcast(model: nn.Module, file, targets, report: LoadReport) -> None:
    """Rank 0 reads every tensor; set_model_state_dict broadcasts and shards them."""
    full: dict[str, torch.Tensor] = {}
    if file is not None:
        for key, (fqn, tensor) in targets.items():
            if key in file.keys:
                source = file.read(key)
                report.bytes_read += source.numel() * source.element_size()
                if source.dtype != tensor.dtype:  # cast before the broadcast (a bf16 base: half)
                    report.cast.append(key)
                    source = source.to(tensor.dtype)
                full[fqn] = source
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, full, options=options)
    report.loaded = len(full)


def _init_adapters(keys: list[str], targets, report: LoadReport, seed: int) -> None:
    """Give adapter weights absent from the file peft's default init, identical on any layout."""
    for key in keys:
        _, tensor = targets[key]
        full = _adapter_full(key, tuple(tensor.shape), tensor.dtype, seed)
        region = _region(tensor)
        _copy_into(tensor, full if region is None else full[region])
        report.initialized_adapters.append(key)


def _broadcast_lines(lines: list[str]) -> list[str]:
    """Rank 0's list of strings on every rank (tensors only, no pickle)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lines
    device = comm_device()
    data = "\n".join(lines).encode() if dist.get_rank() == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    text = bytes(buf.cpu().tolist()).decode()
    return text.split("\n") if text else []
