"""torchrun's elastic agent, made to always exit: `python -m splitstage.process.torchrun_agent ARGS`
is `torchrun ARGS` ending in os._exit once torchrun's main returns or raises.

Measured here: when the agent is SIGTERMed (its launcher died, PR_SET_PDEATHSIG) its shutdown can
skip stopping its log-tail threads (`--tee`), and the interpreter then waits for them forever: an
orphan agent per killed launcher (4 of ~19 runs of tests/integration/test_launcher_death.py).
Its workers are already stopped by then; nothing is lost by not joining those threads.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback


def exit_code(error: SystemExit) -> int:
    """The process exit status a SystemExit asks for (as the interpreter computes it)."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    with contextlib.suppress(OSError, ValueError):
        print(error.code, file=sys.stderr)
    return 1


def main() -> None:
    """Run torchrun with this process's arguments, then leave without joining its threads."""
    from torch.distributed.run import main as torchrun

    code = 0
    try:
        torchrun(sys.argv[1:])
    except SystemExit as error:
        code = exit_code(error)
    except BaseException:  # printed as an uncaught one would be; the launcher parses it
        with contextlib.suppress(OSError, ValueError):
            traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the launcher may be gone
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
