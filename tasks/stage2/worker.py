"""Stage 2 entry point under torchrun: read the run spec, pick the trainer, train, leave the group.

    torchrun --nproc-per-node N -m splitstage.tasks.stage2.worker RUN_DIR/spec.json
    python -m splitstage.tasks.stage2.worker --set-up-first REQUEST.json REPLY.json

The second form is a one-process job's rank (no torchrun agent, see `torchrun.py`): it runs the
launcher's set-up first (`prepare.set_up`: plan, checks, reply), then reads one line from stdin,
the rank's arguments as a JSON list, and trains with the plan it already built (imports, plan
and checks once, not in a set-up child and again in the rank); an empty stdin (the launcher
stopped before launch) ends it.

A rank that stops on bad input (a `UserError`: a diverged loss, a cache it cannot read) writes
its one-line reason to RUN_DIR/error.json and exits with 2; the launcher reports that line.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

from splitstage.splitter import UserError
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.process_imports import skip_unused_libraries
from splitstage.tasks.stage2.outputs import ERROR_FILE, deleted_place
from splitstage.tasks.stage2.prepare import set_up
from splitstage.tasks.stage2.prepare_child import SET_UP_FIRST
from splitstage.tasks.stage2.process_exit import leave


def report_error(run_dir: Path, error: UserError) -> None:
    """Leave the reason for the launcher (the first rank to write wins), then say it."""
    rank = int(os.environ.get("RANK", "0"))
    print(f"[rank{rank}] splitstage: error: {error}", file=sys.stderr, flush=True)
    path = run_dir / ERROR_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as handle:
        json.dump({"rank": rank, "message": str(error)}, handle)


def main(argv: list[str] | None = None) -> int:
    """Train one rank to the end of the run the spec file describes; with --set-up-first, run
    the launcher's set-up, then train once told to (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    faulthandler.enable(all_threads=True)  # a rank killed by a signal shows where it was
    if argv[:1] != [SET_UP_FIRST]:
        return train(argv[0])
    code, plan = set_up(*argv[1:])
    if code:
        return code
    told = sys.stdin.readline()
    if not told.strip():  # the launcher stopped before launch: nothing to do
        return 0
    return train(json.loads(told)[0], plan)


def train(spec_path: str, plan: JobPlan | None = None) -> int:
    """Train this rank (with the set-up's `plan` when this process ran it); 2 on bad input."""
    spec = json.loads(Path(spec_path).read_text())
    skip_unused_libraries(spec["config"])
    from torch.distributed.checkpoint.api import CheckpointException

    from splitstage.tasks.stage2.distributed import close_distributed
    from splitstage.tasks.stage2.trainer import Trainer

    trainer_cls = Trainer
    if spec["config"]["train"]["parallelism"] == "pp":  # torch's pipelining: ~1 s of imports
        from splitstage.tasks.stage2.pp_trainer import PipelineTrainer as trainer_cls
    try:
        trainer_cls(spec, plan).run()
        close_distributed(barrier=True)
    except UserError as error:
        report_error(Path(spec["run_dir"]), error)
        return 2
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        # a write into a folder deleted mid-run: one line, not a traceback
        gone = deleted_place(spec, spec.get("holds_lease", True))
        if gone is None:
            raise
        reason = f"the folder {gone} was deleted while training ({type(error).__name__})"
        report_error(Path(spec["run_dir"]), UserError(reason))
        return 2
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    leave(main())
