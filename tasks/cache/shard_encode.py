"""The tensor side of a shard: find identical tensors cheaply, write safetensors in one copy.

`safetensors.torch.save` costs about 20 us of Python per tensor (its checks for shared and
non-contiguous tensors) and a shard holds hundreds of small tensors, so encoding ran as slowly as
the upload it should hide behind. Here safetensors' own serializer (`safetensors.serialize`) is
handed pointers to the tensors (`TensorSpec`, safetensors >= 0.8): the same header and bytes as
`save` (so the shard ids stay the same), one copy, none of save's per-tensor checks (a shard's
tensors are contiguous and own their storage, see `shard_format`). Identical tensors are found by
a sampled fingerprint, confirmed with crc32 and an exact byte comparison only where fingerprints
meet: the bytes are hashed once, by sha256.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import numpy as np
import torch
from safetensors import serialize as st_serialize
from safetensors.torch import save as st_save

try:
    from safetensors import TensorSpec  # safetensors >= 0.8: serialize from pointers
except ImportError:  # older safetensors: `save` (the same bytes, more Python per tensor)
    TensorSpec = None

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


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The bytes `safetensors.torch.save(tensors, metadata=metadata)` writes, by safetensors' own
    serializer in one copy, without `save`'s shared-storage check (`shard_format` gives each
    tensor its own storage). A tensor on a GPU, sparse or not contiguous, an older safetensors or
    a big-endian host: `save` itself (no pointer safetensors cannot read is handed over)."""
    plain = all(
        t.layout == torch.strided and t.is_cpu and t.is_contiguous() for t in tensors.values()
    )
    if TensorSpec is None or sys.byteorder != "little" or not plain:
        return st_save(tensors, metadata=metadata or None)
    specs = {  # the dtype names and the header are safetensors' own (as `save` names them)
        name: TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=t.shape,
            data_ptr=t.data_ptr(),
            data_len=t.nbytes,
        )
        for name, t in tensors.items()
    }
    return st_serialize(specs, metadata=metadata or None)  # `tensors` keeps the data alive
