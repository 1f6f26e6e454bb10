"""CacheStore, storage helpers and CacheDataset on local disk and memory:// (no servers)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import splitstage.tasks.cache.store as cache_store_module
from splitstage.storage.files import (
    StorageError,
    open_fs,
    redact,
    translate_error,
    write_atomic,
)
from splitstage.tasks.cache.reader import CacheDataset, epoch_order
from splitstage.tasks.cache.shard_format import CacheNotFoundError
from splitstage.tasks.cache.store import CacheCorruptError, CacheStore, SampleNotCachedError
from tests.helpers.cache_samples import (  # noqa: F401
    assert_same,
    bits,
    key_of,
    make_sample,
    make_samples,
    rich_sample,
    run_writer_processes,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "memory"])
def cache_url(request, tmp_path) -> str:
    """A fresh cache URL on local disk or in memory://."""
    if request.param == "local":
        return str(tmp_path / "cache")
    return f"memory://splitstage-tests/{uuid.uuid4().hex}"


def shard_path(store: CacheStore, info) -> str:
    """Filesystem path of a written shard."""
    return f"{store.root}/{info.path}"


# ---- CacheStore --------------------------------------------------------------------------------
def test_round_trip_every_dtype_json_and_views(cache_url):
    store = CacheStore(cache_url, "ck")
    sample = rich_sample()
    info = store.write_shard({key_of(1): sample, key_of(2): make_sample(2)})
    fresh = CacheStore(cache_url, "ck")
    assert fresh.committed_keys() == {key_of(1), key_of(2)}
    got = fresh.read_samples([key_of(1), key_of(2)])
    assert_same(got[key_of(1)], sample)
    assert_same(got[key_of(2)], make_sample(2))
    assert fresh.read_shard(info.shard_id).keys() == {key_of(1), key_of(2)}
    stats = fresh.stats()
    assert (stats.samples, stats.shards, stats.bytes, stats.duplicates) == (2, 1, info.nbytes, 0)


def test_identical_tensors_are_stored_once_per_shard(cache_url):
    empty = torch.randn(16, 384)  # like the empty-prompt embedding every sample carries
    samples = {
        key_of(i): {"empty": empty.clone(), "own": torch.full((4,), float(i))} for i in range(8)
    }
    store = CacheStore(cache_url, "dedupe")
    info = store.write_shard(samples)
    assert info.nbytes < 2 * empty.nbytes  # 8 copies would take 8x
    back = store.read_samples(list(samples))
    for key, sample in samples.items():
        assert_same(back[key], sample)


def test_index_entry_lists_specs_and_checksum(tmp_path):
    store = CacheStore(str(tmp_path), "ck")
    info = store.write_shard(make_samples([3]))
    entry = json.loads((tmp_path / "ck" / "index" / f"{info.shard_id}.json").read_text())
    assert entry["format"] == 2 and entry["shard"] == info.path
    assert entry["bytes"] == info.nbytes and entry["sha256"] == info.sha256
    assert info.sha256.startswith(info.shard_id)
    params = entry["specs"][entry["samples"][key_of(3)]]
    assert params["latents"] == {"dtype": "bfloat16", "shape": [1, 4, 2, 2]}
    assert params["prompt"] == "json" and params["height"] == "json"
    assert not list((tmp_path / "ck").rglob("*.tmp-*"))


def test_same_samples_give_same_shard_id(cache_url):
    store = CacheStore(cache_url, "ck")
    a = store.write_shard(make_samples([1, 2]))
    b = CacheStore(cache_url, "ck").write_shard(make_samples([2, 1]))
    assert a == b
    assert store.stats().shards == 1


def test_crash_between_shard_and_index_hides_sample_and_rerun_commits(cache_url, monkeypatch):
    real = cache_store_module.write_chains

    def crash_after_shard(fs, chains):
        for chain in chains:
            real(fs, [chain[:1]])  # the shard file is written, then the process "dies"
            raise OSError("simulated crash before the index entry was written")

    monkeypatch.setattr(cache_store_module, "write_chains", crash_after_shard)
    with pytest.raises(OSError, match="simulated crash"):
        CacheStore(cache_url, "ck").write_shard(make_samples([1]))
    monkeypatch.setattr(cache_store_module, "write_chains", real)

    store = CacheStore(cache_url, "ck")
    assert store.committed_keys() == set()
    report = store.verify()
    assert report.ok and len(report.orphans) == 1
    with pytest.raises(SampleNotCachedError, match="run preprocess"):
        store.read_samples([key_of(1)])
    store.write_shard(make_samples([1]))  # the rerun
    assert store.committed_keys() == {key_of(1)}
    assert_same(store.read_samples([key_of(1)])[key_of(1)], make_sample(1))
    assert store.verify().orphans == []


