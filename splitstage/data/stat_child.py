"""The stat loop of a data set's rerun check: which files are no regular file now or differ from
their recorded (size, mtime_ns). Run in this process or as `python -m` in child processes fed raw
bytes on stdin (no pickle); it imports nothing heavy (no numpy), so a child starts in ~50 ms.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Sequence

_SEP = "\0"
_HEAD = struct.Struct("=qq")  # file count, byte length of the names
_REGULAR, _KIND = 0o100000, 0o170000


def encode(names: bytes, sizes, mtimes) -> list:
    """One child's input, in pieces to write in order: counts, NUL-joined names, and the sizes
    and mtimes as native int64 buffers (numpy arrays or `array("q")`)."""
    sizes, mtimes = memoryview(sizes).cast("B"), memoryview(mtimes).cast("B")
    count = len(sizes) // 8
    if len(sizes) % 8 or len(mtimes) != len(sizes):
        raise ValueError("size and mtime columns must be int64 columns of one length")
    return [_HEAD.pack(count, len(names)), names, sizes, mtimes]


def decode(data: bytes) -> tuple[list[str], array, array]:
    """A child's input back into (names, sizes, mtimes)."""
    count, length = _HEAD.unpack_from(data)
    rest = _HEAD.size + length
    sizes, mtimes = array("q"), array("q")
    sizes.frombytes(data[rest : rest + 8 * count])
    mtimes.frombytes(data[rest + 8 * count : rest + 16 * count])
    if len(mtimes) != count:
        raise ValueError("truncated input")
    return names_of(data[_HEAD.size : rest], count), sizes, mtimes


def names_of(names: bytes, count: int) -> list[str]:
    """The NUL-joined names as strings (refused when their number is not `count`)."""
    rels = names.decode("utf-8", "surrogateescape").split(_SEP) if count else []
    if len(rels) != count:
        raise ValueError(f"{len(rels)} names for {count} files")
    return rels


def changed(
    root: str, rels: Sequence[str], sizes: Sequence[int], mtimes: Sequence[int]
) -> list[int]:
    """Indices of `rels` (paths under `root`, best grouped by folder) that are gone, no regular
    file, or of another size or mtime; a folder's files are stat-ed relative to the open folder
    (no path walk per file)."""
    found: list[int] = []
    stat, folder, fd = os.stat, None, None
    try:
        for i, rel in enumerate(rels):
            where, _, name = rel.rpartition("/")
            if where != folder:
                if fd is not None:
                    os.close(fd)
                folder, fd = where, _open_folder(os.path.join(root, where))
            try:
                st = stat(name, dir_fd=fd) if fd is not None else stat(os.path.join(root, rel))
            except (OSError, ValueError):
                found.append(i)
                continue
            if (
                st.st_size != sizes[i]
                or st.st_mtime_ns != mtimes[i]
                or st.st_mode & _KIND != _REGULAR
            ):
                found.append(i)
    finally:
        if fd is not None:
            os.close(fd)
    return found


def _open_folder(path: str) -> int | None:
    """An open folder to stat its files relative to; None (one path walk per file) when it
    cannot be opened: its files then fail one by one."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":  # a child of file_stats: one slice on stdin, indices on stdout
    found = changed(sys.argv[1], *decode(sys.stdin.buffer.read()))
    sys.stdout.buffer.write(array("q", found).tobytes())
