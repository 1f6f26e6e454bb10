"""The stage-2 worker's way out: exit code and buffered output kept, a signal's stack shown."""

from __future__ import annotations

import subprocess
import sys

LEAVE = (
    "import sys\n"
    "from splitstage.tasks.stage2.worker import leave\n"
    "print('written', end='')\n"
    "print('to stderr', end='', file=sys.stderr)\n"
    "leave(3)\n"
    "print('never')\n"
)

TRACES = (
    "import faulthandler\n"
    "from splitstage.tasks.stage2.worker import main\n"
    "try:\n"
    "    main(['/nonexistent/spec.json'])\n"
    "except FileNotFoundError:\n"
    "    print(faulthandler.is_enabled(), end='')\n"
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_leave_keeps_the_exit_code_and_flushes_piped_output():
    done = run(LEAVE)
    assert done.returncode == 3
    assert done.stdout == "written"  # block-buffered on a pipe: lost by a bare os._exit
    assert done.stderr == "to stderr"


def test_a_rank_shows_its_python_stack_if_a_signal_kills_it():
    done = run(TRACES)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True"  # faulthandler: SIGABRT/SIGSEGV print every thread's frames