def _damage(store: CacheStore, info, how: str) -> None:
    """Flip a byte in, truncate, or delete a shard file."""
    path = shard_path(store, info)
    if how == "delete":
        store.fs.rm_file(path)
        return
    data = bytearray(store.fs.cat_file(path))
    if how == "flip":
        data[-5] ^= 0x01
    else:
        data = data[: len(data) // 2]
    store.fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize(
    ("how", "says"),
    [("flip", "fails its checksum"), ("truncate", "wrong size"), ("delete", "is missing")],
)
def test_damaged_shard_is_named_and_never_returned(cache_url, how, says):
    store = CacheStore(cache_url, "ck")
    good = store.write_shard(make_samples([1]))
    bad = store.write_shard(make_samples([2, 3]))
    _damage(store, bad, how)
    reader = CacheStore(cache_url, "ck")
    with pytest.raises(CacheCorruptError, match=says) as err:
        reader.read_samples([key_of(2)])
    assert bad.shard_id in str(err.value) and "rerun preprocess" in str(err.value)
    with pytest.raises(CacheCorruptError):
        reader.read_shard(bad.shard_id)
    assert_same(reader.read_samples([key_of(1)])[key_of(1)], make_sample(1))
    report = reader.verify()
    assert not report.ok and report.shards_checked == 2
    assert [bad.shard_id in p.path for p in report.damaged] == [True]
    assert says in report.damaged[0].problem and good.shard_id not in report.damaged[0].path


def test_invalid_index_entry_is_named(cache_url):
    store = CacheStore(cache_url, "ck")
    info = store.write_shard(make_samples([1]))
    index = f"{store.root}/index/{info.shard_id}.json"
    store.fs.pipe_file(index, b'{"format": 1, "shard": ')
    reader = CacheStore(cache_url, "ck")
    with pytest.raises(CacheCorruptError, match="not valid JSON") as err:
        reader.committed_keys()
    assert f"index/{info.shard_id}.json" in str(err.value)
    report = reader.verify()
    assert not report.ok and f"index/{info.shard_id}.json" in report.damaged[0].path
    store.fs.pipe_file(index, json.dumps({"format": 1, "shard": info.path}).encode())
    with pytest.raises(CacheCorruptError, match="field 'bytes'"):
        CacheStore(cache_url, "ck").committed_keys()


def test_duplicates_across_shards_resolve_deterministically(cache_url):
    store = CacheStore(cache_url, "ck")
    a = store.write_shard(make_samples([1, 2]))
    b = store.write_shard(make_samples([2, 3]))
    reader = CacheStore(cache_url, "ck")
    assert reader.committed_keys() == {key_of(i) for i in (1, 2, 3)}
    assert reader.shard_of([key_of(2)]) == {key_of(2): min(a.shard_id, b.shard_id)}
    assert store.shard_of([key_of(2)]) == reader.shard_of([key_of(2)])  # writer's own listing
    stats = reader.stats()
    assert (stats.samples, stats.shards, stats.duplicates) == (3, 2, 1)
    assert stats.duplicate_keys == [key_of(2)]
    assert_same(reader.read_samples([key_of(2)])[key_of(2)], make_sample(2))
    assert reader.verify().ok


def test_listing_is_cached_until_refresh(cache_url):
    reader = CacheStore(cache_url, "ck")
    assert reader.committed_keys() == set()
    CacheStore(cache_url, "ck").write_shard(make_samples([1]))
    assert reader.committed_keys() == set()
    reader.refresh()
    assert reader.committed_keys() == {key_of(1)}


def test_concurrent_writer_threads(cache_url):
    shared = CacheStore(cache_url, "ck")
    groups = [range(0, 6), range(4, 10), range(8, 14), range(0, 6)]
    errors = []

    def work(ids, own_store):
        try:
            store = CacheStore(cache_url, "ck") if own_store else shared
            for start in range(ids.start, ids.stop, 3):
                store.write_shard(make_samples(range(start, min(start + 3, ids.stop))))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(g, i % 2 == 0)) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    reader = CacheStore(cache_url, "ck")
    assert reader.committed_keys() == {key_of(i) for i in range(14)}
    assert reader.verify().ok
    got = reader.read_samples([key_of(i) for i in range(14)])
    for i in range(14):
        assert_same(got[key_of(i)], make_sample(i))


