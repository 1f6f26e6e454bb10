"""A row's image or video path against the data set's storage: paths that cannot name one of its
files, and the message for a file the listing lacks (each naming the file as a video or image)."""

from __future__ import annotations

from pathlib import Path

from splitstage.data.images import DataError
from splitstage.data.source import DataSource, Listing, relative_key
from splitstage.data.videos import is_video


def noun(path: str) -> str:
    """'video' or 'image': what a row's file is, for messages (a video by its suffix)."""
    return "video" if is_video(path) else "image"


def check_image_path(where: str, image: str, rel: str, local: bool, base: str) -> None:
    """DataError for an image path that cannot name a file of the data set: a URL, a folder
    ('.../'), or on an object store a path that is absolute or climbs out of the base with '..'
    (no such key); `where` names the row ('metadata.csv row 3'), `rel` is `relative_key(image)`."""
    what = noun(image)
    if "://" in image:
        raise DataError(
            f"{where}: {what} {image[:200]!r} is a URL; give the path relative to "
            f"data.base_path ({base})"
        )
    if image.endswith("/"):  # on a store, a folder marker object: listed, but no file
        raise DataError(f"{where}: {what} path {image[:200]!r} names a folder, not a file")
    if local:
        return
    if rel.startswith("/"):
        raise DataError(
            f"{where}: {what} path {image[:200]!r} is absolute; on object stores file paths "
            f"are relative to data.base_path ({base})"
        )
    if rel == ".." or rel.startswith("../"):
        raise DataError(
            f"{where}: {what} path {image[:200]!r} climbs out of data.base_path ({base}) with "
            "'..', which object stores do not resolve; set data.base_path to a prefix above "
            "every file"
        )


def missing_image(where: str, image: str, source: DataSource, listing: Listing) -> None:
    """DataError for a row (`where`) whose file the listing lacks (on disks, the path is checked
    once more: it may be spelled in a way the listing does not resolve, or be unusable)."""
    what = noun(image)
    if not source.local:
        raise DataError(
            f"{where}: {what} file {source.display(image)} not found; fix the path or remove row"
        )
    path = Path(source.local_root) / image
    try:
        st = path.stat() if path.is_file() else None
    except (OSError, ValueError) as exc:  # e.g. a name too long for the file system
        reason = getattr(exc, "strerror", None) or exc
        raise DataError(f"{where}: {what} path {str(path)[:200]!r} is unusable: {reason}") from exc
    if st is None:
        raise DataError(f"{where}: {what} file {path} not found; fix the path or remove row")
    listing.files[relative_key(image)] = (st.st_size, st.st_mtime_ns)
