"""Which machine and process this is, drift-free: a lease holder gone from this host is dead.

Linux: the machine is hostname + `/proc/sys/kernel/random/boot_id` + PID namespace, and a
process's start is its start time in clock ticks since boot (`/proc/<pid>/stat`). Neither moves
when the wall clock is stepped or slewed, which `psutil.boot_time()` and `create_time()` do (the
kernel derives both from the wall clock), so two processes of one boot always agree. Elsewhere:
psutil's boot time and create time, with one second of tolerance.
"""

from __future__ import annotations

import contextlib
import os
import socket

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