def test_two_writer_processes_local(tmp_path):
    url = str(tmp_path / "cache")
    run_writer_processes(url, {}, [list(range(0, 9)), list(range(6, 15))])
    store = CacheStore(url, "ck")
    assert store.committed_keys() == {key_of(i) for i in range(15)}
    stats = store.stats()  # shard [6, 7, 8] came from both processes: the same bytes and id
    assert (stats.shards, stats.duplicates) == (5, 0)
    assert store.verify().ok
    got = store.read_samples(sorted(store.committed_keys()))
    for i in range(15):
        assert_same(got[key_of(i)], make_sample(i))


def test_bad_inputs_name_the_field(tmp_path):
    store = CacheStore(str(tmp_path), "ck")
    with pytest.raises(ValueError, match="no samples"):
        store.write_shard({})
    with pytest.raises(ValueError, match="sample key 'a/b'"):
        store.write_shard({"a/b": {"x": 1}})
    with pytest.raises(TypeError, match="param 'obj' of sample 'aa'.*set"):
        store.write_shard({"aa": {"obj": {1, 2}}})
    with pytest.raises(TypeError, match=r"param 'nested' of sample 'aa'\['k'\]\[0\]"):
        store.write_shard({"aa": {"nested": {"k": [object()]}}})
    for bad in ("../escape", "..", ""):
        with pytest.raises(ValueError, match="cache key"):
            CacheStore(str(tmp_path), bad)
    assert store.committed_keys() == set()


def test_manifest_round_trip(cache_url):
    store = CacheStore(cache_url, "ck")
    assert store.read_manifest() is None
    manifest = {"cache_key": "ck", "samples": [key_of(1)], "params": ["a", "b"]}
    store.write_manifest(manifest)
    read = CacheStore(cache_url, "ck").read_manifest()  # samples: a compact KeyTable
    assert {**read, "samples": list(read["samples"])} == manifest
    path = f"{store.root}/manifest.json"
    for garbage in (b"{not json", b"[1, 2]", b'{"samples": 3}', b'{"samples": ["../x"]}', b"null"):
        store.fs.pipe_file(path, garbage)
        with pytest.raises(CacheCorruptError, match="manifest.json.*rerun preprocess"):
            store.read_manifest()
    with pytest.raises(CacheCorruptError, match="not a splitstage manifest"):
        store.write_manifest({"samples": "all"})


def test_repr_hides_credentials(tmp_path):
    store = CacheStore(str(tmp_path), "ck", {"auto_mkdir": True})
    assert "CacheStore(url=" in repr(store)
    masked = redact({"key": "AKIA1", "secret": "s3cr3t", "client_kwargs": {"token": "t0k"}})
    assert masked == {"key": "***", "secret": "***", "client_kwargs": {"token": "***"}}


# ---- checks and repair ---------------------------------------------------------------------------
def test_one_listing_finds_missing_resized_and_unreadable_entries(cache_url):
    store = CacheStore(cache_url, "ck")
    deleted, truncated, garbled, good = store.write_shards(
        [make_samples([i, i + 1]) for i in range(0, 8, 2)]
    )
    _damage(store, deleted, "delete")
    _damage(store, truncated, "truncate")
    store.fs.pipe_file(f"{store.root}/index/{garbled.shard_id}.json", b'{"format": 1, "sh')
    reader = CacheStore(cache_url, "ck")
    report = reader.check("none")
    kinds = {p.shard_id: p.kind for p in report.damaged}
    assert kinds == {
        deleted.shard_id: "missing",
        truncated.shard_id: "size",
        garbled.shard_id: "index",
    }
    assert report.bytes_checked == 0 and report.shards_checked == 3  # nothing was re-read
    assert reader.committed_keys() == set(good.sample_keys)  # only intact samples
    assert report.lost == sorted(deleted.sample_keys + truncated.sample_keys)
    assert report.orphans == []  # the garbled entry's shard is damaged, not an orphan
    assert all("rerun preprocess" in p.problem for p in report.damaged)
    with pytest.raises(CacheCorruptError, match="not valid JSON"):  # readers stay strict
        CacheStore(cache_url, "ck").committed_keys()


