"""Small JSON records in folders beside the shards (`<cache>/<folder>/<name>.json`).

`SideRecords` is mixed into `CacheStore`: one listing and one batched read give a folder's
records. Stage 1 keeps its undecodable rows here (`tasks.stage1.undecodable`). Writes are atomic;
a record that does not parse is left out with one warning (it only costs a retry).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import splitstage.storage.files as st
import splitstage.tasks.cache.shard_format as fmt
from splitstage.storage.files import storage_errors

log = logging.getLogger(__name__)


class SideRecords:
    """write / read / remove the JSON records of one folder of a `CacheStore`."""

    def _record_path(self, folder: str, name: str) -> str:
        fmt.check_name(f"{folder} record", name)
        return self._path(f"{folder}/{name}.json")

    def write_record(self, folder: str, name: str, record: Mapping[str, Any]) -> None:
        """Write (or replace) record `name` of `folder` atomically."""
        data = json.dumps(record, sort_keys=True).encode()
        with storage_errors(
            self.url, f"write {folder} records under", self._options, field="cache.storage_options"
        ):
            st.write_atomic(self.fs, self._record_path(folder, name), data)

    def read_records(self, folder: str) -> dict[str, dict[str, Any]]:
        """Every record of `folder` by name ({} when there is none): one listing, one read."""
        paths = sorted(self._list(folder, ".json"))
        with storage_errors(
            self.url, f"read {folder} records under", self._options, field="cache.storage_options"
        ):
            datas = st.read_many(self.fs, paths)
        records: dict[str, dict[str, Any]] = {}
        for path, data in zip(paths, datas, strict=True):
            if isinstance(data, BaseException):
                st.raise_if_storage_error(
                    data, self._url(path), "read", self._options, field="cache.storage_options"
                )
                if isinstance(data, FileNotFoundError):
                    continue  # removed since the listing
                raise data
            try:
                record = json.loads(data)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                log.warning("ignoring %s: not a JSON object", self._url(path))
                continue
            records[path.rsplit("/", 1)[-1].removesuffix(".json")] = record
        return records

    def remove_records(self, folder: str, names: Iterable[str]) -> None:
        """Delete records of `folder` (those already gone are fine)."""
        with storage_errors(
            self.url, f"remove {folder} records under", self._options, field="cache.storage_options"
        ):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self._record_path(folder, name))
