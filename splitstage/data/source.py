"""Where a data set's files live: a local folder or any fsspec URL (s3://, gs://, file://), opened
with the config's storage options and credentials (environment or a Prefect block, as the cache),
listed in one pass and read in batches. A process opens its data set once (`open_data_source`)
and hands that source down to everything that reads a row (no lookup by URL).

A listing maps each file's path relative to the base (as rows name it, '/'-separated) to its
(size, version): the mtime in nanoseconds on disks, the ETag (or generation) on object stores.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from splitstage.data.images import DataError
from splitstage.splitter import UserError
from splitstage.storage import urls
from splitstage.storage.files import translate_error
from splitstage.storage.object_listing import list_concurrently
from splitstage.storage.options import open_url, with_credentials
from splitstage.storage.urls import redact, scrub

READ_BATCH = 256  # objects read in one batched (concurrent) call on object stores
MAX_LISTED_FOLDERS = 4096  # more folders than this: one listing of the whole prefix


class Listing(NamedTuple):
    """Files found by one listing: relative path -> (size, version), and when it started."""

    files: dict[str, tuple[int, Any]]
    started_ns: int  # wall clock (time.time_ns) when the listing began
    by_mtime: bool  # True: versions are mtimes (local disks); False: ETags / generations


def relative_key(image: str) -> str:
    """The listing key of a row's image path: '/'-separated, with './', '//' and 'a/..' resolved
    as text (paths outside the base keep their '../' or '/')."""
    if "//" in image or "./" in image or image.startswith("/") or image.endswith("/."):
        return posixpath.normpath(image)
    return image


class DataSource:
    """A data set's base folder or URL with its storage options, opened lazily (once per
    source); pickled to worker processes by its names, never its resolved secrets."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        credentials_block: str | None = None,
    ) -> None:
        self.url = urls.normalize_url(str(url), "data.base_path", check_bucket=False)
        self.scheme = urls.scheme_of(self.url)
        self.local = self.scheme == "file"
        self.storage_options = dict(storage_options or {})
        self.credentials_block = credentials_block
        self._fs: tuple[Any, str] | None = None

    def __reduce__(self):  # to worker processes: the names, never resolved secrets
        return DataSource, (self.url, self.storage_options, self.credentials_block)

    def __repr__(self) -> str:
        options = redact(self.storage_options)
        return (
            f"DataSource({self.url!r}, {options!r}, credentials_block={self.credentials_block!r})"
        )

    # ---- opening -------------------------------------------------------------------------
    def _opened(self) -> tuple[Any, str]:
        if self._fs is None:
            options = with_credentials(
                self.url,
                self.storage_options,
                self.credentials_block,
                field="data.credentials_block",
            )
            try:
                self._fs = open_url(self.url, options, field="data.base_path")
            except ImportError as exc:
                package = urls.FILESYSTEM_PACKAGES.get(self.scheme, exc.name or "its filesystem")
                raise DataError(
                    f"data.base_path {self.url}: the filesystem for '{self.scheme}://' is not "
                    f"installed; `pip install {package}`"
                ) from None
            except TypeError as exc:
                raise DataError(
                    f"data.base_path {self.url}: unknown storage option ({scrub(str(exc), options)}"
                    "); fix data.storage_options"
                ) from None
        return self._fs

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (opened on first use)."""
        return self._opened()[0]

    @property
    def root(self) -> str:
        """The base folder as an fs path (a local OS path on disks)."""
        return self.local_root if self.local else self._opened()[1]

    @property
    def local_root(self) -> str:
        """The base folder as an OS path (local data sets only)."""
        return urls.local_path(self.url)

    def path(self, rel: str) -> str:
        """fs path of a file named relative to the base."""
        if self.local:
            return os.path.join(self.local_root, rel)
        return f"{self.root}/{rel.lstrip('/')}"

    def display(self, rel: str) -> str:
        """A file as messages name it: the OS path on disks, the URL on object stores."""
        return self.path(rel) if self.local else f"{self.url}/{rel.lstrip('/')}"

    def failure(self, action: str, target: str, exc: BaseException) -> Exception:
        """A DataError naming the URL and the storage problem, with no credentials in it (a
        UserError, e.g. an unreadable credentials block, is returned as it is)."""
        if isinstance(exc, UserError):
            return exc
        opts = {**self.storage_options}
        mapped = translate_error(exc, target, action, opts, field="data.storage_options")
        if mapped is not exc:  # the cache's words for the same problem, naming the data's field
            return DataError(str(mapped))
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return DataError(f"cannot {action} {target}: {scrub(str(reason), opts)[:300]}")

    # ---- listing ---------------------------------------------------------------------------
    def listing(self, images: Iterable[str] | None = None) -> Listing:
        """One listing of the data set's files. On disks only the folders that `images` (row
        paths) name are scanned (never a whole tree above them); on object stores, the prefix,
        or the folders `images` name (`_folders_to_list`), as concurrent chains of pages
        (`object_listing`: on S3 also cut into key ranges at the names `images` gives)."""
        started = time.time_ns()
        if self.local:
            return Listing(self._list_local(images), started, True)
        try:
            self.fs.invalidate_cache(self.root)
            if getattr(self.fs, "async_impl", False):
                names = [] if images is None else list(images)
                folders = _folders_to_list(names) if images is not None else None
                found = list_concurrently(self.fs, self.root, folders or [""], names)
            else:
                found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            found = {}
        except Exception as exc:
            raise self.failure("list the data set", self.url, exc) from None
        prefix = len(self.root.rstrip("/")) + 1
        files = {}
        for name, info in found.items():
            if info.get("type", "file") != "directory":
                files[name[prefix:]] = (int(info.get("size") or 0), _version(info))
        return Listing(files, started, False)

    def _list_local(self, images: Iterable[str] | None) -> dict[str, tuple[int, Any]]:
        """(size, mtime_ns) of every regular file in the folders `images` name (the base when
        None): names and stats from os.scandir."""
        root = self.local_root
        folders = {""} if images is None else _folders_of(images)
        files: dict[str, tuple[int, Any]] = {}
        for folder in sorted(folders):
            try:
                entries = os.scandir(os.path.join(root, folder) if folder else root)
            except (OSError, ValueError):
                continue  # a missing or unusable folder: its rows say so one by one
            prefix = f"{folder}/" if folder else ""
            with entries:
                for entry in entries:
                    try:
                        if not entry.is_file():
                            continue
                        st = entry.stat()
                    except OSError:
                        continue
                    files[prefix + entry.name] = (st.st_size, st.st_mtime_ns)
        return files

    # ---- reading ---------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        """One file's bytes (OSError on failure)."""
        if self.local:
            with open(self.path(rel), "rb") as fh:
                return fh.read()
        got = self._cat([self.path(rel)], [None])[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def _cat(self, paths: list[str], none: list[None]) -> list[bytes | BaseException]:
        """Whole objects in one concurrent call; one GET each (no size probe: s3fs's would HEAD
        each object first, through a listing cache that may predate it)."""
        if getattr(self.fs, "async_impl", False) and hasattr(self.fs, "max_concurrency"):
            kwargs = {"max_concurrency": 1}
        else:
            kwargs = {}
        return self.fs.cat_ranges(paths, none, none, on_error="return", **kwargs)

    def read_many(self, rels: Sequence[str]) -> list[bytes | BaseException]:
        """Many files' bytes, in order; a failed read comes back as its exception."""
        if self.local or len(rels) <= 1:
            out: list[bytes | BaseException] = []
            for rel in rels:
                try:
                    out.append(self.read(rel))
                except Exception as exc:
                    out.append(exc)
            return out
        out = []
        for start in range(0, len(rels), READ_BATCH):
            paths = [self.path(r) for r in rels[start : start + READ_BATCH]]
            none = [None] * len(paths)  # cat_ranges: no glob expansion through a stale dircache
            out.extend(self._cat(paths, none))
        return out

    def locate(self, path: str) -> tuple[DataSource, str]:
        """(source, relative name) of a metadata file given as a path or URL: this source when
        it lies under the base, else its folder opened with the same options."""
        url = urls.normalize_url(str(path), "data.metadata_path", check_bucket=False)
        if url.startswith(self.url.rstrip("/") + "/"):
            return self, url[len(self.url.rstrip("/")) + 1 :]
        parent, _, name = url.rpartition("/")
        return DataSource(parent or ".", self.storage_options, self.credentials_block), name

    def kind(self, rel: str) -> str:
        """'file', 'folder' or 'missing': what stands at `rel` (for metadata files)."""
        if self.local:
            path = self.path(rel)
            return (
                "folder" if os.path.isdir(path) else "file" if os.path.isfile(path) else "missing"
            )
        try:
            info = self.fs.info(self.path(rel))
        except FileNotFoundError:
            return "missing"
        except Exception as exc:
            raise self.failure("read", self.display(rel), exc) from None
        return "folder" if info.get("type") == "directory" else "file"

    def missing_bucket(self) -> str | None:
        """The base's bucket when the store says it does not exist, else None (also when that
        cannot be found out: the caller's own message then stands)."""
        bucket = None if self.local else urls.bucket_of(self.url)
        if not bucket:
            return None
        try:
            self.fs.invalidate_cache(bucket)
            return None if self.fs.exists(bucket) else bucket
        except Exception:
            return None

    def stat(self, rel: str) -> tuple[int, Any] | None:
        """(size, version) of one file now (mtime_ns on disks, ETag on object stores); None
        when it cannot be found out (callers then trust nothing recorded about it)."""
        try:
            if self.local:
                st = os.stat(self.path(rel))
                return st.st_size, st.st_mtime_ns
            self.fs.invalidate_cache(self.path(rel))
            info = self.fs.info(self.path(rel))
        except Exception:
            return None
        version = _version(info)
        return None if version is None else (int(info.get("size") or 0), version)

    def read_metadata(self, rel: str) -> bytes:
        """A metadata file's bytes; DataError naming it when it cannot be read."""
        try:
            return self.read(rel)
        except OSError as exc:
            what = exc.strerror or exc
            raise DataError(f"cannot read metadata file {self.display(rel)}: {what}") from exc
        except Exception as exc:
            raise self.failure("read metadata file", self.display(rel), exc) from None


def _folders_of(images: Iterable[str]) -> set[str]:
    """posixpath.dirname of every listing key, the common case (relative, as `relative_key`
    leaves it: no '//') without its per-call cost."""
    return {posixpath.dirname(i) if i.startswith("/") else i.rpartition("/")[0] for i in images}


def _folders_to_list(images: Iterable[str] | None) -> list[str] | None:
    """The folders to list one by one instead of the whole prefix: when rows name several
    folders holding many files each (not a folder per file, nothing at the base itself)."""
    if images is None:
        return None
    images = list(images)
    folders = {posixpath.dirname(i) for i in images}
    if not 0 < len(folders) <= MAX_LISTED_FOLDERS:
        return None
    if len(folders) > 1 and len(folders) * 20 > len(images):  # too few files per request
        return None
    if any(not f or f.startswith(("/", "..")) for f in folders):
        return None
    return _outermost(sorted(folders))


def _outermost(folders: list[str]) -> list[str]:
    """`folders` (sorted) without those inside another one (listed with it)."""
    kept: list[str] = []
    for folder in folders:
        if not kept or not folder.startswith(kept[-1] + "/"):
            kept.append(folder)
    return kept


def _version(info: Mapping[str, Any]) -> Any:
    """The version of an object-store entry: ETag, generation or md5; else its mtime."""
    for name in ("ETag", "etag", "generation", "md5Hash", "content_md5"):
        if info.get(name):
            return str(info[name]).strip('"')
    stamp = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    return None if stamp is None else f"t:{stamp}"


def source_for(base_path: Any) -> DataSource:
    """`base_path` itself when it is a DataSource (what stages 1 and 2 hand down); a folder or
    URL given as text opens a source with no storage options (the environment's login)."""
    if isinstance(base_path, DataSource):
        return base_path
    return DataSource(str(base_path))


def open_data_source(data: Any) -> DataSource:
    """The DataSource of a DataConfig (base_path, storage_options, credentials_block): open it
    once per process and pass it down."""
    return DataSource(str(data.base_path), data.storage_options, data.credentials_block)
