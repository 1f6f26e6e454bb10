"""Processes, told apart drift-free: is a lease holder alive here, which of a tree to stop.

Linux: the machine is hostname + `/proc/sys/kernel/random/boot_id` + PID namespace, and a
process's start is its start time in clock ticks since boot (`/proc/<pid>/stat`). Neither moves
when the wall clock is stepped or slewed, which `psutil.boot_time()` and `create_time()` do (the
kernel derives both from the wall clock), so two processes of one boot always agree. Elsewhere:
psutil's boot time and create time, with one second of tolerance.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import psutil

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_id() -> str:
    """Hostname + boot + PID namespace: containers sharing a hostname do not share pids."""
    boot = f"{psutil.boot_time():.0f}"
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as file:
        boot = file.read().strip()
    machine = f"{socket.gethostname()}/{boot}"
    with contextlib.suppress(OSError):
        return f"{machine}/{os.readlink('/proc/self/ns/pid')}"
    return machine


def process_started(pid: int) -> float:
    """When `pid` started: seconds since boot from /proc when there, else psutil's create time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and ')'
        return int(fields[19]) / _TICKS
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    except (OSError, IndexError, ValueError):
        return psutil.Process(pid).create_time()


def process_gone(pid: int, started: float) -> bool:
    """True when process `pid` of this machine, started at `started`, no longer runs here."""
    try:
        proc = psutil.Process(pid)
        if started and abs(process_started(pid) - started) > 1.0:
            return True  # the pid was reused by another process
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error as exc:  # gone: dead; access denied: assume alive
        return isinstance(exc, psutil.NoSuchProcess)


def snapshot_tree(root: psutil.Process, known: dict[int, float]) -> None:
    """Remember every descendant (pid -> start since boot) so orphans can still be found."""
    with contextlib.suppress(psutil.Error):
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                known.setdefault(child.pid, process_started(child.pid))


def live_processes(known: dict[int, float]) -> list[psutil.Process]:
    """The remembered processes that still exist as the same process (pids can be reused)."""
    out = []
    for pid, created in known.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if process_started(pid) == created and is_alive(proc):
                out.append(proc)
    return out


def is_alive(proc: psutil.Process | int) -> bool:
    """True while a process runs (a zombie awaiting its reaper counts as dead)."""
    try:
        proc = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_tree(
    root_pid: int | None, known: dict[int, float] | None = None, grace: float = 5.0
) -> None:
    """SIGTERM a process, its descendants and the orphans in `known`; SIGKILL what remains."""
    known = dict(known or {})
    with contextlib.suppress(psutil.Error):
        if root_pid is not None:
            root = psutil.Process(root_pid)
            known.setdefault(root.pid, process_started(root.pid))
            snapshot_tree(root, known)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        procs = live_processes(known)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for proc in procs:  # new children spawned meanwhile are caught too
                if is_alive(proc):
                    with contextlib.suppress(psutil.Error):
                        for child in proc.children(recursive=True):
                            known.setdefault(child.pid, process_started(child.pid))
            if not live_processes(known):
                return
            time.sleep(0.05)
