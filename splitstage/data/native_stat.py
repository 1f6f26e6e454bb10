"""The rerun check's stat loop in C (native_stat.c), built on first use with the system's C
compiler into a per-user cache and called through ctypes from threads: ~2.5x faster than
Python's os.stat on 1M files (measured: 0.78 s vs ~2 s on 2 cores). Where no compiler is found
or the build fails, `library()` is None and the caller checks in Python, with one info line.
SPLITSTAGE_NATIVE_STAT=0 turns it off; SPLITSTAGE_NATIVE_CACHE picks the build folder.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("native_stat.c")
BUILD_SECONDS = 60


def enabled() -> bool:
    """False when SPLITSTAGE_NATIVE_STAT=0 (or the platform has no fstatat: not POSIX)."""
    return os.environ.get("SPLITSTAGE_NATIVE_STAT", "1") != "0" and os.name == "posix"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library (built now when missing), or None where it cannot be built or loaded."""
    if not enabled() or not SOURCE.is_file():
        return None
    source = SOURCE.read_bytes()
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler found: data set files are checked with Python's os.stat")
        return None
    tag = hashlib.sha256(source + " ".join(compiler).encode() + platform.machine().encode())
    try:
        built = _cache_dir() / f"native_stat-{tag.hexdigest()[:16]}.so"
        if not built.is_file():
            _build(compiler, built)
        lib = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("native stat helper not built (%s): checking with Python's os.stat", exc)
        return None
    lib.splitstage_stat.restype = ctypes.c_long
    lib.splitstage_stat.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_long]
    lib.splitstage_stat.argtypes += [ctypes.c_void_p] * 3
    return lib


class NativeStats:
    """A started stat of many files on threads (see `start`); `result()` waits and gives the
    columns (size, mtime_ns: -1 where not a regular file; regular: bool)."""

    def __init__(self, futures: list[Future], sizes, mtimes, regular) -> None:
        self.futures, self.sizes, self.mtimes, self.regular = futures, sizes, mtimes, regular

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        for future in self.futures:
            future.result()
        return self.sizes, self.mtimes, self.regular.astype(bool)


def start(lib: ctypes.CDLL, root: str, names: bytes, count: int, threads: int) -> NativeStats:
    """Start the stat of `count` files (`names`: NUL-joined paths under `root`, best grouped by
    folder) in `threads` slices. The buffers live as long as the returned object."""
    sizes = np.full(count, -1, np.int64)
    mtimes = np.full(count, -1, np.int64)
    regular = np.zeros(count, np.uint8)
    if not count:
        return NativeStats([], sizes, mtimes, regular)
    text = names + b"\0"  # every name NUL-terminated, the last one too
    ends = np.flatnonzero(np.frombuffer(text, np.uint8) == 0)
    if len(ends) != count:
        raise ValueError(f"{len(ends)} names for {count} files")
    root_bytes = os.fsencode(root)

    def run(lo: int, hi: int) -> None:
        offset = int(ends[lo - 1]) + 1 if lo else 0
        first = ctypes.cast(ctypes.c_char_p(text), ctypes.c_void_p).value + offset  # no copy
        got = lib.splitstage_stat(
            root_bytes,
            first,
            hi - lo,
            sizes[lo:].ctypes.data,
            mtimes[lo:].ctypes.data,
            regular[lo:].ctypes.data,
        )
        if got < 0:
            raise OSError(f"native stat could not open {root!r}")

    step = -(-count // max(1, threads))
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="file-stats")
    futures = [pool.submit(run, lo, min(count, lo + step)) for lo in range(0, count, step)]
    pool.shutdown(wait=False)
    return NativeStats(futures, sizes, mtimes, regular)


def workers_for(count: int, per_worker: int = 20_000, most: int = 8) -> int:
    """Threads (or processes) worth starting to stat `count` files: one per `per_worker`, up to
    the cores and `most`; SPLITSTAGE_STAT_PROCESSES, when set, forces the number."""
    forced = os.environ.get("SPLITSTAGE_STAT_PROCESSES", "")
    if forced.isdigit() and int(forced) >= 1:
        return max(1, min(int(forced), count))
    return max(1, min(os.cpu_count() or 1, most, count // per_worker))


def _compiler() -> list[str] | None:
    """$CC, else the compiler Python was built with, else cc / gcc / clang on PATH."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        words = shlex.split(candidate or "")
        if words and shutil.which(words[0]):
            return words
    return None


def _cache_dir() -> Path:
    """Where built helpers are kept: SPLITSTAGE_NATIVE_CACHE, else ~/.cache/splitstage."""
    chosen = os.environ.get("SPLITSTAGE_NATIVE_CACHE")
    base = Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache"))
    folder = (base if chosen else base / "splitstage").expanduser()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # others could swap the library
        raise OSError(f"{folder} is not this user's alone (owner or group/other write)")
    return folder


def _build(compiler: list[str], target: Path) -> None:
    """Compile the helper into `target` atomically (concurrent builders each rename their own)."""
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        command = [*compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise OSError(f"{compiler[0]} exited {done.returncode}: {tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
