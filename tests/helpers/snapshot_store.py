"""A cache with its index snapshot, the entry reads seen, and store helpers: the snapshot tests'."""

from __future__ import annotations

import os

import pytest

from splitstage.storage.files import is_local
from splitstage.tasks.cache.store import CacheStore
from tests.helpers.cache_samples import make_samples


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> CacheStore:
    """A cache of 12 samples in 4 shards of 3, with its index snapshot written."""
    url = str(tmp_path / "cache") if request.param == "local" else f"memory://snap/{tmp_path.name}"
    store = CacheStore(url, "ck")
    store.write_shards([make_samples(range(i, i + 3)) for i in range(0, 12, 3)])
    assert store.write_index_snapshot() == 4
    return store


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The index entries every store reads from now on (their file names)."""
    seen: list[str] = []
    real = CacheStore._scan

    def scan(self, paths):
        seen.extend(p.rsplit("/", 1)[-1] for p in paths)
        return real(self, paths)

    monkeypatch.setattr(CacheStore, "_scan", scan)
    return seen


def fresh(store: CacheStore) -> CacheStore:
    """Another store on the same cache (as a new process opens it)."""
    return CacheStore(store.base_url, store.cache_key)


def later(store: CacheStore, path: str) -> None:
    """Give a rewritten local file a later modification time (memory:// stamps a new one)."""
    if is_local(store.fs):  # a second later: coarse file-system clocks cannot hide the rewrite
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
