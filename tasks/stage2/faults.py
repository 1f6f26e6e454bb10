"""Fault injection for tests: a real crash of a rank (or its whole node) at a known update."""

from __future__ import annotations

import os
import signal


def injected_fault() -> tuple[int, int, bool] | None:
    """SPLITSTAGE_FAULT_KILL=RANK:UPDATE[:node] makes that rank SIGKILL itself after that update,
    with ':node' its torchrun agent first (the whole node dies). For fault-injection tests: a
    real crash at a known point, not a simulated one."""
    value = os.environ.get("SPLITSTAGE_FAULT_KILL")
    if not value:
        return None
    rank, update, *scope = value.split(":")
    return int(rank), int(update), scope == ["node"]


def crash(whole_node: bool) -> None:
    """Die now, as a power cut would: no cleanup, no checkpoint."""
    if whole_node:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
