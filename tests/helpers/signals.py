"""Child processes that take Ctrl-C as a terminal's foreground process does."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """`preexec_fn` restoring SIGINT's default: a shell's background job (CI started with `&`)
    ignores SIGINT, and an ignored SIGINT survives exec, so the CLI would never see Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
