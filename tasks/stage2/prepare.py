"""Stage-2 set-up in a short-lived process: the plan, the preflight checks and the samples file,
so that the launcher, which stays alive beside torchrun for the whole run, never imports torch or a
family nor builds a model.

    python -m splitstage.tasks.stage2.prepare REQUEST.json REPLY.json

(A one-process job's rank runs the same set-up first, then trains: `worker --set-up-first`.)

REQUEST holds the job config (as the run spec holds it), the run id and the run root; REPLY gets
what the launcher needs to hold the run's leases and write its spec (`prepare`), or the error that
stopped it (`error_reply`): a `UserError` as its message and class names (the launcher raises it
again, one line), an OSError as its errno, anything else as its traceback.
`tasks/stage2/prepare_child.py` starts this process and reads the reply.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

from splitstage.config.job import config_from_dict
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.process_imports import skip_unused_libraries
from splitstage.tasks.stage2.outputs import run_paths
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.process_exit import leave

SAMPLES_FILE = "samples.safetensors"  # staged here; the launcher moves it into the run folder


def prepare(plan: JobPlan, run_id: str, run_root: str | Path, staging: Path) -> dict[str, Any]:
    """Resolve the run's places and check everything before launch (each once, on the plan
    this process made); the keys to train on, when they are not the cache's manifest, are
    written into `staging`."""
    config = plan.config
    paths = run_paths(config, run_id, run_root)
    checks = preflight(plan, paths)
    samples_file = None
    if checks.samples is not None:  # compact: 32 bytes a sample key
        samples_file = str(staging / SAMPLES_FILE)
        checks.samples.save(samples_file)
    return {
        "paths": paths,
        "warnings": list(checks.warnings),
        "notes": list(checks.notes),
        "cache_key": None if config.train.mode == "unsplit" else plan.cache_key,
        "split": plan.split.to_dict(),
        "settings": checks.settings,
        "samples_file": samples_file,
    }


def error_reply(error: BaseException) -> dict[str, Any]:
    """What the launcher needs to raise `error` again: bad input as its message and the names of
    its classes, an OSError as its errno and path, a bug as its traceback."""
    text = "".join(traceback.format_exception(error))
    if isinstance(error, UserError):
        classes = [[cls.__module__, cls.__qualname__] for cls in type(error).__mro__]
        return {"kind": "user", "message": str(error), "classes": classes}
    if isinstance(error, OSError) and error.errno is not None:
        filename = None if error.filename is None else str(error.filename)
        return {
            "kind": "os",
            "errno": error.errno,
            "strerror": error.strerror,
            "filename": filename,
            "traceback": text,
        }
    return {"kind": "bug", "traceback": text}


def set_up(request_path: str, reply_path: str) -> tuple[int, JobPlan | None]:
    """Prepare the run REQUEST describes; write the reply (or the error) to REPLY; the exit
    code and the plan (None when it failed)."""
    request = json.loads(Path(request_path).read_text())
    skip_unused_libraries(request.get("config") or {})  # this process serves this one job
    code, plan = 0, None
    try:
        config = config_from_dict(request["config"])
        staging = Path(reply_path).parent
        plan = make_plan(config)
        run = (request["run_id"], request["run_root"], staging)
        reply = {"prepared": prepare(plan, *run)}
    except Exception as error:
        reply = {"error": error_reply(error)}
        code, plan = 1 if reply["error"]["kind"] == "bug" else 2, None
    partial = Path(f"{reply_path}.partial")  # the launcher reads a whole reply or none
    partial.write_text(json.dumps(reply))
    partial.replace(reply_path)
    return code, plan


def main(argv: list[str] | None = None) -> int:
    """Prepare the run REQUEST describes; write the reply (or the error) to REPLY."""
    request_path, reply_path = sys.argv[1:] if argv is None else argv
    return set_up(request_path, reply_path)[0]


if __name__ == "__main__":
    leave(main())
