"""The tensor side of a shard: find identical tensors cheaply, write safetensors in one copy.

`safetensors.torch.save` costs about 20 us of Python per tensor and copies the data twice; a shard
holds hundreds of small tensors, so encoding ran as slowly as the upload it should hide behind.
Here the header is built in Python exactly as safetensors' Rust serializer builds it (the tensor
order and dtype names are read once from safetensors itself, so the bytes stay identical and the
shard ids too) and the tensors are joined into the result with ONE copy (`bytes.join` releases the
GIL for large joins). Identical tensors are found by a sampled fingerprint, confirmed with crc32
and an exact byte comparison only where fingerprints meet: the bytes are hashed once, by sha256.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
import zlib
from typing import Any

import torch
from safetensors.torch import save as st_save

_PROBE_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 view (-0.0 differs from 0.0)."""
    return t.reshape(-1).view(torch.uint8)


def fingerprint(t: torch.Tensor) -> tuple:
    """A cheap fingerprint of a contiguous CPU tensor (dtype, shape, ~80 sampled bytes): equal
    tensors have equal fingerprints; `Dedupe` confirms a match byte for byte."""
    raw = flat_bytes(t).numpy() if t.numel() else b""
    if len(raw) > 128:
        raw = raw[:: len(raw) // 64][:64].tobytes() + raw[-16:].tobytes()
    return t.dtype, tuple(t.shape), bytes(raw)


def _crc(t: torch.Tensor) -> int:
    """crc32 of a contiguous CPU tensor's bytes (zlib releases the GIL on large buffers)."""
    return zlib.crc32(flat_bytes(t).numpy()) if t.numel() else 0


class Dedupe:
    """Finds the tensors of a shard that equal an earlier one (the empty-prompt embedding)."""

    def __init__(self) -> None:
        self._groups: dict[tuple, list[list[Any]]] = {}  # fingerprint -> [[tensor, name, crc]]

    def first(self, t: torch.Tensor, name: str) -> str | None:
        """The name of an earlier tensor with `t`'s dtype, shape and bytes, else None (and `t`
        is remembered as `name`)."""
        group = self._groups.setdefault(fingerprint(t), [])
        crc = None
        if group:
            crc = _crc(t)
            for other in group:
                if other[2] is None:
                    other[2] = _crc(other[0])
                if other[2] == crc and torch.equal(flat_bytes(other[0]), flat_bytes(t)):
                    return other[1]
        group.append([t, name, crc])
        return None


@functools.cache
def _safetensors_layout() -> dict[torch.dtype, tuple[int, str]]:
    """{torch dtype: (rank in safetensors' tensor order, its header name)}, read from the
    installed safetensors by saving one tensor of each dtype (names sort opposite to dtypes)."""
    names = {f"t{len(_PROBE_DTYPES) - i:02d}": d for i, d in enumerate(_PROBE_DTYPES)}
    data = st_save({name: torch.zeros(1, dtype=d) for name, d in names.items()})
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    order = [name for name in header if name != "__metadata__"]
    return {names[name]: (rank, header[name]["dtype"]) for rank, name in enumerate(order)}


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The bytes `safetensors.torch.save(tensors, metadata=metadata)` writes, in one copy.
    Tensors must be contiguous CPU tensors owning their storage (see `shard_format`)."""
    layout = _safetensors_layout()
    plain = all(t.dtype in layout and t.layout == torch.strided for t in tensors.values())
    if sys.byteorder != "little" or not plain:
        return st_save(tensors, metadata=metadata)
    order = sorted(tensors, key=lambda name: (layout[tensors[name].dtype][0], name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + t.nbytes
        header[name] = {"dtype": layout[t.dtype][1], "shape": list(t.shape)}
        header[name]["data_offsets"] = [offset, end]
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    parts = [struct.pack("<Q", len(text)), text]
    parts += [flat_bytes(tensors[name]).numpy() for name in order if tensors[name].numel()]
    return b"".join(parts)
