"""The index snapshot and the compact manifest: used when valid, never a wrong index or key list."""

from __future__ import annotations

import json
import logging

import pytest

import splitstage.tasks.cache.index_snapshot as snap
from splitstage.tasks.cache.index_entry import seen_digest
from splitstage.tasks.cache.key_table import KeyTable
from splitstage.tasks.cache.store import CacheCorruptError, CacheStore
from tests.helpers import snapshot_store
from tests.helpers.cache_samples import assert_same, key_of, make_sample, make_samples
from tests.helpers.snapshot_store import fresh, later

SNAPSHOT_LOG = "splitstage.tasks.cache.index_snapshot"
store = snapshot_store.store  # fixture: a cache of 12 samples in 4 shards, with its snapshot
reads = snapshot_store.reads  # fixture: the index entries read from now on


def full_read(store: CacheStore, monkeypatch) -> tuple[list[str], dict, list[str]]:
    """Keys, groups and the shard of each key as a store that reads every entry sees them."""
    with monkeypatch.context() as m:
        m.setattr(snap, "_snapshot", lambda store: None)
        other = fresh(store)
        keys = other.key_table().to_list()
        return keys, other.stats().buckets, sorted(other.shard_of(keys).items())


def view(store: CacheStore) -> tuple[list[str], dict, list[str]]:
    """The same figures from `store` as it loads its index."""
    keys = store.key_table().to_list()
    return keys, store.stats().buckets, sorted(store.shard_of(keys).items())


def flip(data: bytes, at: int) -> bytes:
    """`data` with the byte at `at` flipped."""
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def entry_paths(store: CacheStore) -> list[str]:
    """The index entry paths of the cache, sorted."""
    return sorted(store._list("index", ".json"))


def test_a_valid_snapshot_is_used_and_no_entry_is_read(store, reads, monkeypatch, caplog):
    want = full_read(store, monkeypatch)
    reads.clear()
    other = fresh(store)
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert view(other) == want
    assert reads == [] and not caplog.records
    assert len(want[0]) == 12
    got = other.read_samples([key_of(4), key_of(11)])  # shard ids, sizes, sha256s from it
    assert_same(got[key_of(4)], make_sample(4))
    entry = entry_paths(store)[0]
    data = store.fs.cat_file(entry)
    assert other._seen_digest(entry.rsplit("/", 1)[-1][:-5]) == seen_digest(data)


def test_entries_added_since_are_read_and_merged(store, reads, monkeypatch, caplog):
    info = store.write_shard(make_samples([20, 21]))
    want = full_read(store, monkeypatch)
    reads.clear()
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert view(fresh(store)) == want
    assert reads == [f"{info.shard_id}.json"] and not caplog.records
    assert key_of(21) in want[0]


def test_a_removed_entry_makes_the_store_read_every_entry(store, reads, monkeypatch, caplog):
    store.fs.rm(entry_paths(store)[1])
    want = full_read(store, monkeypatch)
    reads.clear()
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert view(fresh(store)) == want
    assert len(want[0]) == 9 and len(reads) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"index snapshot {store.url}/index-snapshot.parquet is not used (1 of its entries "
        "were removed since): reading every index entry"
    ]


def test_an_entry_rewritten_with_other_bytes_is_never_hidden(store, reads, monkeypatch, caplog):
    path = entry_paths(store)[2]
    data = store.fs.cat_file(path)
    entry = json.loads(data)
    dropped = sorted(entry["samples"])[0]
    del entry["samples"][dropped]  # a valid entry that commits one sample fewer
    store.fs.pipe_file(path, json.dumps(entry).encode())
    later(store, path)
    want = full_read(store, monkeypatch)
    reads.clear()
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        got = view(fresh(store))
    assert got == want and dropped not in got[0] and len(got[0]) == 11
    assert len(reads) == 1 + 4  # the rewritten entry, then every entry
    assert "was rewritten since" in caplog.records[0].getMessage()


def test_an_entry_rewritten_with_the_same_bytes_keeps_the_snapshot(store, reads, caplog):
    path = entry_paths(store)[0]
    data = store.fs.cat_file(path)
    store.fs.rm(path)
    store.fs.pipe_file(path, data)  # `check(touch=True)` re-commits an entry like this
    later(store, path)
    reads.clear()
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert len(fresh(store).key_table()) == 12
    assert reads == [path.rsplit("/", 1)[-1]] and not caplog.records


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda data: flip(data, data.index(b"shard_sha")), "fails its checksum"),  # page CRC
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "does not parse"),  # Parquet's magic
        (lambda data: b"not a snapshot", "does not parse"),
        (lambda data: data[: len(data) // 2], "does not parse"),
    ],
)
def test_a_corrupt_snapshot_is_not_used(store, reads, monkeypatch, caplog, damage, why):
    path = f"{store.root}/{snap.SNAPSHOT}"
    data = store.fs.cat_file(path)
    store.fs.pipe_file(path, damage(data))
    want = full_read(store, monkeypatch)
    reads.clear()
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert view(fresh(store)) == want
    assert len(reads) == 4 and why in caplog.records[0].getMessage()


