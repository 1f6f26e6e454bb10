"""The snapshot-backed cache check: the very report and index of the full check, fewer reads."""

from __future__ import annotations

import os
import time

import pytest

import splitstage.tasks.cache.repair as repair
from splitstage.storage.files import is_local
from splitstage.tasks.cache.index_snapshot import SNAPSHOT
from splitstage.tasks.cache.store import CacheStore
from tests.helpers import snapshot_store
from tests.helpers.cache_samples import key_of, make_sample, make_samples
from tests.helpers.snapshot_store import fresh, later

store = snapshot_store.store  # fixture: a cache of 12 samples in 4 shards, with its snapshot
reads = snapshot_store.reads  # fixture: the index entries read from now on


def _shard_path(store: CacheStore, key: str) -> str:
    return f"{store.root}/{store.shard_file(fresh(store).shard_of([key])[key])}"


def _entry_path(store: CacheStore, key: str) -> str:
    return f"{store.root}/{store.index_file(fresh(store).shard_of([key])[key])}"


def _rewrite(store: CacheStore, path: str, data: bytes) -> None:
    store.fs.pipe_file(path, data)
    later(store, path)


def _flip_last_byte(store: CacheStore, path: str) -> None:
    data = store.fs.cat_file(path)
    _rewrite(store, path, data[:-1] + bytes([data[-1] ^ 1]))


DAMAGE = {
    "intact": lambda s: None,
    "shard deleted": lambda s: s.fs.rm_file(_shard_path(s, key_of(4))),
    "shard truncated": lambda s: s.fs.pipe_file(_shard_path(s, key_of(4)), b"x"),
    "shard flipped later": lambda s: _flip_last_byte(s, _shard_path(s, key_of(4))),
    "shard rewritten as it was, later": lambda s: _rewrite(
        s, _shard_path(s, key_of(4)), s.fs.cat_file(_shard_path(s, key_of(4)))
    ),
    "entry removed": lambda s: s.fs.rm_file(_entry_path(s, key_of(7))),
    "entry rewritten with garbage": lambda s: _rewrite(s, _entry_path(s, key_of(7)), b"{}"),
    "entry rewritten as it was": lambda s: _rewrite(
        s, _entry_path(s, key_of(7)), s.fs.cat_file(_entry_path(s, key_of(7)))
    ),
    "bad entry added": lambda s: s.fs.pipe_file(f"{s.root}/index/{'0' * 32}.json", b"[1]"),
    "good entry added": lambda s: s.write_shard(make_samples([30, 31])),
    "duplicate keys added": lambda s: s.write_shard(make_samples([4, 40])),
    "orphan shard": lambda s: s.fs.pipe_file(f"{s.root}/shards/{'f' * 32}.safetensors", b"x"),
    "entry of other params added": lambda s: s.write_shard({key_of(50): {"other": 1}}),
    "snapshot deleted": lambda s: s.fs.rm_file(f"{s.root}/{SNAPSHOT}"),
}
CHECKS = {
    "changed": {"checksums": "changed"},
    "none": {"checksums": "none"},
    "changed, some keys": {"checksums": "changed", "keys": [key_of(1), key_of(2)]},
    "changed, this job's params": {"checksums": "changed", "params": list(make_sample(1))},
    "none, other params": {"checksums": "none", "params": ["input_latents"]},
}


def seen_by(checker: CacheStore, report) -> tuple:
    """A check's report, the keys it leaves committed and each one's shard."""
    keys = checker.key_table().to_list()
    return report, keys, sorted(checker.shard_of(keys).items())


def full_check(store: CacheStore, monkeypatch, **how) -> tuple:
    """What the check that reads every index entry itself gives."""
    with monkeypatch.context() as m:
        m.setattr(repair, "snapshot_check", lambda *args: None)
        checker = fresh(store)
        return seen_by(checker, checker.check(**how))


@pytest.mark.parametrize("how", CHECKS.values(), ids=CHECKS)
@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE)
def test_same_report_and_index_as_the_full_check(store, monkeypatch, damage, how):
    damage(store)
    want = full_check(store, monkeypatch, **how)
    checker = fresh(store)
    assert seen_by(checker, checker.check(**how)) == want


def test_an_intact_cache_is_checked_without_reading_an_entry(store, reads):
    store.write_shard(make_samples([30, 31]))  # one entry added since the snapshot
    reads.clear()
    report = fresh(store).check("changed", params=list(make_sample(1)))
    assert report.ok and report.samples == 14 and report.shards_checked == 5
    assert len(reads) == 1  # only the entry the snapshot does not hold


def test_damage_is_found_by_reading_every_entry(store, reads):
    store.fs.rm_file(_shard_path(store, key_of(4)))
    reads.clear()
    report = fresh(store).check("changed")
    assert [p.kind for p in report.damaged] == ["missing"] and key_of(4) in report.lost
    assert len(reads) == 4  # the full check names it


def test_a_changed_but_intact_shard_is_recommitted_and_then_checked_quickly(store, reads):
    if is_local(store.fs):  # a copy that wrote index/ first: the entry older than its shard
        os.utime(_entry_path(store, key_of(4)), (time.time() - 60, time.time() - 60))
    else:  # memory:// stamps the rewrite's time
        path = _shard_path(store, key_of(4))
        store.fs.pipe_file(path, store.fs.cat_file(path))
    first = fresh(store).check("changed", touch=True)
    assert first.ok and first.bytes_checked > 0
    reads.clear()
    again = fresh(store).check("changed")
    assert again.ok and again.bytes_checked == 0 and len(reads) == 1  # the re-committed entry
