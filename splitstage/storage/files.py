"""fsspec helpers for the cache and checkpoints: open a URL, write atomically, batch I/O, and
turn storage failures (object-store errors; full, read-only or forbidden disks) into
`StorageError`s that name the URL and what to check. Buckets are never created (`ensure_folder`).

Credentials come from `storage_options` (`key`/`secret`/`token`, or the boto names) or from the
standard AWS environment variables; never put into messages or reprs (`urls.redact`, `urls.scrub`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from stat import S_ISDIR, S_ISREG
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from splitstage.splitter import UserError
from splitstage.storage import urls
from splitstage.storage.options import open_url, s3_options, with_credentials
from splitstage.storage.urls import redact, scrub

_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
}
_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "AccountProblem"}


class StorageError(UserError, OSError):
    """An object-storage operation failed; the message names the URL and the one thing to check."""


class StorageCredentialsError(StorageError):
    """The endpoint rejected the credentials (unknown key id, wrong secret, expired token)."""


class StorageBucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket named in the URL does not exist on the endpoint (never created for you)."""


class StoragePermissionError(StorageError):
    """The credentials are valid but may not read or write this bucket or prefix."""


class StorageUnreachableError(StorageError):
    """The storage endpoint could not be reached (wrong endpoint URL, server down, no network)."""


class StorageFullError(StorageError):
    """No space left on the device, the disk quota used up, or a file over the size the file
    system or the process allows (ENOSPC, EDQUOT, EFBIG)."""


class StorageReadOnlyError(StorageError):
    """The filesystem is mounted read-only (EROFS)."""


URL_FIELDS = {"cache": "cache.url", "data": "data.base_path", "output": "output.url"}
_FIX = "or point the URL at another folder"
_LOCAL_ERRNOS = {  # errno -> (error class, what happened, the fix)
    errno.ENOSPC: (StorageFullError, "no space left on device", f"free space there {_FIX}"),
    errno.EDQUOT: (StorageFullError, "disk quota exceeded", f"free space, raise the quota {_FIX}"),
    errno.EROFS: (StorageReadOnlyError, "read-only file system", f"remount it read-write {_FIX}"),
    errno.EFBIG: (
        StorageFullError,
        "file too large for this file system or for this process's file size limit (ulimit -f)",
        f"raise the limit {_FIX}",
    ),
    errno.EACCES: (StoragePermissionError, "permission denied", f"make it writable {_FIX}"),
    errno.EPERM: (StoragePermissionError, "permission denied (EPERM)", f"chattr -i it {_FIX}"),
    errno.ENOTDIR: (StorageError, "a file stands where a folder goes", f"move it {_FIX}"),
    errno.EEXIST: (StorageError, "a file stands where a folder goes", f"move it {_FIX}"),
}


_s3_options = s3_options  # one definition, shared with the data sets


def open_fs(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    field: str | None = None,
    credentials_block: str | None = None,
) -> tuple[Any, str]:
    """Return `(fs, root_path)` for a local path, `file://`, `memory://` or `s3://bucket/prefix`.

    The URL is normalised first (`storage.urls.normalize_url`, without the bucket-naming rules:
    `s3://b//p/` opens `b/p`; `..` in object keys is refused); `~` is expanded on this machine.
    Bad forms raise `storage.urls.InvalidURLError` (a ValueError) naming `field` when given.
    `credentials_block` names a Prefect block whose credentials are added (object stores only).
    """
    opts = dict(storage_options or {})
    if credentials_block:
        opts = with_credentials(url, opts, credentials_block, field=field or "credentials_block")
    protocol = urls.scheme_of(url.strip()) if isinstance(url, str) else "file"
    try:
        return open_url(url, opts, field=field)
    except ImportError as exc:
        package = urls.FILESYSTEM_PACKAGES.get(protocol, exc.name or "its fsspec filesystem")
        raise StorageError(
            f"cannot open {url}: the filesystem for '{protocol}://' is not installed; "
            f"`pip install {package}`."
        ) from None
    except TypeError as exc:
        raise StorageError(
            f"cannot open {url}: unknown storage option in {sorted(redact(opts))} "
            f"({scrub(str(exc), opts)}); fix storage_options."
        ) from None


def is_local(fs: Any) -> bool:
    """True for the local filesystem, where atomic writes need a temp file and a rename."""
    return isinstance(fs, LocalFileSystem)


