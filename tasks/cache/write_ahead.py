"""Shards encoded, and on object stores uploaded, ahead of their commit (the index entry, later).

Stage 1 encodes shard k+1 and uploads its file while shard k is committed, yet commits strictly in
order: `CacheStore.prepare_shard` encodes a shard and, on an async object store, starts the put
of its shard file on fsspec's I/O loop; `CacheStore.write_shard(prepared)` waits for that put and
only then writes the index entry. Until its commit the shard is a file no index entry names (an
orphan, as after a crash between the two writes), so readers never see it. Elsewhere (local disk,
memory) nothing is written ahead: both files are written at the commit, as `write_shard` does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import splitstage.tasks.cache.shard_format as fmt
from splitstage.storage.files import (
    display_url,
    is_local,
    raise_if_storage_error,
    storage_errors,
    write_chains,
)
from splitstage.tasks.cache.shard_format import ShardInfo


@dataclass(eq=False)
class PreparedShard:
    """An encoded shard not yet committed: its info, index entry bytes and paths; `data` is the
    shard file still to write at the commit (None: its put, `upload`, started ahead)."""

    info: ShardInfo
    index: bytes
    shard_path: str
    index_path: str
    data: bytes | None
    upload: concurrent.futures.Future | None = None

    def files(self) -> list[tuple[str, bytes]]:
        """What the commit writes, in order: the shard file unless uploaded ahead, the entry."""
        shard = [] if self.data is None else [(self.shard_path, self.data)]
        return [*shard, (self.index_path, self.index)]

    def wait(self) -> None:
        """Wait for the shard file's put started ahead; raise its error (the commit must not
        follow)."""
        if self.upload is not None:
            self.upload.result()

    def discard(self) -> None:
        """Give the shard up uncommitted: wait for a put started ahead, ignoring its failure, so
        nothing is still writing once the caller returns."""
        with contextlib.suppress(BaseException):
            self.wait()


def start_upload(fs: Any, path: str, data: bytes) -> concurrent.futures.Future | None:
    """Start putting `data` at `path` on an async filesystem's I/O loop (one put: atomic on an
    object store); None where the file is better written at the commit (local, sync stores)."""
    if is_local(fs) or not getattr(fs, "async_impl", False):
        return None

    async def put() -> None:
        try:
            await fs._pipe_file(path, data)
        except Exception as exc:
            raise_if_storage_error(
                exc,
                display_url(fs, path),
                "write",
                fs.storage_options,
                field="cache.storage_options",
            )
            raise

    return asyncio.run_coroutine_threadsafe(put(), fs.loop)


class WriteAhead:
    """`prepare_shard` and the commit of a prepared shard, of a `CacheStore` (mixed into it)."""

    def prepare_shard(self, samples: Mapping[str, Mapping[str, Any]]) -> PreparedShard:
        """Encode a shard, start its file's upload (object stores); invisible until committed."""
        info, data, index = fmt.prepare_shard(samples)
        shard_path, index_path = self._path(info.path), self._path(self.index_file(info.shard_id))
        with storage_errors(
            self.url, "write shards under", self._options, field="cache.storage_options"
        ):
            upload = start_upload(self.fs, shard_path, data)
        return PreparedShard(info, index, shard_path, index_path, None if upload else data, upload)

    def _commit(self, prepared: PreparedShard) -> fmt.ShardInfo:
        """Wait for a prepared shard's file (written now unless uploaded ahead), then its entry."""
        if not prepared.index_path.startswith(f"{self.root}/"):
            raise ValueError(f"shard {prepared.info.shard_id} was prepared for another cache")
        with storage_errors(
            self.url, "write shards under", self._options, field="cache.storage_options"
        ):
            prepared.wait()
            write_chains(self.fs, [prepared.files()])
        prepared.data = None
        self._record([(prepared.info, prepared.index)])
        return prepared.info
