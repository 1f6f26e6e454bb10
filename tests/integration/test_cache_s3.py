"""CacheStore and CacheDataset against a real S3 endpoint (moto server on loopback)."""

from __future__ import annotations

import threading

import pytest
import torch

import splitstage.tasks.cache.store as cache_store_module
from splitstage.storage.files import (
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StoragePermissionError,
    open_fs,
    write_chains,
)
from splitstage.tasks.cache.reader import CacheDataset
from splitstage.tasks.cache.store import CacheCorruptError, CacheStore
from tests.helpers.cache_samples import (
    assert_same,
    key_of,
    make_sample,
    make_samples,
    rich_sample,
    run_writer_processes,
)

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)


def test_round_trip_on_s3(s3_bucket):
    url, options = s3_bucket
    store = CacheStore(url, "ck", options)
    sample = rich_sample()
    infos = store.write_shards([{key_of(1): sample}, make_samples([2, 3])])
    reader = CacheStore(url, "ck", options)
    assert reader.committed_keys() == {key_of(i) for i in (1, 2, 3)}
    got = reader.read_samples([key_of(1), key_of(3)])
    assert_same(got[key_of(1)], sample)
    assert_same(got[key_of(3)], make_sample(3))
    assert reader.stats().bytes == sum(i.nbytes for i in infos)
    assert store.fs.exists(f"bucket/prefix/ck/index/{infos[0].shard_id}.json")
    store.write_manifest({"shards": 2})
    assert reader.read_manifest() == {"shards": 2}


def test_index_snapshot_on_s3(s3_bucket, monkeypatch):
    url, options = s3_bucket
    store = CacheStore(url, "ck", options)
    store.write_shards([make_samples([1, 2]), make_samples([3])])
    assert store.write_index_snapshot() == 2
    reads: list[str] = []
    real = CacheStore._scan
    monkeypatch.setattr(
        CacheStore, "_scan", lambda self, paths: reads.extend(paths) or real(self, paths)
    )
    assert CacheStore(url, "ck", options).committed_keys() == {key_of(i) for i in (1, 2, 3)}
    assert reads == []  # every entry's ETag matched: none read
    added = store.write_shard(make_samples([4]))
    assert len(CacheStore(url, "ck", options).key_table()) == 4
    assert [p.rsplit("/", 1)[-1] for p in reads] == [f"{added.shard_id}.json"]
    store.write_index_snapshot()  # now holds the added entry too
    path = f"{store.root}/index/{added.shard_id}.json"
    entry = store.fs.cat_file(path)
    store.fs.pipe_file(path, entry.replace(b'"format":2', b'"format": 2'))  # a new ETag
    reads.clear()
    assert len(CacheStore(url, "ck", options).key_table()) == 4
    assert len(reads) == 1 + 3  # that entry (other bytes), then every entry: never stale


