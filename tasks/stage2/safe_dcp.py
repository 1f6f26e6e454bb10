"""DCP's reader and writer made safe: a reader that refuses to run code, a writer whose failures
keep their cause.

torch's FileSystemReader reads a checkpoint's `.metadata` with plain `pickle.load`, so a crafted
checkpoint in a shared bucket could run code on resume. This reader allows only the classes a DCP
metadata file is made of (torch.distributed.checkpoint's dataclasses, torch.Size, dtypes,
layouts (by name), memory formats, plain containers) and refuses everything else by name.

torch's zip writer turns a failed write (a full disk) into `RuntimeError: [enforce fail at
inline_container.cc] unexpected pos`, the OSError only its `__context__`, which DCP drops when it
sends a rank's failure to the others (pickle keeps no context). `SafeFsspecWriter` remembers the
OSError its streams raised and raises it (errno, path) in place of what came out, so every rank
can say "no space left" (`storage.files.translate_error`).
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
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


class _WatchedStream:
    """A writable stream that notes each OSError its writes raise (then raises it as before)."""

    def __init__(self, raw: Any, seen: list[OSError]):
        self._raw, self._seen = raw, seen

    def _call(self, name: str, *args: Any) -> Any:
        """The raw stream's method `name`, noting an OSError it raises."""
        try:
            return getattr(self._raw, name)(*args)
        except OSError as exc:
            self._seen.append(exc)
            raise

    def write(self, data: Any) -> Any:
        """Write, noting a failure."""
        return self._call("write", data)

    def flush(self) -> None:
        """Flush, noting a failure."""
        self._call("flush")

    def close(self) -> None:
        """Close, noting a failure."""
        self._call("close")

    def __getattr__(self, name: str) -> Any:
        """Everything else is the raw stream's."""
        return getattr(self._raw, name)


class _WatchedFileSystem(FileSystem):
    """DCP's fsspec FileSystem whose write streams note their OSErrors (closing included)."""

    def __init__(self, inner: FileSystem, seen: list[OSError]):
        super().__init__()
        self.fs, self._seen = inner.fs, seen

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        """DCP's stream; for writing, one that notes its OSErrors."""
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                yield _WatchedStream(stream, self._seen)
        except OSError as exc:
            self._seen.append(exc)
            raise


def write_cause(error: BaseException, seen: list[OSError]) -> OSError | None:
    """The OSError (with an errno) behind a failed write: one a stream raised, or one in the
    error's own chain; None when there is none."""
    chain: list[BaseException] = []
    cur: BaseException | None = error
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    found = [e for e in [*chain, *seen] if isinstance(e, OSError) and e.errno is not None]
    return found[0] if found else None


class SafeFsspecWriter(FsspecWriter):
    """FsspecWriter whose failed writes raise the OSError that caused them (errno and path),
    whatever torch's writer made of it, so it survives DCP's pickling to the other ranks."""

    def __init__(self, path: Any, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.write_errors: list[OSError] = []
        self.fs = _WatchedFileSystem(self.fs, self.write_errors)

    @contextlib.contextmanager
    def _causes_kept(self) -> Iterator[None]:
        """Raise a failure as the OSError behind it (a plain one: it pickles with its errno)."""
        try:
            yield
        except Exception as exc:
            cause = write_cause(exc, self.write_errors)
            if cause is None or cause is exc:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename) from exc

    def write_data(self, plan: Any, planner: Any) -> Any:
        """DCP's write of this rank's files, failing with the OSError behind a failure."""
        with self._causes_kept():
            return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        """DCP's write of `.metadata`, failing with the OSError behind a failure."""
        with self._causes_kept():
            super().finish(metadata, results)
