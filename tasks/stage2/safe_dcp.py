"""A DCP reader that refuses to run code: `.metadata` is unpickled with an allowlist.

torch's FileSystemReader reads a checkpoint's `.metadata` with plain `pickle.load`, so a crafted
checkpoint in a shared bucket could run code on resume. This reader allows only the classes a DCP
metadata file is made of (torch.distributed.checkpoint's dataclasses, torch.Size, dtypes,
layouts (by name), memory formats, plain containers) and refuses everything else by name.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from splitstage.splitter import UserError

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_TORCH_NAMES = {"Size"}
_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "slice", "bytes", "bytearray", "complex"}


class UnsafeCheckpointError(UserError, pickle.UnpicklingError):
    """A checkpoint's metadata names a class outside the DCP allowlist: it is not loaded."""


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP metadata: only allowlisted globals resolve."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith(_DCP_MODULES)
            or (module == "torch" and (name in _TORCH_NAMES or _is_torch_constant(name)))
            or (module == "builtins" and name in _BUILTINS)
            or (module == "collections" and name in {"OrderedDict", "defaultdict"})
            or (module == "torch.serialization" and name == "_get_layout")
        )
        if not allowed:
            raise UnsafeCheckpointError(
                f"checkpoint metadata asks for {module}.{name}, which a DCP checkpoint never "
                "contains; refusing to load it (it could run code). Was this file tampered with?"
            )
        return super().find_class(module, name)


def _is_torch_constant(name: str) -> bool:
    """dtypes, layouts and memory formats: torch attributes that carry no code."""
    value = getattr(torch, name, None)
    return isinstance(value, torch.dtype | torch.layout | torch.memory_format)


def load_metadata(data: bytes) -> Metadata:
    """Unpickle DCP metadata bytes through the allowlist."""
    metadata = DCPMetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"checkpoint metadata holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


class SafeFsspecReader(FsspecReader):
    """FsspecReader whose read_metadata cannot execute code from the checkpoint."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