def test_a_snapshot_of_another_cache_key_is_not_used(store, reads, caplog):
    other = CacheStore(store.base_url, "other")
    other.write_shard(make_samples([40]))
    other.write_index_snapshot()
    data = store.fs.cat_file(f"{other.root}/{snap.SNAPSHOT}")
    store.fs.pipe_file(f"{store.root}/{snap.SNAPSHOT}", data)
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert len(fresh(store).key_table()) == 12
    assert "of cache key 'other'" in caplog.records[0].getMessage()


def test_a_bad_entry_added_since_fails_as_a_full_read_does(store):
    store.fs.pipe_file(f"{store.root}/index/{'e' * 32}.json", b"{broken")
    with pytest.raises(CacheCorruptError, match="is not valid JSON"):
        fresh(store).key_table()
    assert store.write_index_snapshot() == 4  # the writer leaves it out; readers still fail
    with pytest.raises(CacheCorruptError, match="is not valid JSON"):
        fresh(store).key_table()


def test_check_finds_a_shard_changed_after_the_snapshot(store, reads):
    path = f"{store.root}/{store.shard_file(fresh(store).shard_of([key_of(5)])[key_of(5)])}"
    data = store.fs.cat_file(path)
    store.fs.pipe_file(path, data[:-1] + bytes([data[-1] ^ 1]))  # same size, later mtime
    later(store, path)
    checker = fresh(store)
    assert len(checker.key_table()) == 12  # the snapshot still holds: the index did not change
    report = checker.check("changed")
    assert [p.kind for p in report.damaged] == ["content"] and key_of(5) in report.lost
    assert checker.quarantine(report.damaged) and key_of(5) not in fresh(store).key_table()


def test_an_empty_cache_snapshots(tmp_path, reads):
    store = CacheStore(str(tmp_path / "cache"), "ck")
    assert store.write_index_snapshot() == 0
    assert len(fresh(store).key_table()) == 0 and reads == []


def test_the_manifest_keeps_its_samples_compact(store):
    keys = [key_of(i) for i in (3, 1, 2)]
    store.write_manifest({"samples": keys, "report": {"computed": 3}})
    raw = json.loads(store.fs.cat_file(f"{store.root}/manifest.json"))
    assert "samples" not in raw and raw["samples_file"]["count"] == 3
    first = raw["samples_file"]["name"]
    manifest = fresh(store).read_manifest()
    assert isinstance(manifest["samples"], KeyTable) and list(manifest["samples"]) == sorted(keys)
    assert manifest["report"] == {"computed": 3} and "samples_file" not in manifest
    store.write_manifest({"samples": keys[:2]})  # a new sample list replaces the old file
    assert not store.fs.exists(f"{store.root}/{first}")
    assert list(fresh(store).read_manifest()["samples"]) == sorted(keys[:2])


def test_a_manifest_with_inline_samples_is_not_one_splitstage_writes(store):
    keys = [key_of(2), key_of(1)]
    store.fs.pipe_file(f"{store.root}/manifest.json", json.dumps({"samples": keys}).encode())
    with pytest.raises(CacheCorruptError, match=r"manifest\.json is not a splitstage manifest"):
        fresh(store).read_manifest()


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "fails its checksum"),
        (None, "is missing"),
    ],
)
def test_a_damaged_samples_file_is_an_error_naming_it(store, damage, match):
    store.write_manifest({"samples": [key_of(1)]})
    name = json.loads(store.fs.cat_file(f"{store.root}/manifest.json"))["samples_file"]["name"]
    path = f"{store.root}/{name}"
    if damage is None:
        store.fs.rm(path)
    else:
        store.fs.pipe_file(path, damage(store.fs.cat_file(path)))
    with pytest.raises(
        CacheCorruptError, match=f"samples file .*{name}.* {match}.*rerun preprocess"
    ):
        fresh(store).read_manifest()


def test_a_snapshot_of_the_old_format_is_not_found_and_left_alone(store, reads, caplog):
    old = f"{store.root}/index-snapshot.safetensors"
    store.fs.pipe_file(old, b"an index snapshot of the safetensors format")
    store.fs.rm(f"{store.root}/{snap.SNAPSHOT}")  # as before the change: only the old file
    reads.clear()
    with caplog.at_level(logging.WARNING, SNAPSHOT_LOG):
        assert len(fresh(store).key_table()) == 12
    assert len(reads) == 4 and not caplog.records  # every entry read once, nothing to warn
    assert store.write_index_snapshot() == 4
    reads.clear()
    assert len(fresh(store).key_table()) == 12 and reads == []  # the Parquet snapshot holds
    assert store.fs.cat_file(old).startswith(b"an index snapshot")
