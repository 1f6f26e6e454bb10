"""What a process that serves one job may skip importing: a library the job cannot use.

Only for processes that run one job and end (a rank, the set-up child, the `splitstage` console
script): a long-lived process (a Prefect worker, a notebook, a test session) may run another job
next that needs what this one skips.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

UNUSED_UNLESS = {"bitsandbytes": "adamw8bit"}  # library -> the one train.optimizer that uses it


def skip_unused_libraries(config: Mapping[str, Any]) -> None:
    """Mark bitsandbytes absent unless the job (a config dict) trains with `adamw8bit`, its only
    use here: peft, diffusers and transformers import it whenever it is installed (~1.5 s of
    each process start here). `sys.modules[name] = None` is Python's way to say so: every
    `find_spec` then answers "not installed" and an import fails, so no library half-uses it."""
    optimizer = config.get("train", {}).get("optimizer", "adamw")
    for library, user in UNUSED_UNLESS.items():
        if optimizer != user:
            sys.modules.setdefault(library, None)  # type: ignore[arg-type]