def test_credentials_from_env_and_endpoint_env(s3_bucket, s3_endpoint, monkeypatch):
    url, options = s3_bucket
    CacheStore(url, "ck", options).write_shard(make_samples([1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    store = CacheStore(url, "ck")  # key, secret and endpoint all from the environment
    assert store.committed_keys() == {key_of(1)}


def test_crash_between_shard_and_index_on_s3(s3_bucket, monkeypatch):
    url, options = s3_bucket
    real = cache_store_module.write_chains

    def crash_after_shard(fs, chains):
        for chain in chains:
            real(fs, [chain[:1]])  # the shard file is written, then the process "dies"
            raise OSError("simulated crash before the index entry was written")

    monkeypatch.setattr(cache_store_module, "write_chains", crash_after_shard)
    with pytest.raises(OSError, match="simulated crash"):
        CacheStore(url, "ck", options).write_shard(make_samples([1, 2]))
    monkeypatch.setattr(cache_store_module, "write_chains", real)
    store = CacheStore(url, "ck", options)
    assert store.committed_keys() == set()
    assert len(store.verify().orphans) == 1
    store.write_shard(make_samples([1, 2]))
    assert store.committed_keys() == {key_of(1), key_of(2)}
    assert store.verify().orphans == []


def test_damage_on_s3_is_detected_and_named(s3_bucket):
    url, options = s3_bucket
    store = CacheStore(url, "ck", options)
    flipped, truncated, deleted, good = store.write_shards([make_samples([i]) for i in range(4)])
    fs, root = store.fs, store.root
    data = bytearray(fs.cat_file(f"{root}/{flipped.path}"))
    data[-3] ^= 0x80
    fs.pipe_file(f"{root}/{flipped.path}", bytes(data))
    fs.pipe_file(f"{root}/{truncated.path}", fs.cat_file(f"{root}/{truncated.path}")[:-10])
    fs.rm_file(f"{root}/{deleted.path}")
    reader = CacheStore(url, "ck", options)
    for info, says in ((flipped, "checksum"), (truncated, "wrong size"), (deleted, "missing")):
        with pytest.raises(CacheCorruptError, match=says) as err:
            reader.read_shard(info.shard_id)
        assert f"s3://bucket/prefix/ck/{info.path}" in str(err.value)
    assert_same(reader.read_shard(good.shard_id)[key_of(3)], make_sample(3))
    report = reader.verify()
    assert report.shards_checked == 4 and len(report.damaged) == 3
    assert good.shard_id not in " ".join(p.path for p in report.damaged)


def test_duplicates_and_concurrent_writers_on_s3(s3_bucket):
    url, options = s3_bucket
    errors: list[BaseException] = []

    def work(ids):
        try:
            store = CacheStore(url, "ck", options)
            for start in range(ids[0], ids[-1] + 1, 2):
                store.write_shard(make_samples([i for i in (start, start + 1) if i in ids]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(list(r),)) for r in (range(0, 6), range(3, 9))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    run_writer_processes(url, options, [list(range(6, 12)), list(range(9, 15))])
    store = CacheStore(url, "ck", options)
    assert store.committed_keys() == {key_of(i) for i in range(15)}
    stats = store.stats()
    assert stats.samples == 15 and stats.duplicates > 0  # thread shards overlap at odd offsets
    assert store.verify().ok
    got = store.read_samples(sorted(store.committed_keys()))
    for i in range(15):
        assert_same(got[key_of(i)], make_sample(i))


def test_missing_bucket_is_a_clear_storage_error(s3_bucket):
    _, options = s3_bucket
    store = CacheStore("s3://no-such-bucket/prefix", "ck", options)
    with pytest.raises(StorageBucketNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        store.write_shard(make_samples([1]))
    with pytest.raises(StorageBucketNotFoundError, match="s3://no-such-bucket/prefix/ck"):
        store.committed_keys()


def test_write_chains_never_writes_past_a_failure(s3_bucket):
    url, options = s3_bucket
    fs, root = open_fs(url, options)
    chains = [
        [("no-such-bucket/shard", b"s"), (f"{root}/index-after-failed", b"i")],
        [(f"{root}/shard-ok", b"s"), (f"{root}/index-ok", b"i")],
    ]
    with pytest.raises(FileNotFoundError):
        write_chains(fs, chains)
    assert not fs.exists(f"{root}/index-after-failed")
    assert fs.cat([f"{root}/shard-ok", f"{root}/index-ok"]) == {
        f"{root}/shard-ok": b"s",
        f"{root}/index-ok": b"i",
    }


def test_wrong_credentials_and_no_permission(s3_auth):
    url, opts = s3_auth
    CacheStore(url, "ck", opts("writer")).write_shard(make_samples([1]))
    secret = "Wr0ngSecretValue1234"
    cases = [
        (opts("writer", secret), StorageCredentialsError, "SignatureDoesNotMatch", "check the key"),
        (
            {**opts("writer"), "key": "AKIANOTAREALKEY00000", "secret": secret},
            StorageCredentialsError,
            "InvalidAccessKeyId",
            "check the key",
        ),
        (opts("nobody"), StoragePermissionError, "AccessDenied", "lack permission"),
    ]
    for options, kind, code, sentence in cases:
        store = CacheStore(url, "ck", options)
        for action in (store.committed_keys, lambda s=store: s.write_shard(make_samples([2]))):
            with pytest.raises(kind, match=code) as err:
                action()
            message = str(err.value)
            assert "s3://bucket/prefix/ck" in message and sentence in message
            assert options["secret"] not in message and options["secret"] not in repr(store)
            assert isinstance(err.value, StorageError) and isinstance(err.value, OSError)


def test_dataset_over_s3(s3_bucket):
    url, options = s3_bucket
    store = CacheStore(url, "ck", options)
    store.write_shards([make_samples(range(i, i + 3)) for i in range(0, 12, 3)])
    ds = CacheDataset(CacheStore(url, "ck", options))
    seen = []
    for rank in range(2):
        for keys, batch in ds.iterate(0, 1, rank, 2, batch_size=4, prefetch=2, with_keys=True):
            seen += keys
            assert batch["prompt_emb"].shape[0] == len(keys)
            want = torch.stack([make_sample(int(k[:8], 16))["prompt_emb"] for k in keys])
            assert torch.equal(batch["prompt_emb"], want)
    assert sorted(seen) == sorted(ds.keys)