def test_an_edit_in_place_is_found_from_the_listing_times(cache_url):
    store = CacheStore(cache_url, "ck")
    flipped, good = store.write_shards([make_samples([1, 2]), make_samples([3])])
    time.sleep(0.05)  # a later edit, as every real one is
    _damage(store, flipped, "flip")
    reader = CacheStore(cache_url, "ck")
    assert reader.check("none").damaged == []  # same size: a listing alone cannot tell
    assert reader.check("changed", keys=[key_of(3)]).damaged == []  # not an entry of these keys
    report = reader.check("changed")
    assert [(p.shard_id, p.kind) for p in report.damaged] == [(flipped.shard_id, "content")]
    assert "fails its checksum" in report.damaged[0].problem
    assert report.bytes_checked == 0  # the good shard was not re-read
    assert reader.committed_keys() == {key_of(3)} and report.lost == [key_of(1), key_of(2)]
    full = CacheStore(cache_url, "ck").check("all")
    assert len(full.damaged) == 1 and full.bytes_checked == good.nbytes


def test_damage_keeping_the_modification_time_needs_the_full_check(tmp_path):
    store = CacheStore(str(tmp_path), "ck")
    info = store.write_shard(make_samples([1]))
    path = shard_path(store, info)
    before = os.stat(path)
    _damage(store, info, "flip")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # bit rot, or `cp -p`
    assert store.check("changed").damaged == []
    assert [p.kind for p in store.check("all").damaged] == ["content"]
    assert not store.verify().ok


def test_a_shard_changed_but_intact_is_recommitted_and_read_once(tmp_path):
    store = CacheStore(str(tmp_path), "ck")
    info = store.write_shard(make_samples([1]))
    index = f"{store.root}/index/{info.shard_id}.json"
    os.utime(index, (time.time() - 60, time.time() - 60))  # a copy that wrote index/ first
    first = CacheStore(str(tmp_path), "ck").check("changed", touch=True)
    assert first.damaged == [] and first.bytes_checked == info.nbytes
    again = CacheStore(str(tmp_path), "ck").check("changed")
    assert again.damaged == [] and again.bytes_checked == 0


def test_quarantine_moves_damaged_entries_aside_and_a_rewrite_commits_again(cache_url):
    store = CacheStore(cache_url, "ck")
    bad, good = store.write_shards([make_samples([1, 2]), make_samples([3])])
    _damage(store, bad, "truncate")
    reader = CacheStore(cache_url, "ck")
    moved = reader.quarantine(reader.check("none").damaged)
    assert len(moved) == 1 and moved[0].endswith(f"ck/index/{bad.shard_id}.json")
    aside = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.root}/quarantine", False))
    assert aside == [f"{bad.shard_id}.{ext}" for ext in ("json", "problem.txt", "safetensors")]
    note = store.fs.cat_file(f"{store.root}/quarantine/{bad.shard_id}.problem.txt").decode()
    assert "wrong size" in note
    fresh = CacheStore(cache_url, "ck")
    assert fresh.committed_keys() == {key_of(3)} and fresh.verify().ok
    assert fresh.verify().orphans == []
    store.write_shard(make_samples([1, 2]))  # what the next preprocess does
    again = CacheStore(cache_url, "ck")
    assert again.committed_keys() == {key_of(i) for i in (1, 2, 3)} and again.verify().ok


def test_quarantine_leaves_an_entry_repaired_since_the_check(cache_url):
    store = CacheStore(cache_url, "ck")
    info = store.write_shard(make_samples([1]))
    _damage(store, info, "delete")
    reader = CacheStore(cache_url, "ck")
    report = reader.check("none")
    store.write_shard(make_samples([1]))  # another worker rewrites the very same shard
    assert reader.quarantine(report.damaged) == []
    assert CacheStore(cache_url, "ck").verify().ok


def test_a_good_duplicate_keeps_a_sample_when_its_other_copy_is_damaged(cache_url):
    store = CacheStore(cache_url, "ck")
    low, high = sorted(
        [store.write_shard(make_samples([1, 2])), store.write_shard(make_samples([2, 3]))],
        key=lambda info: info.shard_id,
    )
    _damage(store, low, "truncate")  # the copy of sample 2 that readers used
    reader = CacheStore(cache_url, "ck")
    report = reader.check("none")
    assert reader.committed_keys() == set(high.sample_keys)
    assert report.lost == sorted(set(low.sample_keys) - {key_of(2)})
    assert reader.shard_of([key_of(2)]) == {key_of(2): high.shard_id}
    assert_same(reader.read_samples([key_of(2)])[key_of(2)], make_sample(2))


