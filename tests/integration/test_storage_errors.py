"""Storage failures against real systems: a moto S3 server, real mounts, real permissions.

- `s3://bucket//prefix` lands where listings find it; bad endpoints fail at once with one line;
- a missing bucket is refused and never created (buckets listed before and after);
- a full disk (a 64 KiB tmpfs), a read-only filesystem (a tmpfs remounted read-only) and a folder
  the user may not write (chmod 555 for a non-root user; as root, where chmod does not stop writes:
  `chattr +i`, and a child without CAP_DAC_OVERRIDE) give one-line `StorageError`s naming the
  URL, and no half-written file stays visible. Each mechanism is skipped, with the reason, where
  this machine does not allow it (mount needs CAP_SYS_ADMIN); none is simulated.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from splitstage.storage.files import (
    StorageBucketNotFoundError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    StorageReadOnlyError,
    StorageUnreachableError,
    ensure_folder,
    open_fs,
    translate_error,
    write_atomic,
    write_chains,
)
from splitstage.storage.urls import InvalidURLError
from splitstage.tasks.cache.store import CacheStore
from tests.helpers.cache_samples import key_of, make_samples

pytestmark = pytest.mark.slow


def buckets(options: dict) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    return sorted(fs.ls(""))


def one_line(err: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ---- URL normal form on a real endpoint ---------------------------------------------------------
def test_double_slashes_land_where_listings_find_them(s3_bucket):
    _, options = s3_bucket
    written = CacheStore("s3://bucket//prefix//", "ck", options)
    written.write_shard(make_samples([1, 2]))
    found = CacheStore("s3://bucket/prefix", "ck", options)
    assert found.committed_keys() == written.committed_keys() and len(found.committed_keys()) == 2
    fs, _ = open_fs("s3://bucket/prefix", options)
    keys = fs.find("bucket")
    assert keys and all("//" not in k and k.startswith("bucket/prefix/ck/") for k in keys)


def test_spaces_and_unicode_keep_working(s3_bucket, tmp_path, monkeypatch):
    _, options = s3_bucket
    url = "s3://bucket/my cache/ünïcödé 日本"
    store = CacheStore(url, "ck", options)
    store.write_shard(make_samples([3]))
    assert len(CacheStore(url + "/", "ck", options).committed_keys()) == 1
    monkeypatch.setenv("HOME", str(tmp_path))  # `~` is expanded by the machine doing the I/O
    local = CacheStore("~/my cache//ünï/", "ck")
    local.write_shard(make_samples([4]))
    assert (tmp_path / "my cache" / "ünï" / "ck" / "index").is_dir()
    assert CacheStore(f"file://{tmp_path}/my cache/ünï", "ck").committed_keys() == {
        *local.committed_keys()
    }


def test_dot_segments_and_empty_bucket_are_refused_before_any_request(s3_bucket):
    _, options = s3_bucket
    for url, needle in [
        ("s3://bucket/../x", "'..' segment"),
        ("s3://bucket/a/./b", "'.' segment"),
        ("s3:///prefix", "needs a bucket"),
    ]:
        with pytest.raises(InvalidURLError) as err:
            CacheStore(url, "ck", options)
        one_line(err, needle)
    assert buckets(options) == ["bucket"]


# ---- never create a bucket ----------------------------------------------------------------------
def test_missing_output_bucket_is_refused_and_not_created(s3_bucket):
    _, options = s3_bucket
    before = buckets(options)
    fs, root = open_fs("s3://typo-bucket/out/run1", options)
    with pytest.raises(StorageBucketNotFoundError) as err:
        ensure_folder(fs, root, "s3://typo-bucket/out/run1", options, field="output.url")
    one_line(err, "bucket 'typo-bucket' does not exist", "never creates", "output.url")
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(StorageBucketNotFoundError) as err:  # the writes of flows/ refuse it too
        write_atomic(fs, f"{root}/report.json", b"{}")
    one_line(err, "s3://typo-bucket/out/run1/report.json", "does not exist")
    assert buckets(options) == before == ["bucket"]
    # what ensure_folder replaces: s3fs's makedirs creates the mistyped bucket
    fs.makedirs("other-typo/out", exist_ok=True)
    assert buckets(options) == ["bucket", "other-typo"]


def test_missing_checkpoint_bucket_is_refused_and_not_created(s3_bucket):
    import torch

    from splitstage.tasks.stage2.checkpoint import save_checkpoint

    _, options = s3_bucket
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StorageBucketNotFoundError) as err:
        save_checkpoint(
            "s3://no-ckpt-bucket/ckpt", 1, model, None, storage_options=options, save_rng=False
        )
    one_line(err, "no-ckpt-bucket", "train.checkpoint_url")
    assert buckets(options) == ["bucket"]


def test_existing_bucket_passes_and_nothing_is_created(s3_bucket, tmp_path):
    url, options = s3_bucket
    fs, root = open_fs(url + "/out", options)
    ensure_folder(fs, root, url + "/out", options, field="output.url")
    assert buckets(options) == ["bucket"] and fs.find("bucket") == []
    local_fs, local_root = open_fs(str(tmp_path / "a" / "b"))
    ensure_folder(local_fs, local_root)
    assert (tmp_path / "a" / "b").is_dir()
    memory_fs, memory_root = open_fs("memory://ensure-folder-test/x")
    ensure_folder(memory_fs, memory_root)
    assert memory_fs.isdir(memory_root)


# ---- endpoints ----------------------------------------------------------------------------------
def test_bad_endpoints_fail_at_once_naming_the_option(s3_bucket, s3_endpoint, monkeypatch):
    _, options = s3_bucket
    host_port = s3_endpoint.split("://", 1)[1]
    creds = {"key": options["key"], "secret": options["secret"]}
    cases = [
        ({"endpoint_url": host_port}, "storage_options.endpoint_url", "no http://"),
        ({"endpoint_url": f"htp://{host_port}"}, "storage_options.endpoint_url", "'htp://'"),
        (
            {"client_kwargs": {"endpoint_url": f"{s3_endpoint}/bucket"}},
            "storage_options.client_kwargs.endpoint_url",
            "has a path",
        ),
        ({"endpoint_url": "http://127.0.0.1:99999"}, "storage_options.endpoint_url", "port"),
    ]
    for extra, source, needle in cases:
        with pytest.raises(InvalidURLError) as err:
            open_fs("s3://bucket/prefix", {**creds, **extra})
        one_line(err, source, needle, "e.g. http")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"{s3_endpoint}/x/y")
    with pytest.raises(InvalidURLError) as err:
        open_fs("s3://bucket/prefix", creds)
    one_line(err, "AWS_ENDPOINT_URL_S3", "has a path")
    assert (
        buckets(options) == ["bucket"] and open_fs("s3://bucket", options)[0].find("bucket") == []
    )


def test_unreachable_endpoint_is_one_line(s3_bucket):
    import socket

    _, options = s3_bucket
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    opts = {
        "key": options["key"],
        "secret": options["secret"],
        "endpoint_url": f"http://127.0.0.1:{port}",
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    fs, root = open_fs("s3://bucket/out", opts)
    with pytest.raises(StorageUnreachableError) as err:
        ensure_folder(fs, root, "s3://bucket/out", opts, field="output.url")
    one_line(err, "s3://bucket/out", "cannot reach")


# ---- full, read-only and forbidden disks (real mounts and permissions) -------------------------
def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")


@pytest.fixture
def tmpfs(tmp_path):
    """Mount small tmpfs folders under tmp_path (skip where mount is not allowed); unmount after."""
    mounted: list[Path] = []

    def make(name: str, size: str = "64k") -> Path:
        where = tmp_path / name
        _mount_tmpfs(where, size)
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_disk_names_the_path_and_leaves_nothing_half_written(tmpfs):
    disk = tmpfs("full", "64k")
    fs, root = open_fs(str(disk))
    with pytest.raises(StorageFullError) as err:
        write_atomic(fs, f"{root}/big.bin", os.urandom(256 * 1024))
    one_line(err, f"{disk}/big.bin", "no space left on device", "free space", "ENOSPC")
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, StorageError)
    assert os.listdir(disk) == []  # the temp file is gone too
    store = CacheStore(str(disk / "cache"), "ck")
    import torch

    samples = {key_of(i): {"x": torch.rand(10 * 1024)} for i in range(3)}  # 120 KiB
    with pytest.raises(StorageFullError) as err:
        store.write_shard(samples)
    one_line(err, str(disk / "cache" / "ck"), "no space left on device")
    assert store.committed_keys() == set()
    leftovers = [p for p in (disk / "cache").rglob("*") if p.is_file()]
    assert leftovers == [], leftovers


def test_full_disk_during_a_checkpoint_is_one_line(tmpfs):
    import torch

    from splitstage.tasks.stage2.checkpoint import latest_checkpoint, save_checkpoint

    disk = tmpfs("ckpt", "64k")
    model = torch.nn.Linear(256, 256)  # 257 KiB of weights: more than the disk holds
    with pytest.raises(StorageFullError) as err:
        save_checkpoint(str(disk / "ckpt"), 1, model, None, save_rng=False)
    one_line(err, str(disk / "ckpt"), "no space left on device")
    assert latest_checkpoint(str(disk / "ckpt")) is None  # no COMPLETE marker: never visible


def test_read_only_filesystem(tmpfs):
    disk = tmpfs("ro", "1m")
    store = CacheStore(str(disk / "cache"), "ck")
    store.write_shard(make_samples([5]))
    done = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only here ({done.stderr.strip()})")
    keys = CacheStore(str(disk / "cache"), "ck").committed_keys()
    assert len(keys) == 1 and store.read_samples(sorted(keys))  # reading still works
    fs, root = open_fs(str(disk))
    for action in (
        lambda: write_atomic(fs, f"{root}/cache/x.json", b"{}"),
        lambda: ensure_folder(fs, f"{root}/new/folder", field="output.url"),
        lambda: store.write_shard(make_samples([6])),
    ):
        with pytest.raises(StorageReadOnlyError) as err:
            action()
        one_line(err, str(disk), "read-only file system", "EROFS")
        assert err.value.errno == errno.EROFS


def test_no_permission_non_root_chmod(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores chmod; see the chattr and CAP_DAC_OVERRIDE tests")
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        fs, root = open_fs(str(folder))
        with pytest.raises(StoragePermissionError) as err:
            write_atomic(fs, f"{root}/x.bin", b"x")
        one_line(err, f"{folder}/x.bin", "permission denied", "EACCES")
    finally:
        folder.chmod(0o755)


def test_no_permission_as_root_immutable_folder(tmp_path):
    """Root ignores chmod, but not the immutable attribute: EPERM from the kernel."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here")
    folder = tmp_path / "immutable"
    folder.mkdir()
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i not supported on this filesystem ({done.stderr.strip()})")
    try:
        fs, root = open_fs(str(folder))
        with pytest.raises(StoragePermissionError) as err:
            write_atomic(fs, f"{root}/x.bin", b"x")
        one_line(err, f"{folder}/x.bin", "permission denied", "EPERM", "chattr -i")
        with pytest.raises(StoragePermissionError):
            ensure_folder(fs, f"{root}/sub")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    assert os.listdir(folder) == []


