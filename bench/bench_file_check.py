"""A data set rerun's file check alone: which of many local files changed since recorded (size
and mtime_ns), on empty files in folders of a temp dir (inodes only, a few MB of disk), stat
caches warm as on any rerun. Times the check as splitstage runs it (os.stat in child processes
from PER_PROCESS files) and, side by side on the same files, the ways it could run instead:
in this process alone, on threads of os.stat, from pyarrow's C++ listing, and with --old REV
the check of an earlier commit (its C helper, built here with the C compiler into the temp dir,
and its Python fallback), extracted with `git show`. Rounds interleave the ways: wall seconds
(min and median) and CPU seconds (min; this process's threads and its child processes).

    .venv/bin/python bench/bench_file_check.py                    # 200,000 files, 200 folders
    .venv/bin/python bench/bench_file_check.py --old 1fe0b72      # with the C helper it had
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OLD_FILES = ("native_stat.py", "native_stat.c", "stat_child.py", "file_stats.py")


def write_files(root: Path, files: int, folders: int) -> list[str]:
    """Empty files spread evenly over `folders` folders; their names, grouped by folder."""
    per = -(-files // folders)
    rels = [f"img/{i // per:05d}/{i}.png" for i in range(files)]
    for folder in range(folders):
        (root / f"img/{folder:05d}").mkdir(parents=True, exist_ok=True)
    for rel in rels:
        os.close(os.open(root / rel, os.O_CREAT | os.O_WRONLY, 0o644))
    return rels


def threads_of_os_stat(threads: int):
    """The check on `threads` threads of os.stat (each a slice, folders opened once)."""
    from splitstage.data import stat_child

    def check(root: str, names: bytes, sizes: np.ndarray, mtimes: np.ndarray) -> list[int]:
        columns = (stat_child.names_of(names, len(sizes)), sizes.tolist(), mtimes.tolist())
        step = -(-len(sizes) // threads)
        with ThreadPoolExecutor(threads) as pool:
            parts = [
                (lo, pool.submit(stat_child.changed, root, *(c[lo : lo + step] for c in columns)))
                for lo in range(0, len(sizes), step)
            ]
            return [lo + i for lo, part in parts for i in part.result()]

    return check


def pyarrow_listing(root: str, names: bytes, sizes: np.ndarray, mtimes: np.ndarray) -> list[int]:
    """The check from one recursive pyarrow listing of the root (size and mtime_ns in C++),
    matched to the names by path."""
    import pyarrow.fs as pafs

    from splitstage.data import stat_child

    infos = pafs.LocalFileSystem().get_file_info(pafs.FileSelector(root, recursive=True))
    cut = len(root.rstrip("/")) + 1
    file = pafs.FileType.File
    now = {i.path[cut:]: (i.size, i.mtime_ns) for i in infos if i.type == file}
    rels = stat_child.names_of(names, len(sizes))
    recorded = zip(sizes.tolist(), mtimes.tolist(), strict=True)
    return [i for i, (rel, was) in enumerate(zip(rels, recorded)) if now.get(rel) != was]


def old_checks(rev: str, work: Path) -> dict:
    """The checks of commit `rev` (its C helper, built into `work`, and its Python fallback)."""
    package = work / "old_stat"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in OLD_FILES:
        text = subprocess.run(
            ["git", "show", f"{rev}:splitstage/data/{name}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        text = text.replace(
            "from splitstage.data import native_stat", "from old_stat import native_stat"
        )
        (package / name).write_text(text)
    sys.path.insert(0, str(work))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(work), os.environ.get("PYTHONPATH")])
    )
    os.environ["SPLITSTAGE_NATIVE_CACHE"] = str(work / "build")
    from old_stat import file_stats, native_stat

    def with_native(native: str):
        def check(*args) -> list[int]:
            os.environ["SPLITSTAGE_NATIVE_STAT"] = native
            native_stat.library.cache_clear()
            try:
                return file_stats.changed_files(*args)
            finally:
                native_stat.library.cache_clear()

        return check

    os.environ["SPLITSTAGE_NATIVE_STAT"] = "1"
    if native_stat.library() is None:
        raise SystemExit(f"the C helper of {rev} did not build here (no C compiler?)")
    return {
        f"old C helper ({rev})": with_native("1"),
        f"old Python fallback ({rev})": with_native("0"),
    }


def in_process(*args) -> list[int]:
    """splitstage's check with its child processes turned off."""
    from splitstage.data import file_stats

    os.environ["SPLITSTAGE_STAT_PROCESSES"] = "1"
    try:
        return file_stats.changed_files(*args)
    finally:
        del os.environ["SPLITSTAGE_STAT_PROCESSES"]


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--folders", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--old", metavar="REV", help="also time the check of this commit")
    args = parser.parse_args()

    from splitstage.data import file_stats

    work = Path(tempfile.mkdtemp(prefix="bench-file-check-"))
    try:
        start = time.perf_counter()
        rels = write_files(work / "data", args.files, args.folders)
        print(f"wrote {args.files:,} files in {time.perf_counter() - start:.1f} s", flush=True)
        root = str(work / "data")
        stats = [os.stat(os.path.join(root, rel)) for rel in rels]
        sizes = np.array([s.st_size for s in stats], np.int64)
        mtimes = np.array([s.st_mtime_ns for s in stats], np.int64)
        names = "\0".join(rels).encode()
        ways = {
            "splitstage (child processes)": file_stats.changed_files,
            "splitstage in process alone": in_process,
            "threads of os.stat, 2": threads_of_os_stat(2),
            "threads of os.stat, 4": threads_of_os_stat(4),
            "pyarrow listing": pyarrow_listing,
        }
        if args.old:
            ways.update(old_checks(args.old, work))
        # every way gives the same answer on a changed file set (then unchanged again)
        edited = sorted({0, len(rels) // 2, len(rels) - 1})
        changed_mtimes = mtimes.copy()
        changed_mtimes[edited] += 1
        for label, check in ways.items():
            got = check(root, names, sizes, changed_mtimes)
            assert got == edited, f"{label}: {got[:5]} != {edited}"
        seconds: dict[str, list[float]] = {label: [] for label in ways}
        cpu: dict[str, list[float]] = {label: [] for label in ways}
        for _ in range(args.rounds):
            for label, check in ways.items():
                start, used = time.perf_counter(), cpu_seconds()
                got = check(root, names, sizes, mtimes)
                seconds[label].append(time.perf_counter() - start)
                cpu[label].append(cpu_seconds() - used)
                assert got == [], f"{label}: {got[:5]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = min(seconds["splitstage (child processes)"])
    print(f"\n{args.files:,} files in {args.folders} folders, {os.cpu_count()} cores")
    print(f"{'way':<36} {'min s':>7} {'median s':>9} {'min / splitstage':>17} {'cpu s':>6}")
    for label, times in seconds.items():
        low, median = min(times), statistics.median(times)
        print(f"{label:<36} {low:>7.3f} {median:>9.3f} {low / base:>17.2f} {min(cpu[label]):>6.3f}")


if __name__ == "__main__":
    main()