def test_an_entry_with_other_params_is_damaged_for_this_job(cache_url):
    store = CacheStore(cache_url, "ck")
    store.write_shard(make_samples([1]))
    odd = store.write_shard({key_of(2): {"latents": torch.zeros(2)}})
    report = CacheStore(cache_url, "ck").check("none", params=make_sample(1))
    assert [(p.shard_id, p.kind) for p in report.damaged] == [(odd.shard_id, "params")]
    assert (
        "['latents']" in report.damaged[0].problem and "'prompt_emb'" in report.damaged[0].problem
    )


def test_tensors_unlike_their_index_entry_are_never_returned(cache_url):
    store = CacheStore(cache_url, "ck")
    info = store.write_shard(make_samples([1]))
    path = f"{store.root}/index/{info.shard_id}.json"
    entry = json.loads(store.fs.cat_file(path))
    entry["specs"][entry["samples"][key_of(1)]]["latents"]["shape"] = [4, 1, 2, 2]  # sha still ok
    store.fs.pipe_file(path, json.dumps(entry).encode())
    reader = CacheStore(cache_url, "ck")
    with pytest.raises(CacheCorruptError, match=r"disagrees with its index.*says bfloat16 \[4, 1"):
        reader.read_samples([key_of(1)])
    report = CacheStore(cache_url, "ck").verify()
    assert [p.kind for p in report.damaged] == ["content"]


@pytest.mark.parametrize(
    "garbage",
    [
        b"[]",
        b'{"format": 1, "shard": "shards/x.safetensors", "bytes": 1, "sha256": "a", "samples": {}}',
        b'{"format": true, "shard": 1}',
    ],
)
def test_index_entries_that_are_json_but_not_entries_are_damaged(cache_url, garbage):
    store = CacheStore(cache_url, "ck")
    info = store.write_shard(make_samples([1]))
    store.fs.pipe_file(f"{store.root}/index/{info.shard_id}.json", garbage)
    report = CacheStore(cache_url, "ck").check("none")
    assert [p.kind for p in report.damaged] == ["index"]
    assert report.samples == 0


def test_bad_param_specs_in_an_index_entry_are_damage(cache_url):
    store = CacheStore(cache_url, "ck")
    info = store.write_shard(make_samples([1]))
    path = f"{store.root}/index/{info.shard_id}.json"
    entry = json.loads(store.fs.cat_file(path))
    for bad in ({"dtype": "float32", "shape": [-1]}, "text", {"shape": [1]}, None):
        entry["specs"][entry["samples"][key_of(1)]]["latents"] = bad
        store.fs.pipe_file(path, json.dumps(entry).encode())
        with pytest.raises(CacheCorruptError, match="bad entry for sample"):
            CacheStore(cache_url, "ck").committed_keys()


def test_verify_compares_with_the_manifest(cache_url):
    store = CacheStore(cache_url, "ck")
    store.write_shard(make_samples([1, 2]))
    store.write_manifest({"samples": [key_of(i) for i in (1, 2, 3)]})
    report = CacheStore(cache_url, "ck").verify()
    assert not report.ok and report.missing == [key_of(3)] and report.manifest_samples == 3
    assert any("missing 1 of the 3 samples" in line for line in report.lines())
    assert "INCOMPLETE" in report.lines()[0]
    store.fs.pipe_file(f"{store.root}/manifest.json", b"{]")
    garbled = CacheStore(cache_url, "ck").verify()
    assert [p.kind for p in garbled.damaged] == ["manifest"] and not garbled.ok


def test_require_names_a_cache_that_was_never_written(tmp_path):
    fix = "run `splitstage preprocess job.toml`"
    with pytest.raises(CacheNotFoundError, match=r"holds no samples: the folder cache.url"):
        CacheStore(str(tmp_path / "nowhere"), "ck").require(fix)
    with pytest.raises(
        CacheNotFoundError, match=r"holds no samples: nothing was written.*job.toml"
    ):
        CacheStore(str(tmp_path), "ck").require(fix)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheNotFoundError, match="cache.url"):
        CacheStore(str(tmp_path / "file"), "ck").require(fix)
    store = CacheStore(str(tmp_path), "ck")
    store.write_shard(make_samples([1]))
    store.require(fix)
    memory = CacheStore(f"memory://splitstage-tests/{uuid.uuid4().hex}", "ck")
    with pytest.raises(CacheNotFoundError, match="nothing was written"):
        memory.require(fix)