def test_no_permission_as_root_without_dac_override(tmp_path):
    """Root without CAP_DAC_OVERRIDE meets a real chmod 555 folder: EACCES from the kernel."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("needs root on Linux (the chmod test covers non-root users)")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    code = textwrap.dedent(
        f"""
        from splitstage.storage.files import StoragePermissionError, open_fs, write_atomic
        fs, root = open_fs({str(locked)!r})
        try:
            write_atomic(fs, root + "/x.bin", b"x")
        except StoragePermissionError as err:
            print("MAPPED", err)
        """
    )
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    drop = "-dac_override,-dac_read_search"  # from the bounding set: the exec'd root obeys modes
    done = subprocess.run(
        [setpriv, "--bounding-set", drop, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0 and "setpriv" in done.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here ({done.stderr.strip()})")
    try:
        assert done.stdout.startswith("MAPPED"), (done.stdout, done.stderr)
        assert "permission denied" in done.stdout and "EACCES" in done.stdout
        assert f"{locked}/x.bin" in done.stdout and os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


def test_real_enospc_from_dev_full_is_translated():
    """/dev/full answers every write with ENOSPC: the kernel's own error, on any Linux."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(OSError) as raised, open("/dev/full", "wb", buffering=0) as fh:
        fh.write(b"x")
    mapped = translate_error(raised.value, "/data/cache/ck", "write shards under")
    assert isinstance(mapped, StorageFullError) and mapped.errno == errno.ENOSPC
    assert str(mapped).startswith("cannot write shards under /data/cache/ck: no space left")


def test_write_chains_on_s3_names_the_failed_object(s3_bucket):
    url, options = s3_bucket
    fs, root = open_fs(url, options)
    with pytest.raises(StorageBucketNotFoundError) as err:
        write_chains(fs, [[("gone-bucket/shard", b"s"), (f"{root}/after", b"i")]])
    one_line(err, "s3://gone-bucket/shard", "bucket 'gone-bucket' does not exist")
    assert not fs.exists(f"{root}/after") and buckets(options) == ["bucket"]
