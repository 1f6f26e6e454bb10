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

import numpy as np
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
_SAME_SIZE_INT = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: view its bytes as int16


def flat_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy view (-0.0 differs from 0.0);
    numpy's own view where it has the dtype (3 us, a third of torch's reshape + view)."""
    as_int = _SAME_SIZE_INT.get(t.dtype)
    try:
        arr = (t if as_int is None else t.view(as_int)).numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (float8, ...), a conjugate view
        return t.reshape(-1).view(torch.uint8).numpy()
    return arr.reshape(-1).view(np.uint8)


def fingerprint(t: torch.Tensor, raw: np.ndarray | None = None) -> tuple:
    """A cheap fingerprint of a contiguous CPU tensor (dtype, shape, ~80 sampled bytes; `raw`:
    its `flat_bytes` when known): equal tensors have equal fingerprints; `Dedupe` confirms a
    match byte for byte."""
    raw = flat_bytes(t) if raw is None else raw
    if len(raw) > 128:
        return t.dtype, tuple(t.shape), raw[:: len(raw) // 64][:64].tobytes() + raw[-16:].tobytes()
    return t.dtype, tuple(t.shape), raw.tobytes()


def _crc(raw: np.ndarray) -> int:
    """crc32 of a tensor's flat bytes (zlib releases the GIL on large buffers)."""
    return zlib.crc32(raw) if len(raw) else 0


class Dedupe:
    """Finds the tensors of a shard that equal an earlier one (the empty-prompt embedding)."""

    def __init__(self) -> None:
        self._groups: dict[tuple, list[list[Any]]] = {}  # fingerprint -> [[raw, name, crc]]

    def first(self, t: torch.Tensor, name: str, raw: np.ndarray | None = None) -> str | None:
        """The name of an earlier tensor with `t`'s dtype, shape and bytes, else None (and `t`
        is remembered as `name`); `raw`: its `flat_bytes` when the caller has them."""
        raw = flat_bytes(t) if raw is None else raw
        group = self._groups.setdefault(fingerprint(t, raw), [])
        crc = None
        if group:
            crc = _crc(raw)
            for other in group:
                if other[2] is None:
                    other[2] = _crc(other[0])
                if other[2] == crc and np.array_equal(other[0], raw):
                    return other[1]
        group.append([raw, name, crc])
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


def serialize(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    raws: dict[str, np.ndarray] | None = None,
) -> bytes:
    """The bytes `safetensors.torch.save(tensors, metadata=metadata)` writes, in one copy.
    Tensors must be contiguous CPU tensors owning their storage (see `shard_format`); `raws`:
    their `flat_bytes` where the caller has them."""
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
    raws = raws or {}
    for name in order:
        raw = raws.get(name)
        raw = flat_bytes(tensors[name]) if raw is None else raw
        if len(raw):
            parts.append(raw)
    return b"".join(parts)
