"""Which of many local files changed since they were recorded (size and mtime_ns), by one os.stat
each: the whole cost of a rerun's check that a data set is unchanged. From PER_PROCESS files on
it is split over child processes (`python -m stat_child`, raw bytes over pipes, no pickle):
os.stat costs ~2 us a file in Python, most of it holding the GIL, so threads do not scale on it
(2 or 4 threads no faster than one), and pyarrow's C++ listing is slower still (a Python object
per file). It starts at once and is answered later, so the caller can restore the memo's rows
meanwhile.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import numpy as np

from splitstage.data import stat_child

log = logging.getLogger(__name__)
PER_PROCESS = 100_000  # files worth a process of their own (starting one costs ~50 ms)
MAX_PROCESSES = 8


def changed_files(root: str, names: bytes, sizes: np.ndarray, mtimes: np.ndarray) -> list[int]:
    """Indices of the files `names` lists (paths under `root`, NUL-joined UTF-8, best grouped by
    folder) that are no regular file now, or whose size or mtime_ns differ from `sizes` /
    `mtimes`."""
    with FileCheck(root, names, sizes, mtimes) as check:
        return check.changed()


class FileCheck:
    """A started check of files against their recorded stats: `changed()` answers it (waiting
    for the child processes that run it), `close()` stops it unanswered."""

    def __init__(self, root: str, names: bytes, sizes: np.ndarray, mtimes: np.ndarray):
        self.root, self.names = root, names
        self.sizes = np.asarray(sizes, np.int64)
        self.mtimes = np.asarray(mtimes, np.int64)
        self.children: list[tuple[int, subprocess.Popen]] = []
        self.feeders: list[threading.Thread] = []
        self.failure: Exception | None = None
        processes = stat_processes(len(self.sizes))
        if processes > 1:
            try:
                self._start(processes)
            except Exception as exc:
                self.failure = exc
                self.close()

    def __enter__(self) -> FileCheck:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def changed(self) -> list[int]:
        """The indices of the changed files, in order (a failing child: the whole check again
        in this process, with one warning)."""
        if self.children and self.failure is None:
            try:
                return self._collect()
            except Exception as exc:
                self.failure = exc
            finally:
                self.close()
        if self.failure is not None:
            log.warning("file check failed (%s); checking here with os.stat", self.failure)
        rels = stat_child.names_of(self.names, len(self.sizes))
        return stat_child.changed(self.root, rels, self.sizes.tolist(), self.mtimes.tolist())

    def close(self) -> None:
        """Stop every child still running."""
        for _, child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for feeder in self.feeders:  # a dead child's pipe fails its feeder's write
            feeder.join()
        for _, child in self.children:
            for pipe in (child.stdin, child.stdout, child.stderr):
                if pipe is not None:
                    pipe.close()
        self.children, self.feeders = [], []

    def _start(self, processes: int) -> None:
        """One child per slice of the names, each fed its slice on stdin."""
        count = len(self.sizes)
        seps = np.flatnonzero(np.frombuffer(self.names, np.uint8) == 0)
        if len(seps) != count - 1:
            raise ValueError(f"{len(seps) + 1} names for {count} files")
        step = -(-count // processes)
        slices = []
        for lo in range(0, count, step):
            hi = min(count, lo + step)
            first = int(seps[lo - 1]) + 1 if lo else 0
            last = int(seps[hi - 1]) if hi < count else len(self.names)
            slices.append((lo, hi, self.names[first:last]))
        for lo, _, _ in slices:
            child = subprocess.Popen(
                [sys.executable, "-m", stat_child.__name__, self.root],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            self.children.append((lo, child))
        for (lo, hi, part), (_, child) in zip(slices, self.children, strict=True):
            pieces = stat_child.encode(part, self.sizes[lo:hi], self.mtimes[lo:hi])
            feeder = threading.Thread(target=_feed, args=(child.stdin, pieces), daemon=True)
            feeder.start()  # every child gets its input at once, none waits for another's
            self.feeders.append(feeder)

    def _collect(self) -> list[int]:
        """Every child's answer, shifted to whole-list indices."""
        changed: list[int] = []
        for lo, child in self.children:
            assert child.stdout is not None and child.stderr is not None
            out, err = child.stdout.read(), child.stderr.read()
            child.wait()
            if child.returncode != 0:
                tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"exit {child.returncode}: {tail[0]}")
            changed += (np.frombuffer(out, dtype=np.int64) + lo).tolist()
        return sorted(changed)


def _feed(pipe, pieces: list) -> None:
    """Write one child's input and close its stdin; a child that died early is told by its exit
    status, not here."""
    try:
        pipe.writelines(pieces)
        pipe.close()
    except (OSError, ValueError):
        pass


def stat_processes(count: int) -> int:
    """Child processes for the check: one per PER_PROCESS files, up to the cores and
    MAX_PROCESSES (1: in this process); SPLITSTAGE_STAT_PROCESSES, when set, forces the number."""
    forced = os.environ.get("SPLITSTAGE_STAT_PROCESSES", "")
    if forced.isdigit() and int(forced) >= 1:
        return max(1, min(int(forced), count))
    return max(1, min(os.cpu_count() or 1, MAX_PROCESSES, count // PER_PROCESS))
