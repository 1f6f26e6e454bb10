"""Leaving a process that ran torch (a rank, the set-up child, the CLI) once its results are out."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable


def leave(code: int) -> None:
    """Flush and exit without the interpreter's teardown: a gloo or torch thread still alive
    while Python and C++ statics are torn down can abort the process ("terminate called without
    an active exception") after its results were written, and the teardown of torch and a
    family costs 0.1-0.5 s on the launch's critical path."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_then_leave(main: Callable[[], int]) -> None:
    """A command's `main()`, the exit handlers (a Prefect temporary server's shutdown among
    them), then `leave` with its code, skipping the interpreter's finalization, where a thread
    that ran torch ops can still be unwinding and abort the process with "terminate called
    without an active exception" (exit 134) after the work and its message are done
    (pytorch/pytorch#117762). Call it before anything imports torch or Prefect: exit handlers
    run last-registered first, so this one runs after theirs."""
    outcome = {"code": 1}  # an uncaught exception: Python prints it and exits 1
    atexit.register(lambda: leave(outcome["code"]))
    try:
        outcome["code"] = main()
    except SystemExit as stop:  # argparse's --help (0) and usage errors (2)
        code = stop.code
        outcome["code"] = code if isinstance(code, int) else int(code is not None)
        raise
    sys.exit(outcome["code"])
