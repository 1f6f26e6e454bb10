"""fsspec helpers for the cache and checkpoints: open a URL, write atomically, batch I/O, and
turn object-store failures into `StorageError`s that name the URL and what to check.

Credentials come from `storage_options` (`key`/`secret`/`token`, or the boto names) or from the
standard AWS environment variables; they are never put into messages or reprs (see `redact`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import fsspec
from fsspec.core import split_protocol
from fsspec.implementations.local import LocalFileSystem

from splitstage.splitter import UserError

MASK = "***"
_SECRET_NAMES = {
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "access_key",
    "secret_key",
    "session_token",
    "credentials",
}
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_S3_ALIASES = {
    "aws_access_key_id": "key",
    "aws_secret_access_key": "secret",
    "aws_session_token": "token",
}
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


class StorageBucketNotFoundError(StorageError):
    """The bucket named in the URL does not exist on the endpoint."""


class StoragePermissionError(StorageError):
    """The credentials are valid but may not read or write this bucket or prefix."""


class StorageUnreachableError(StorageError):
    """The storage endpoint could not be reached (wrong endpoint URL, server down, no network)."""


def redact(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a copy of `options` with credentials masked, safe to log or show in a repr."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if str(name).lower() in _SECRET_NAMES and value is not None:
            out[name] = MASK
        elif isinstance(value, Mapping):
            out[name] = redact(value)
        else:
            out[name] = value
    return out


def _s3_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise S3 options: boto names to s3fs names, endpoint from options or AWS_ENDPOINT_URL."""
    opts = {_S3_ALIASES.get(k, k): v for k, v in options.items()}
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    endpoint = opts.pop("endpoint_url", None) or client_kwargs.get("endpoint_url")
    endpoint = (
        endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    return opts


def open_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """Return `(fs, root_path)` for a local path, `file://`, `memory://` or `s3://bucket/prefix`."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"storage URL must be a non-empty string, got {url!r}")
    protocol = split_protocol(url)[0] or "file"
    opts = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        opts = _s3_options(opts)
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except ImportError as exc:
        raise StorageError(
            f"cannot open {url}: the filesystem for '{protocol}://' is not installed ({exc.name}); "
            f"install it (for s3:// that is `pip install s3fs`)."
        ) from None
    except TypeError as exc:
        raise StorageError(
            f"cannot open {url}: unknown storage option in {sorted(redact(opts))} "
            f"({_scrub(str(exc), opts)}); fix storage_options."
        ) from None
    return fs, root.rstrip("/") or root


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


def write_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write `data` so readers see the old object or the whole new one, never a partial file.

    Local: a temp file in the same directory, fsync, then rename. Object stores and memory: one put,
    which is atomic there.
    """
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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
            await fs._pipe_file(path, data)

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


def error_code(exc: BaseException) -> str | None:
    """Return the S3 error code (e.g. 'NoSuchBucket') behind `exc`, following its cause chain."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, Mapping):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
        cur = cur.__cause__ or cur.__context__
    return None


def _type_names(exc: BaseException) -> set[str]:
    """Names of the classes of `exc` and the exceptions it was raised from."""
    names: set[str] = set()
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        names.update(cls.__name__ for cls in type(cur).__mro__)
        cur = cur.__cause__ or cur.__context__
    return names


def _scrub(text: str, options: Mapping[str, Any] | None = None) -> str:
    """Remove any credential value (from options or the AWS env vars) from `text`."""
    secrets = [os.environ.get(name) for name in _SECRET_ENV]
    stack = [options or {}]
    while stack:
        for name, value in stack.pop().items():
            if isinstance(value, Mapping):
                stack.append(value)
            elif str(name).lower() in _SECRET_NAMES and isinstance(value, str):
                secrets.append(value)
    for secret in sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _bucket(url: str) -> str:
    """The bucket name of an s3-style URL (for messages)."""
    rest = split_protocol(url)[1]
    return rest.lstrip("/").split("/", 1)[0]


def translate_error(
    exc: BaseException, url: str, action: str, options: Mapping[str, Any] | None = None
) -> BaseException:
    """Map a storage exception to a `StorageError` with one clear sentence; others pass through."""
    code = error_code(exc)
    names = _type_names(exc)
    where = f"cannot {action} {url}"
    if code == "NoSuchBucket":
        return StorageBucketNotFoundError(
            f"{where}: bucket '{_bucket(url)}' does not exist; create it or fix the bucket name "
            f"in the URL. (NoSuchBucket)"
        )
    if code in _CREDENTIAL_CODES:
        return StorageCredentialsError(
            f"{where}: the endpoint rejected the credentials; check the key and secret in "
            f"storage_options or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. ({code})"
        )
    if code in _DENIED_CODES:
        return StoragePermissionError(
            f"{where}: access denied; the credentials are valid but lack permission on this "
            f"bucket or prefix: grant read, write and list on it. ({code})"
        )
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return StorageCredentialsError(
            f"{where}: no credentials found; set key and secret in storage_options or "
            f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."
        )
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"}:
        return StorageUnreachableError(
            f"{where}: cannot reach the storage endpoint; check the endpoint URL "
            f"(storage_options client_kwargs.endpoint_url or AWS_ENDPOINT_URL) and that the "
            f"server is running."
        )
    if isinstance(exc, PermissionError) and not isinstance(exc, StorageError):
        return StoragePermissionError(
            f"{where}: access refused (403); check the credentials and that they may access "
            f"this bucket or prefix. ({_scrub(str(exc), options)})"
        )
    return exc


@contextlib.contextmanager
def storage_errors(
    url: str, action: str, options: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """Context manager: re-raise known storage failures as `StorageError`s naming `url`."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        mapped = translate_error(exc, url, action, options)
        if mapped is exc:
            raise
        raise mapped from None


def raise_if_storage_error(
    exc: BaseException, url: str, action: str, options: Mapping[str, Any] | None = None
) -> None:
    """Raise `exc` as a `StorageError` when it is a known storage failure; otherwise return."""
    mapped = translate_error(exc, url, action, options)
    if mapped is not exc or isinstance(exc, StorageError):
        raise mapped from None
