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
    lib.splitstage_changed.restype = ctypes.c_long
    lib.splitstage_changed.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_long]
    lib.splitstage_changed.argtypes += [ctypes.c_void_p] * 3
    return lib


def start(
    lib: ctypes.CDLL, root: str, names: bytes, sizes: np.ndarray, mtimes: np.ndarray, threads: int
) -> list[Future]:
    """Start the check of `names` (NUL-joined) in `threads` slices; each future gives (lo,
    flags) or raises. The buffers are kept alive by the futures' closures."""
    count = len(sizes)
    if not count:
        return []
    text = names + b"\0"  # every name NUL-terminated, the last one too
    ends = np.flatnonzero(np.frombuffer(text, np.uint8) == 0)
    if len(ends) != count:
        raise ValueError(f"{len(ends)} names for {count} files")
    sizes = np.ascontiguousarray(sizes, np.int64)
    mtimes = np.ascontiguousarray(mtimes, np.int64)
    flags = np.zeros(count, np.uint8)
    root_bytes = os.fsencode(root)

    def run(lo: int, hi: int) -> tuple[int, np.ndarray]:
        offset = int(ends[lo - 1]) + 1 if lo else 0
        first = ctypes.cast(ctypes.c_char_p(text), ctypes.c_void_p).value + offset  # no copy
        got = lib.splitstage_changed(
            root_bytes,
            first,
            hi - lo,
            sizes[lo:].ctypes.data,
            mtimes[lo:].ctypes.data,
            flags[lo:].ctypes.data,
        )
        if got < 0:
            raise OSError(f"native stat could not open {root!r}")
        return lo, flags[lo:hi]

    step = -(-count // max(1, threads))
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="file-stats")
    futures = [pool.submit(run, lo, min(count, lo + step)) for lo in range(0, count, step)]
    pool.shutdown(wait=False)
    return futures


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
