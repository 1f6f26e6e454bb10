"""Stage 2 entry point under torchrun: read the run spec, pick the trainer, train, leave the group.

    torchrun --nproc-per-node N -m splitstage.tasks.stage2.worker RUN_DIR/spec.json

A rank that stops on bad input (a `UserError`: a diverged loss, a cache it cannot read) writes
its one-line reason to RUN_DIR/error.json and exits with 2; the launcher reports that line.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from splitstage.splitter import UserError
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.outputs import ERROR_FILE, deleted_place
from splitstage.tasks.stage2.process_exit import leave
from splitstage.tasks.stage2.trainer import Trainer


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
    """Train one rank to the end of the run the spec file describes."""
    argv = sys.argv[1:] if argv is None else argv
    faulthandler.enable(all_threads=True)  # a rank killed by a signal shows where it was
    spec = json.loads(Path(argv[0]).read_text())
    trainer_cls = Trainer
    if spec["config"]["train"]["parallelism"] == "pp":  # torch's pipelining: ~1 s of imports
        from splitstage.tasks.stage2.pp_trainer import PipelineTrainer as trainer_cls
    try:
        trainer_cls(spec).run()
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
