"""Which of many local files changed since they were recorded (size and mtime_ns), by one stat
each: the whole cost of a rerun's check that a data set is unchanged. Many files are split over
child processes (`python -m` this module, raw bytes over pipes, no pickle): os.stat holds the
GIL between calls, so threads do not scale on it while processes do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as stat_mode
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)
PER_PROCESS = 100_000  # files worth a process of their own (starting one costs ~0.1-0.3 s)
MAX_PROCESSES = 8
_SEP = "\0"


def changed_files(root: str, names: bytes, sizes: np.ndarray, mtimes: np.ndarray) -> list[int]:
    """Indices of the files `names` lists (paths under `root`, NUL-joined UTF-8, best grouped by
    folder) that are no regular file now, or whose size or mtime_ns differ from `sizes` /
    `mtimes`. The text is split in the children, so this process never builds the strings."""
    count = len(sizes)
    processes = stat_processes(count)
    if processes > 1:
        try:
            return _in_children(root, names, sizes, mtimes, processes)
        except Exception as exc:  # the check is the same in this process, only slower
            log.warning("file check in %d processes failed (%s); checking here", processes, exc)
    return _changed(root, _names(names, count), sizes, mtimes)


def stat_processes(count: int) -> int:
    """SPLITSTAGE_STAT_PROCESSES when set, else one per PER_PROCESS files, up to the cores."""
    forced = os.environ.get("SPLITSTAGE_STAT_PROCESSES", "")
    if forced.isdigit() and int(forced) >= 1:
        return min(int(forced), max(1, count))
    return max(1, min(os.cpu_count() or 1, MAX_PROCESSES, count // PER_PROCESS))


def _in_children(root: str, names: bytes, sizes, mtimes, processes: int) -> list[int]:
    """Split the check over `processes` children, each fed one slice on stdin."""
    count = len(sizes)
    ends = [*np.flatnonzero(np.frombuffer(names, np.uint8) == 0).tolist(), len(names)]
    if len(ends) != count:
        raise ValueError(f"{len(ends)} names for {count} files")
    step = -(-count // processes)
    slices = []
    for lo in range(0, count, step):
        hi = min(count, lo + step)
        first = ends[lo - 1] + 1 if lo else 0
        slices.append((lo, hi, names[first : ends[hi - 1]]))
    children = []
    for _ in slices:
        child = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        children.append(child)
    changed: list[int] = []
    try:
        for (lo, hi, part), child in zip(slices, children, strict=True):
            assert child.stdin is not None
            child.stdin.write(_encode(part, sizes[lo:hi], mtimes[lo:hi]))
            child.stdin.close()
        for (lo, _, _), child in zip(slices, children, strict=True):
            out, err = child.stdout.read(), child.stderr.read()
            child.wait()
            if child.returncode != 0:
                tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"exit {child.returncode}: {tail[0]}")
            changed += (np.frombuffer(out, dtype=np.int64) + lo).tolist()
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return sorted(changed)


def _names(names: bytes, count: int) -> list[str]:
    """The NUL-joined names as strings (refused when their number is not `count`)."""
    rels = names.decode("utf-8", "surrogateescape").split(_SEP) if count else []
    if len(rels) != count:
        raise ValueError(f"{len(rels)} names for {count} files")
    return rels


def _encode(names: bytes, sizes: np.ndarray, mtimes: np.ndarray) -> bytes:
    """One child's input: counts, names, sizes, mtimes (raw bytes, no pickle)."""
    head = np.array([len(sizes), len(names)], dtype=np.int64).tobytes()
    columns = np.asarray(sizes, np.int64).tobytes() + np.asarray(mtimes, np.int64).tobytes()
    return head + names + columns


def _decode(data: bytes) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A child's input back into (names, sizes, mtimes)."""
    count, length = np.frombuffer(data[:16], dtype=np.int64).tolist()
    rels = _names(data[16 : 16 + length], count)
    rest = 16 + length
    sizes = np.frombuffer(data[rest : rest + 8 * count], dtype=np.int64)
    mtimes = np.frombuffer(data[rest + 8 * count : rest + 16 * count], dtype=np.int64)
    if len(mtimes) != count:
        raise ValueError("truncated input")
    return rels, sizes, mtimes


def _changed(root: str, rels: Sequence[str], sizes, mtimes) -> list[int]:
    """The check of one slice in this process; files of one folder are stat-ed relative to the
    open folder (no path walk per file)."""
    got_sizes = np.full(len(rels), -1, dtype=np.int64)
    got_mtimes = np.zeros(len(rels), dtype=np.int64)
    gone: list[int] = []
    stat, is_reg = os.stat, stat_mode.S_ISREG
    folder, fd = None, None
    try:
        for i, rel in enumerate(rels):
            where, _, name = rel.rpartition("/")
            if where != folder:
                if fd is not None:
                    os.close(fd)
                folder, fd = where, None
                with contextlib.suppress(OSError, ValueError):  # then: one path walk per file
                    fd = os.open(os.path.join(root, where), os.O_RDONLY | os.O_DIRECTORY)
            try:
                st = stat(name, dir_fd=fd) if fd is not None else stat(os.path.join(root, rel))
            except (OSError, ValueError):
                gone.append(i)
                continue
            if not is_reg(st.st_mode):
                gone.append(i)
            got_sizes[i] = st.st_size
            got_mtimes[i] = st.st_mtime_ns
    finally:
        if fd is not None:
            os.close(fd)
    differ = np.flatnonzero((got_sizes != sizes) | (got_mtimes != mtimes)).tolist()
    return sorted({*differ, *gone})


if __name__ == "__main__":  # a child of `_in_children`: one slice on stdin, indices on stdout
    found = _changed(sys.argv[1], *_decode(sys.stdin.buffer.read()))
    sys.stdout.buffer.write(np.asarray(found, dtype=np.int64).tobytes())