# ---- storage helpers ---------------------------------------------------------------------------
def test_open_fs_forms(tmp_path):
    fs, root = open_fs(str(tmp_path / "a"))
    assert root == str(tmp_path / "a")
    fs2, root2 = open_fs(f"file://{tmp_path}/a")
    assert root2 == root and type(fs2) is type(fs)
    _, mroot = open_fs("memory://bucket/x/")
    assert mroot.endswith("bucket/x")
    with pytest.raises(ValueError, match="non-empty"):
        open_fs("")


def test_write_atomic_local_replaces_whole_file(tmp_path):
    fs, root = open_fs(str(tmp_path))
    path = f"{root}/deep/dir/file.bin"
    write_atomic(fs, path, b"old")
    write_atomic(fs, path, b"new-content")
    assert Path(path).read_bytes() == b"new-content"
    assert os.listdir(Path(path).parent) == ["file.bin"]


def test_translate_error_messages_never_show_secrets(monkeypatch):
    from botocore.exceptions import ClientError

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-s3cr3t")

    def client_error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m env-s3cr3t"}}, "PutObject")

    cases = {
        "NoSuchBucket": "bucket 'bkt' does not exist",
        "InvalidAccessKeyId": "rejected the credentials",
        "SignatureDoesNotMatch": "rejected the credentials",
        "AccessDenied": "access denied",
    }
    for code, sentence in cases.items():
        try:
            raise PermissionError("wrapped") from client_error(code)
        except PermissionError as exc:
            err = translate_error(exc, "s3://bkt/p", "write", {"secret": "opt-s3cr3t"})
        assert isinstance(err, StorageError) and sentence in str(err), code
        assert "s3://bkt/p" in str(err) and "s3cr3t" not in str(err)
    plain = FileNotFoundError("bkt/p/missing")
    assert translate_error(plain, "s3://bkt/p", "read") is plain
    denied = translate_error(PermissionError("Forbidden env-s3cr3t"), "s3://bkt/p", "read")
    assert isinstance(denied, StorageError) and "s3cr3t" not in str(denied)


