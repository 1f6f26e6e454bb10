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
of another dtype are cast to the model's dtype.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from splitstage.tasks.stage2.distributed import comm_device, default_device_type
from splitstage.tasks.stage2.weights_file import (
    PretrainedFile,
    WeightsError,
    is_adapter,
    model_tensors,
    named,
    open_and_check,
    tied_keys,
)

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
            file = open_and_check(path, key_prefix, shapes, required, ignore_unexpected)
        except Exception as exc:
            error = exc
    _raise_agreed(error)

    device = torch.device(device) if device is not None else _default_device()
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device=device)
    targets = model_tensors(model)  # to_empty may replace tensors
    adapters = sorted(key for key in targets if is_adapter(key))
    init_keys = [key for key in adapters if file is not None and key not in file.keys]
    if strategy == "broadcast":  # only rank 0 knows the file's keys
        init_keys = _broadcast_lines(init_keys)
    report = LoadReport(path=path, strategy=strategy)
    try:
        with torch.no_grad():
            if strategy == "slices":
                _load_slices(file, targets, report)
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


def _load_slices(file: PretrainedFile, targets, report: LoadReport) -> None:
    """Each rank copies only its own region of each tensor from the file."""
    for key, (_, tensor) in targets.items():
        if key not in file.keys:
            continue
        source = file.read(key, _region(tensor))
        if source.dtype != tensor.dtype:
            report.cast.append(key)
        _copy_into(tensor, source)
        report.loaded += 1
        report.bytes_read += source.numel() * source.element_size()


def _load_broadcast(model: nn.Module, file, targets, report: LoadReport) -> None:
    """Rank 0 reads every tensor; set_model_state_dict broadcasts and shards them."""
    full: dict[str, torch.Tensor] = {}
    if file is not None:
        for key, (fqn, tensor) in targets.items():
            if key in file.keys:
                full[fqn] = file.read(key)
                if full[fqn].dtype != tensor.dtype:
                    report.cast.append(key)
                report.bytes_read += full[fqn].numel() * full[fqn].element_size()
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