def join(root: str, *parts: str) -> str:
    """Join a root path and relative parts with '/' (fsspec paths are '/'-separated everywhere)."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def display_url(fs: Any, path: str) -> str:
    """Return `path` as a URL with its protocol (no credentials), for messages."""
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if protocol == "file":
        return path
    if protocol == "memory":
        return f"memory://{path.lstrip('/')}"
    return f"{protocol}://{path}"


def ensure_folder(
    fs: Any,
    path: str,
    url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    field: str | None = None,
    options_field: str = "storage_options",
) -> None:
    """Make `path` a folder where folders exist (local disk, memory://); on object stores only
    check that the bucket exists, creating nothing: a mistyped bucket is refused (naming `field`,
    the config field to fix), never made. Full, read-only or forbidden disks raise StorageErrors
    (missing credentials name `options_field`, the storage options to set).
    """
    url, options = url or display_url(fs, path), storage_options or fs.storage_options
    if is_local(fs) or "memory" in fs.protocol:
        with storage_errors(url, "create folder", options, field=options_field):
            fs.makedirs(path, exist_ok=True)
        return
    bucket = path.strip("/").split("/", 1)[0]
    with storage_errors(url, "check the bucket of", options, field=options_field):
        if hasattr(fs, "call_s3"):  # HEAD bucket: one request, whatever the bucket holds
            try:
                fs.call_s3("head_bucket", Bucket=bucket)
                found = True
            except FileNotFoundError:
                found = False
            except PermissionError:  # may write but not list the bucket: the writes will tell
                found = True
        else:
            found = fs.exists(bucket)
    if not found:
        raise StorageBucketNotFoundError(
            f"cannot write {url}: bucket '{bucket}' does not exist, and splitstage never creates "
            f"buckets; create it (e.g. `aws s3 mb s3://{bucket}`) or fix the bucket name in "
            f"{field or 'the URL'}. (NoSuchBucket)"
        )


def write_atomic(
    fs: Any, path: str, data: bytes, url: str | None = None, *, field: str = "storage_options"
) -> None:
    """Write `data` so readers see the old object or the whole new one, never a partial file.

    Local: a temp file in the same directory, fsync, then rename; on any failure (disk full,
    read-only, no permission) the temp file is removed. Object stores and memory: one put, which is
    atomic there. Known failures raise `StorageError`s naming `url` (default: the path's URL).
    """
    url = url or display_url(fs, path)
    options = getattr(fs, "storage_options", None)
    if not is_local(fs):
        try:
            fs.pipe_file(path, data)
        except Exception as exc:
            raise_if_storage_error(exc, url, "write", options, field=field)
            raise
        return
    tmp = temp_path(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, Exception):
            raise_if_storage_error(exc, url, "write", options, field=field)
        raise


TEMP_MARK = ".tmp-"  # a local write's temporary file: <path>.tmp-<pid>-<12 hex>[-<host>]
_TEMP = re.compile(r"\.tmp-(\d+)-[0-9a-f]{12}(?:-([0-9a-f]{8}))?$")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
STALE_TEMP_SECONDS = 24 * 3600  # another machine's temporary file this old is abandoned


def temp_path(path: str) -> str:
    """The temporary file a local atomic write goes through: it names this process and host,
    so a clean-up (`sweep_temp_files`) can tell an abandoned one from one still being written."""
    return f"{path}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}-{_HOST}"


def _writer_gone(name: str, mtime: float) -> bool:
    """Whether the temporary file `name` was left by a writer that no longer runs: its process
    is gone from this host, or (another host's) it is over STALE_TEMP_SECONDS old."""
    found = _TEMP.search(name)
    if found is None:
        return False
    pid, host = int(found.group(1)), found.group(2)
    if host in (None, _HOST):  # older names carry no host: written here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's live process
            return False
        return False
    return time.time() - mtime > STALE_TEMP_SECONDS


def sweep_temp_files(fs: Any, root: str) -> tuple[int, int]:
    """Delete the temporary files of local atomic writes under `root` whose writer is gone (a
    Ctrl-C or a kill mid-write); (files, bytes) reclaimed. Object stores write in one put and
    leave none: (0, 0) there."""
    if not is_local(fs) or not os.path.isdir(root):
        return 0, 0
    files = reclaimed = 0
    for folder, _, names in os.walk(root):
        for name in names:
            if TEMP_MARK not in name:
                continue
            path = os.path.join(folder, name)
            try:
                info = os.stat(path)
                if _writer_gone(name, info.st_mtime):
                    os.remove(path)
                    files, reclaimed = files + 1, reclaimed + info.st_size
            except FileNotFoundError:  # renamed or removed meanwhile
                continue
    return files, reclaimed


def write_chains(
    fs: Any, chains: Iterable[Sequence[tuple[str, bytes]]], max_in_flight: int = 16
) -> None:
    """Write chains of files: in a chain each file starts after the previous one is fully written;
    chains run concurrently with each other and with the caller producing the next chain.

    Used to commit a shard (shard file, then its index entry) while the next shard is encoded.
    On a failure the chain stops (a later file is never written), the others finish, then the
    first error is raised.
    """
    if is_local(fs) or not getattr(fs, "async_impl", False):
        for chain in chains:
            for path, data in chain:
                write_atomic(fs, path, data)
        return

    async def run(chain: Sequence[tuple[str, bytes]]) -> None:
        for path, data in chain:
            try:
                await fs._pipe_file(path, data)
            except Exception as exc:
                raise_if_storage_error(exc, display_url(fs, path), "write", fs.storage_options)
                raise

    futures: list[concurrent.futures.Future] = []
    try:
        for chain in chains:
            futures.append(asyncio.run_coroutine_threadsafe(run(list(chain)), fs.loop))
            pending = [f for f in futures if not f.done()]
            if len(pending) >= max_in_flight:
                concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def read_many(fs: Any, paths: Sequence[str]) -> list[bytes | BaseException]:
    """Read many whole files in one batched call; a failed read comes back as its exception."""
    if not paths:
        return []
    paths = list(paths)
    return fs.cat_ranges(paths, [None] * len(paths), [None] * len(paths), on_error="return")


def local_ls(path: str) -> list[dict[str, Any]]:
    """`fs.ls(path, detail=True)` of a local folder from one `os.scandir` (fsspec's costs ~30 us
    a file in Python: 0.5 s for a million-sample index): name, size, type, mtime, inode."""
    out = []
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                info = entry.stat()  # follows links, as fsspec's info does
            except FileNotFoundError:  # removed meanwhile, or a broken link
                continue
            mode = info.st_mode
            kind = "directory" if S_ISDIR(mode) else "file" if S_ISREG(mode) else "other"
            name = f"{path.rstrip('/')}/{entry.name}"
            out.append(
                {"name": name, "size": info.st_size, "type": kind, "mtime": info.st_mtime}
                | {"ino": info.st_ino}
            )
    return out


def list_dir(fs: Any, path: str) -> list[str]:
    """List files directly under `path`, bypassing fsspec's listing cache; [] if none."""
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError as exc:
        if error_code(exc) is not None:
            raise
        return []
    return sorted(e["name"] for e in entries if e.get("type") != "directory")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, the exceptions it was raised from, and those of a DCP CheckpointException's ranks."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, Mapping):
            todo.extend(f[0] for f in failures.values() if isinstance(f, tuple) and f)
        todo.extend(e for e in (cur.__cause__ or cur.__context__,) if e is not None)


def error_code(exc: BaseException) -> str | None:
    """Return the S3 error code (e.g. 'NoSuchBucket') behind `exc`, following its cause chain."""
    for cur in _chain(exc):
        response = getattr(cur, "response", None)
        if isinstance(response, Mapping) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
    return None


def _type_names(exc: BaseException) -> set[str]:
    """Names of the classes of `exc` and the exceptions it was raised from."""
    return {cls.__name__ for cur in _chain(exc) for cls in type(cur).__mro__}


def _local_errno(exc: BaseException) -> int | None:
    """The errno of a local OS failure (disk full, read-only, ...) behind `exc`, if any."""
    for cur in _chain(exc):
        if isinstance(cur, StorageError):
            return None
        if isinstance(cur, OSError) and cur.errno in _LOCAL_ERRNOS:
            return cur.errno
    return None


def endpoint_of(options: Mapping[str, Any] | None) -> str | None:
    """The S3 endpoint URL the options (or the AWS_ENDPOINT_URL variables) point at; None: AWS's."""
    opts = dict(options or {})
    kwargs = opts.get("client_kwargs") or {}
    found = [
        opts.get("endpoint_url"),
        kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None,
    ]
    found += [os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")]
    return next((str(value) for value in found if value), None)


FULL_BYTES = 1 << 20  # a local disk with less free than this after a failed write is full
_FULL_WORDS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
_WRITES = ("write", "save", "export", "create", "append", "take")


def disk_is_full(exc: BaseException, url: str, action: str) -> bool:
    """Whether a failed write to a local `url` failed for want of space: a message saying so
    (safetensors: 'os error 28'), or the disk left with under FULL_BYTES free. torch's zip
    writer ('[enforce fail at inline_container.cc] unexpected pos') carries no errno at all."""
    if not any(word in action for word in _WRITES):
        return False
    if any(word in str(cur) for cur in _chain(exc) for word in _FULL_WORDS):
        return True
    try:
        path = os.path.abspath(urls.local_path(url))
    except ValueError:
        return False  # an object store: its own errors say so
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or "/").free < FULL_BYTES
    except OSError:
        return False


def translate_error(
    exc: BaseException,
    url: str,
    action: str,
    options: Mapping[str, Any] | None = None,
    *,
    field: str = "storage_options",
) -> BaseException:
    """Map a storage exception to a `StorageError` with one clear sentence naming `field` (the
    config field holding the options, e.g. data.storage_options); others pass through."""
    code = error_code(exc)
    names = _type_names(exc)
    where = f"cannot {action} {url}"
    group = field.rpartition(".")[0]
    block = f" (or a Prefect block in {group}.credentials_block)" if group else ""
    if code == "NoSuchBucket":
        in_url = f"in {URL_FIELDS[group]}" if group in URL_FIELDS else "in the URL"
        return StorageBucketNotFoundError(
            f"{where}: bucket '{urls.bucket_of(url)}' does not exist; create it or fix the "
            f"bucket name {in_url}. (NoSuchBucket)"
        )
    if code in _CREDENTIAL_CODES:
        return StorageCredentialsError(
            f"{where}: the endpoint rejected the credentials; check the key and secret in "
            f"{field}{block} or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. ({code})"
        )
    if code in _DENIED_CODES:
        return StoragePermissionError(
            f"{where}: access denied; the credentials are valid but lack permission on this "
            f"bucket or prefix: grant read, write and list on it. ({code})"
        )
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return StorageCredentialsError(
            f"{where}: no credentials found; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
            f"or key and secret in {field}{block}."
        )
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"}:
        endpoint = endpoint_of(options)
        if endpoint is None:
            return StorageUnreachableError(
                f"{where}: cannot reach AWS's S3 endpoint, the default: no endpoint_url is set "
                f"in {field} (nor AWS_ENDPOINT_URL); for another store (MinIO, the cache's) set "
                f'{field} = {{endpoint_url = "http(s)://host:port"}}.'
            )
        return StorageUnreachableError(
            f"{where}: cannot reach the storage endpoint {endpoint}; check endpoint_url in "
            f"{field} (or AWS_ENDPOINT_URL) and that the server is running."
        )
    local = _local_errno(exc) if code is None else None
    if local is not None:
        cls, what, fix = _LOCAL_ERRNOS[local]
        mapped = cls(f"{where}: {what}; {fix}. ({errno.errorcode[local]})")
        mapped.errno = local
        return mapped
    if local is None and code is None and disk_is_full(exc, url, action):
        full = StorageFullError(
            f"{where}: no space left on device; free space there {_FIX}. (ENOSPC)"
        )
        full.errno = errno.ENOSPC
        return full
    if isinstance(exc, PermissionError) and not isinstance(exc, StorageError):
        return StoragePermissionError(
            f"{where}: access refused (403); check the credentials and that they may access "
            f"this bucket or prefix. ({scrub(str(exc), options)})"
        )
    return exc


@contextlib.contextmanager
def storage_errors(
    url: str,
    action: str,
    options: Mapping[str, Any] | None = None,
    *,
    field: str = "storage_options",
) -> Iterator[None]:
    """Context manager: re-raise known storage failures as `StorageError`s naming `url` (and
    `field`, the config field of the options)."""
    try:
        yield
    except StorageError:
        raise
    except BaseException as exc:  # also DCP's CheckpointException (a BaseException)
        if not isinstance(exc, Exception) and not hasattr(exc, "failures"):
            raise
        mapped = translate_error(exc, url, action, options, field=field)
        if mapped is exc:
            raise
        raise mapped from None


def raise_if_storage_error(
    exc: BaseException,
    url: str,
    action: str,
    options: Mapping[str, Any] | None = None,
    *,
    field: str = "storage_options",
) -> None:
    """Raise `exc` as a `StorageError` when it is a known storage failure; otherwise return."""
    mapped = translate_error(exc, url, action, options, field=field)
    if mapped is not exc or isinstance(exc, StorageError):
        raise mapped from None