@pytest.mark.parametrize(
    ("url", "package"),
    [
        ("gs://bkt/p", "gcsfs"),
        ("gcs://bkt/p", "gcsfs"),
        ("az://ctr/p", "adlfs"),
        ("abfs://ctr/p", "adlfs"),
    ],
)
def test_open_fs_names_the_missing_filesystem_package(url, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(StorageError) as err:
        open_fs(url, field="cache.url")
    message = str(err.value)
    assert f"`pip install {package}`" in message and "s3fs" not in message
    assert url in message and "\n" not in message


# ---- CacheDataset ------------------------------------------------------------------------------
@pytest.fixture
def dataset_store(tmp_path) -> CacheStore:
    """A local cache of 23 samples in shards of 4."""
    store = CacheStore(str(tmp_path / "cache"), "ck")
    store.write_shards([make_samples(range(i, min(i + 4, 23))) for i in range(0, 23, 4)])
    return store


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_rank_parts_disjoint_equal_and_covering(dataset_store, world_size):
    ds = CacheDataset(dataset_store)
    parts = [ds.epoch_order(3, 7, r, world_size) for r in range(world_size)]
    assert len({len(p) for p in parts}) == 1
    flat = [k for p in parts for k in p]
    assert len(flat) == len(set(flat)) == 23 - 23 % world_size
    seen = set()
    for epoch in range(12):  # the dropped tail changes with the epoch
        seen |= {k for r in range(world_size) for k in ds.epoch_order(epoch, 7, r, world_size)}
    assert seen == set(ds.keys)


def test_seeded_order_is_stable_and_varies(dataset_store):
    keys = sorted(dataset_store.committed_keys())
    a = CacheDataset(dataset_store, keys)
    b = CacheDataset(dataset_store, list(reversed(keys)))
    assert a.epoch_order(1, 42, 0, 2) == b.epoch_order(1, 42, 0, 2)
    assert a.epoch_order(1, 42, 0, 1) != a.epoch_order(2, 42, 0, 1)
    assert a.epoch_order(1, 42, 0, 1) != a.epoch_order(1, 43, 0, 1)
    assert epoch_order(list(reversed(keys)), 1, 42, 1, 2) == a.epoch_order(1, 42, 1, 2)
    with pytest.raises(ValueError, match="rank"):
        a.epoch_order(0, 0, 2, 2)
    with pytest.raises(SampleNotCachedError, match="not in cache"):
        CacheDataset(dataset_store, [*keys, "ffffffff"])


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_iterate_batches_match_cache_and_start_batch_skips(dataset_store, prefetch):
    ds = CacheDataset(dataset_store)
    full = list(ds.iterate(2, 5, 1, 2, batch_size=3, prefetch=prefetch, with_keys=True))
    assert [k for keys, _ in full for k in keys] == ds.epoch_order(2, 5, 1, 2)
    assert [len(keys) for keys, _ in full] == [3, 3, 3, 2]
    keys, batch = full[0]
    want = [make_sample(int(k[:8], 16)) for k in keys]
    assert batch["prompt_emb"].shape == (3, 1, 4, 8)
    assert torch.equal(batch["prompt_emb"], torch.stack([w["prompt_emb"] for w in want]))
    assert batch["prompt"] == [w["prompt"] for w in want] and batch["height"] == [64] * 3
    resumed = list(ds.iterate(2, 5, 1, 2, batch_size=3, prefetch=prefetch, start_batch=2))
    assert len(resumed) == 2
    for (_, a), b in zip(full[2:], resumed):
        assert torch.equal(a["latents"], b["latents"]) and a["prompt"] == b["prompt"]
    assert ds.stall_seconds >= 0.0 and ds.batches_yielded == 2
    with pytest.raises(ValueError, match="start_batch=9"):
        ds.iterate(2, 5, 1, 2, batch_size=3, start_batch=9)


def test_cat_collate_and_drop_last(dataset_store):
    ds = CacheDataset(dataset_store, collate="cat")
    batches = list(ds.iterate(0, 0, 0, 1, batch_size=5, drop_last=True))
    assert len(batches) == 4 and batches[0]["prompt_emb"].shape == (5, 4, 8)


def test_each_shard_fetched_once_per_group_and_cached(dataset_store, monkeypatch):
    ds = CacheDataset(dataset_store)
    fetched: list[str] = []
    real = dataset_store.read_shards

    def spy(ids):
        ids = list(ids)
        fetched.extend(ids)
        return real(ids)

    monkeypatch.setattr(dataset_store, "read_shards", spy)
    list(ds.iterate(0, 1, 0, 1, batch_size=4, prefetch=2))
    assert sorted(fetched) == sorted(set(fetched)) and len(fetched) == 6
    list(ds.iterate(1, 1, 0, 1, batch_size=4, prefetch=2))
    assert len(fetched) == 6  # second epoch served from the shard LRU
    nocache = CacheDataset(dataset_store, shard_cache_bytes=0)
    fetched.clear()
    list(nocache.iterate(0, 1, 0, 1, batch_size=4, prefetch=2, group_batches=6))
    assert len(fetched) == 6  # one group covers the whole epoch: each shard once


def test_prefetch_errors_reach_the_consumer(dataset_store):
    ds = CacheDataset(dataset_store, shard_cache_bytes=0)
    first_keys = ds.batches(0, 9, 0, 1, batch_size=4)[2]
    shard = dataset_store.shard_of(first_keys[:1])[first_keys[0]]
    dataset_store.fs.pipe_file(f"{dataset_store.root}/shards/{shard}.safetensors", b"garbage")
    got = []
    with pytest.raises(CacheCorruptError, match=shard):
        for batch in ds.iterate(0, 9, 0, 1, batch_size=4, prefetch=1, group_batches=1):
            got.append(batch)
    assert len(got) == 2
    assert not [t for t in threading.enumerate() if t.name == "splitstage-prefetch"]


def test_prefetch_thread_stops_when_consumer_stops(dataset_store):
    ds = CacheDataset(dataset_store)
    it = ds.iterate(0, 0, 0, 1, batch_size=1, prefetch=2, group_batches=1)
    next(it)
    thread = ds._thread
    assert thread.is_alive()
    it.close()
    assert not thread.is_alive()
